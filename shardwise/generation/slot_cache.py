"""The engine's KV cache: one static slot per running sequence, each as long as the context.

Keys and values are, per layer, [slots, kv_heads, capacity + 1, head_dim]. A sequence holds one
slot from admission to its end, and writes position p of its slot at column p.

Why static slots and not paged blocks (vLLM's PagedAttention): a paged cache saves memory
when sequences are much shorter than the context, but its attention must gather keys
through a block table, which needs a custom kernel to be fast (there is none on CPU, and
SDPA takes contiguous keys). A slot's keys are a contiguous view, so a decode step is
plain SDPA over `cache[:, :rows, :, :key_len]` with static shapes, which `torch.compile`
and CUDA graphs want; the price, slots x context of memory, is fixed by the flags before
the first request instead of being discovered under load.

A sliding-window model (`model.sliding_window`) passes its window to `attend`, which then also
hides the keys that fell out of each query's window (the same rule as training's,
`attention.sliding_window_mask`). The slot still keeps every position: a rolling buffer of
`window` columns would save memory for long contexts, at the price of the plain column = position
layout every step relies on.

The last column (index `capacity`) is scratch: a step's rows that carry no token (an idle
slot inside the decode batch, padding of a shorter prompt chunk) write there and attend
only to position 0, so they cost a little compute and never touch a live sequence.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from shardwise.models.common.attention import sdpa, sliding_window_mask
from shardwise.models.common.cross_attention import masked_attention


@dataclass
class StepRows:
    """Where one forward step reads and writes.

    `slots_B` are the slots of the B rows (None: rows 0..B-1 are slots 0..B-1, the decode batch,
    whose keys are read as a view); `positions_BS` each token's position (0 for padding);
    `write_BS` the column each token's k/v go to (`capacity` for padding); `key_len` how many
    columns attention reads (a bucket, so that decode shapes repeat); `output_B` the one column of
    each row whose logits the step returns (a prefill's last prompt token; None: every column)."""

    slots_B: torch.Tensor | None
    positions_BS: torch.Tensor
    write_BS: torch.Tensor
    key_len: int
    output_B: torch.Tensor | None = None


class SlotKVCache:
    def __init__(self, *, num_layers: int, num_slots: int, capacity: int):
        self.num_layers, self.num_slots, self.capacity = num_layers, num_slots, capacity
        self.keys = self.values = None  # allocated on first use: under tensor parallelism a rank holds
        self.rows: StepRows | None = None  # n_kv_heads / tp heads, which only the keys show
        self.slot_index_B1 = self.key_pos_T = self.mask_B1ST = None

    def allocate(self, k_BHSD: torch.Tensor) -> None:
        self.keys, self.values = static_keys_values(k_BHSD, self.num_layers, self.num_slots, self.capacity + 1)

    def begin(self, rows: StepRows) -> None:
        """Set up a step: what every layer's `attend` shares (the rows' slots, the attention mask)."""
        self.rows = rows
        batch = rows.positions_BS.shape[0]
        device = rows.positions_BS.device
        self.slot_index_B1 = (torch.arange(batch, device=device) if rows.slots_B is None else rows.slots_B)[:, None]
        self.key_pos_T = torch.arange(rows.key_len, device=device)
        self.mask_B1ST = self.mask(window=0)

    def mask(self, window: int) -> torch.Tensor:
        """[B, 1, S, key_len] bool: which cached columns each of the step's tokens attends."""
        return sliding_window_mask(self.rows.positions_BS, self.key_pos_T, window)[:, None]

    # The model's side: the step's positions, then `attend` once per layer.
    def positions(self, seq_len: int, device) -> torch.Tensor:
        return self.rows.positions_BS

    def output_states(self, h_BSD: torch.Tensor) -> torch.Tensor:
        """The hidden states the step's logits are made from: [B, 1, D] at `rows.output_B`, else all
        of h. A prefill needs one token's logits a row; the head over every prompt token cost 13% of
        a demo-model prefill (16 prompts of 32-39 tokens: 48.4 -> 42.0 ms, CPU)."""
        if self.rows.output_B is None:
            return h_BSD
        return h_BSD[torch.arange(h_BSD.shape[0], device=h_BSD.device), self.rows.output_B][:, None]

    def attend(self, layer_idx: int, q_BHSD, k_BHSD, v_BHSD, window: int = 0, *,
               bias_BHST: torch.Tensor | None = None, scale: float | None = None) -> torch.Tensor:
        """Write the step's keys and values, then attend over the slot's columns. `bias_BHST` an
        additive score bias over the `key_len` columns (T5's relative positions), `scale` the
        factor on q k^T (None: 1/sqrt(head_dim))."""
        if self.keys is None:
            self.allocate(k_BHSD)
        rows = self.rows
        batch = q_BHSD.shape[0]
        keys, values = self.keys[layer_idx], self.values[layer_idx]
        write_kv_into(keys, values, self.slot_index_B1, rows.write_BS, k_BHSD.to(keys.dtype), v_BHSD.to(values.dtype))
        if rows.slots_B is None:
            k_BHTD, v_BHTD = keys[:batch, :, :rows.key_len], values[:batch, :, :rows.key_len]
        else:
            k_BHTD, v_BHTD = keys[rows.slots_B, :, :rows.key_len], values[rows.slots_B, :, :rows.key_len]
        # A window's mask is built per layer (one comparison of [B, S, key_len]): cheap next to SDPA.
        mask = self.mask(window) if window else self.mask_B1ST
        k_BHTD, v_BHTD = k_BHTD.to(q_BHSD.dtype), v_BHTD.to(q_BHSD.dtype)
        if bias_BHST is not None or scale is not None:
            return masked_attention(q_BHSD, k_BHTD, v_BHTD, bias_BHST, mask, scale)
        return sdpa(q_BHSD, k_BHTD, v_BHTD, attn_mask=mask)


def static_keys_values(k_BHSD: torch.Tensor, num_layers: int, num_slots: int, columns: int):
    """Zeroed keys and values, one [slots, heads, columns, head_dim] tensor per layer, with k's heads,
    width, dtype and device, at fixed addresses: CUDA graphs (the compiled decode step) may then mutate
    them in place instead of refusing to record a step that writes to an input.

    A tensor per layer rather than one [layers, ...] tensor: inductor turns a compiled step's write
    into a whole input (`write_kv_into`'s indexing) into an in-place kernel, but a write into a
    layer's view of a larger input into a copy of all of it, every step (measured: 10x slower than
    eager). Until commit 355faf3 the write was an opaque operator for that reason, whose call back into
    Python from the compiled step cost ~0.1 ms a layer (7% of a 16-row demo-model step, CPU)."""
    _, heads, _, head_dim = k_BHSD.shape
    shape = (num_slots, heads, columns, head_dim)
    keys = [torch.zeros(shape, device=k_BHSD.device, dtype=k_BHSD.dtype) for _ in range(num_layers)]
    values = [torch.zeros_like(layer) for layer in keys]
    for cache in keys + values:
        torch._dynamo.mark_static_address(cache)
    return keys, values


def write_kv_into(keys: torch.Tensor, values: torch.Tensor, slot_index_B1: torch.Tensor, write_BS: torch.Tensor,
                  k_BHSD: torch.Tensor, v_BHSD: torch.Tensor) -> None:
    """keys[slot_b, :, write[b, s]] = k[b, :, s] (and values alike), in place: one layer's cache."""
    # [B, 1] and [B, S] indices around a full slice: the written block is [B, S, heads, head_dim].
    keys[slot_index_B1, :, write_BS] = k_BHSD.transpose(1, 2)
    values[slot_index_B1, :, write_BS] = v_BHSD.transpose(1, 2)
