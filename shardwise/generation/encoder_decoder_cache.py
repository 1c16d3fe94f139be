"""The engine's cache for an encoder-decoder (T5): per slot, the decoder's own keys and values
(a `SlotKVCache`) and the cross-attention keys and values of the encoder output.

A sequence's prompt is the encoder's input. When the sequence starts (`EncoderDecoderRunner.start`)
the encoder runs once over it and every decoder block stores the keys and values of the encoder
output in the slot (`store_source`), per layer [slots, heads, capacity, head_dim], with the prompt's
length; each decode step's cross-attention then reads them (`cross_attend`), the columns beyond
the prompt masked. The decoder's self-attention caches as a decoder-only model's does, with T5's
relative position bias added to its scores. Cross-attention reads all `capacity` columns of a
slot every step (static shapes for a compiled step); a short prompt pays for the masked rest.
"""

from __future__ import annotations

import torch

from shardwise.generation.slot_cache import SlotKVCache, StepRows, static_keys_values
from shardwise.models.common.cross_attention import masked_attention


class EncoderDecoderCache:
    def __init__(self, *, num_layers: int, num_slots: int, capacity: int):
        self.num_layers, self.num_slots, self.capacity = num_layers, num_slots, capacity
        self.decoder = SlotKVCache(num_layers=num_layers, num_slots=num_slots, capacity=capacity)
        self.keys = self.values = None  # the encoder output's, allocated on first use (heads, dtype)
        self.source_lengths = None
        self.rows: StepRows | None = None
        self.source_keep_B11T = None

    # ---- the runner's side ----
    def begin(self, rows: StepRows) -> None:
        """Set up a decoder step (rows and positions as `SlotKVCache.begin`)."""
        self.rows = rows
        self.decoder.begin(rows)
        if self.source_lengths is not None:
            lengths = self.row_view(self.source_lengths)
            columns = torch.arange(self.capacity, device=lengths.device)
            self.source_keep_B11T = (columns[None, :] < lengths[:, None])[:, None, None, :]

    def set_source_lengths(self, slots_B: torch.Tensor, lengths_B: torch.Tensor) -> None:
        if self.source_lengths is None:
            self.source_lengths = torch.zeros(self.num_slots, dtype=torch.long, device=lengths_B.device)
            torch._dynamo.mark_static_address(self.source_lengths)
        self.source_lengths[slots_B] = lengths_B

    def row_view(self, per_slot: torch.Tensor) -> torch.Tensor:
        """The step's rows of a per-slot tensor: slots 0..B-1 (a decode step) or the named slots."""
        rows = self.rows
        return per_slot[:rows.positions_BS.shape[0]] if rows.slots_B is None else per_slot[rows.slots_B]

    # ---- the model's side ----
    def positions(self, seq_len: int, device) -> torch.Tensor:
        return self.rows.positions_BS

    @property
    def key_positions_T(self) -> torch.Tensor:
        return self.decoder.key_pos_T

    def self_attend(self, layer: int, q_BHSD, k_BHSD, v_BHSD, bias_BHST, scale: float | None) -> torch.Tensor:
        return self.decoder.attend(layer, q_BHSD, k_BHSD, v_BHSD, bias_BHST=bias_BHST, scale=scale)

    def store_source(self, layer: int, k_BHSD: torch.Tensor, v_BHSD: torch.Tensor) -> None:
        """The encoder output's keys and values for the step's slots (columns 0..S-1)."""
        if self.keys is None:
            self.keys, self.values = static_keys_values(k_BHSD, self.num_layers, self.num_slots, self.capacity)
        slots = self.rows.slots_B
        width = k_BHSD.shape[2]
        keys, values = self.keys[layer], self.values[layer]
        keys[slots, :, :width] = k_BHSD.to(keys.dtype)
        values[slots, :, :width] = v_BHSD.to(values.dtype)

    def cross_attend(self, layer: int, q_BHSD: torch.Tensor, scale: float | None) -> torch.Tensor:
        keys, values = self.row_view(self.keys[layer]), self.row_view(self.values[layer])
        return masked_attention(q_BHSD, keys.to(q_BHSD.dtype), values.to(q_BHSD.dtype), None,
                                self.source_keep_B11T, scale)
