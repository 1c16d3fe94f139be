"""A preallocated key/value cache: generation computes each position's keys and values once."""

from __future__ import annotations

import torch

from shardwise.config.model import ModelConfig


class KVCache:
    """Keys/values of every layer, [layers, batch, kv_heads, max_len, head_dim] each.

    The model calls `update` once per layer with the new positions' k/v and gets back all
    positions so far; after the last layer it calls `advance` with the number of new positions.
    """

    def __init__(self, cfg: ModelConfig, *, batch_size: int, max_len: int, device, dtype=torch.float32):
        self.num_layers, self.max_len = cfg.n_layers, max_len
        self.keys = self.values = None  # allocated on first use: under tensor parallelism a rank
        self.length = 0                 # holds n_kv_heads / tp heads, which only the keys show

    def allocate(self, k_BHSD: torch.Tensor) -> None:
        batch, heads, _, head_dim = k_BHSD.shape
        shape = (self.num_layers, batch, heads, self.max_len, head_dim)
        self.keys = torch.zeros(shape, device=k_BHSD.device, dtype=k_BHSD.dtype)
        self.values = torch.zeros_like(self.keys)

    def update(self, layer_idx: int, k_BHSD: torch.Tensor, v_BHSD: torch.Tensor):
        if self.keys is None:
            self.allocate(k_BHSD)
        end = self.length + k_BHSD.shape[2]
        if end > self.max_len:
            raise ValueError(f"generation reached {end} tokens but the KV cache holds {self.max_len}; "
                             "ask for fewer new tokens or a shorter prompt")
        self.keys[layer_idx, :, :, self.length:end] = k_BHSD
        self.values[layer_idx, :, :, self.length:end] = v_BHSD
        return self.keys[layer_idx, :, :, :end], self.values[layer_idx, :, :, :end]

    def advance(self, num_positions: int) -> None:
        self.length += num_positions
