"""A KV cache without state, for `torch.export`: past keys and values come in as tensors, the step's
new ones go out as tensors, and the caller concatenates.

The engine's `SlotKVCache` writes into preallocated slots in place; exported with dynamic lengths,
such a mutated buffer is what fails upstream (pytorch#124502, #152465). This object speaks the same
protocol the models call (`positions`, `attend`, `output_states`) functionally instead, so an
exported program is a pure function: prefill(tokens) -> (logits, k, v) and decode(token, past k,
past v) -> (logits, new k, new v). The models do not change: they know nothing of export.

The rows of a batch are left-padded to one length: row b's first `pad_B[b]` columns carry no token.
Column c of row b holds position c - pad_B[b], so every row's newest token sits in the last column,
whose logits the step returns, and a decode step adds one column to every row. Padding columns are
hidden from every query; a padding query attends to itself alone (an empty softmax would be NaN,
and a NaN value times a zero weight is NaN again: it would reach the real tokens' outputs).
"""

from __future__ import annotations

import torch

from shardwise.models.common.attention import sdpa


class FunctionalKVCache:
    def __init__(self, pad_B: torch.Tensor, past_keys_LBHTD: torch.Tensor | None = None,
                 past_values_LBHTD: torch.Tensor | None = None):
        self.pad_B = pad_B
        self.past_keys, self.past_values = past_keys_LBHTD, past_values_LBHTD
        self.new_keys: dict[int, torch.Tensor] = {}
        self.new_values: dict[int, torch.Tensor] = {}
        self.masks: dict[int, torch.Tensor] = {}  # by window: every layer of a window shares its mask

    @property
    def past_len(self) -> int:
        return 0 if self.past_keys is None else self.past_keys.shape[3]

    def query_columns(self, seq_len: int, device) -> torch.Tensor:
        return self.past_len + torch.arange(seq_len, device=device)

    # The model's side, as with `SlotKVCache`.
    def positions(self, seq_len: int, device) -> torch.Tensor:
        """[B, S]: each token's position in its row (padding at 0, any valid row of the table)."""
        return (self.query_columns(seq_len, device)[None] - self.pad_B[:, None]).clamp(min=0)

    def output_states(self, h_BSD: torch.Tensor) -> torch.Tensor:
        """The last column's hidden state: every row's newest token (rows are left-padded)."""
        return h_BSD[:, -1:]

    def attend(self, layer_idx: int, q_BHSD, k_BHSD, v_BHSD, window: int = 0, *, bias_BHST=None,
               scale=None) -> torch.Tensor:
        if bias_BHST is not None or scale is not None:
            raise NotImplementedError("the functional KV cache attends without a score bias or scale (decoders)")
        self.new_keys[layer_idx], self.new_values[layer_idx] = k_BHSD, v_BHSD
        if self.past_keys is not None:
            k_BHSD = torch.cat([self.past_keys[layer_idx], k_BHSD], dim=2)
            v_BHSD = torch.cat([self.past_values[layer_idx], v_BHSD], dim=2)
        if window not in self.masks:
            self.masks[window] = self.mask(q_BHSD.shape[2], window, q_BHSD.device)
        return sdpa(q_BHSD, k_BHSD, v_BHSD, attn_mask=self.masks[window])

    def mask(self, seq_len: int, window: int, device) -> torch.Tensor:
        """[B, 1, S, T + S] bool: causal (within `window` if > 0) over the row's real columns, and
        each query's own column."""
        query_S1 = self.query_columns(seq_len, device)[:, None]
        key_T = torch.arange(self.past_len + seq_len, device=device)
        allowed_SK = key_T <= query_S1
        if window:
            allowed_SK = allowed_SK & (key_T > query_S1 - window)
        real_B1K = (key_T[None] >= self.pad_B[:, None])[:, None]
        return ((allowed_SK[None] & real_B1K) | (key_T == query_S1)[None])[:, None]

    def stacked_new(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The step's keys and values, [layers, B, kv_heads, S, head_dim] each."""
        layers = sorted(self.new_keys)
        return (torch.stack([self.new_keys[i] for i in layers]), torch.stack([self.new_values[i] for i in layers]))
