"""The two programs of an exported model, prefill and decode, and their AOTInductor package.

    prefill(tokens [B, S], pad [B])                    -> logits [B, V], keys [L, B, H, S, D], values
    decode(tokens [B, 1], pad [B], keys [L, B, H, T, D], values) -> logits [B, V], keys [L, B, H, 1, D], values

`pad[b]` is how many columns row b's prompt was left-padded by (generation/functional_cache.py);
the logits are the last column's, every row's newest token; the caller appends a step's keys and
values to the cache it holds (`torch.cat` on dimension 3) and passes the whole cache to the next
decode. Batch, prompt length and cache length are dynamic: one package serves any batch and any
length up to model.max_seq_len.

`torch._inductor.aoti_compile_and_package` compiles one exported program; a package of several is
what its docstring shows: `aot_compile(..., {"aot_inductor.package": True})` per program, then
`package_aoti` of them by name, each loaded with `torch._inductor.package.load_package(path, name)`.
Each program holds its own copy of the weights (AOTInductor keeps a model's constants with it).
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn
from torch.export import Dim

from shardwise.generation.functional_cache import FunctionalKVCache

PROGRAM_NAMES = ("prefill", "decode")
EXAMPLE_BATCH, EXAMPLE_PROMPT, EXAMPLE_PAST = 2, 3, 3
"""Example sizes to trace with: above 1, since torch.export specialises a dimension that is 0 or 1
in its example to that value."""


class Prefill(nn.Module):
    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, tokens_BS: torch.Tensor, pad_B: torch.Tensor):
        cache = FunctionalKVCache(pad_B)
        logits_BV = self.model(tokens_BS, kv_cache=cache)[:, -1]
        return (logits_BV, *cache.stacked_new())


class Decode(nn.Module):
    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, tokens_B1: torch.Tensor, pad_B: torch.Tensor, keys_LBHTD: torch.Tensor,
                values_LBHTD: torch.Tensor):
        cache = FunctionalKVCache(pad_B, keys_LBHTD, values_LBHTD)
        logits_BV = self.model(tokens_B1, kv_cache=cache)[:, -1]
        return (logits_BV, *cache.stacked_new())


def cache_shape(model: nn.Module, batch: int, length: int) -> tuple[int, ...]:
    """[layers, batch, kv_heads, length, head_dim]: one of the keys/values tensors the programs pass."""
    cfg = model.cfg
    return (cfg.n_layers, batch, cfg.n_kv_heads, length, cfg.head_size)


@torch.no_grad()
def export_programs(model: nn.Module) -> dict[str, torch.export.ExportedProgram]:
    """Both programs traced with symbolic batch, prompt and cache lengths. Example inputs are fresh,
    contiguous tensors: a program assumes its inputs' strides, and a strided example (a slice of a
    wider tensor) compiled to a program that read the wrong tokens at any batch above 1."""
    weight = next(model.parameters())
    max_len = model.cfg.max_seq_len
    batch = Dim("batch", min=1)
    prompt, past = Dim("prompt", min=1, max=max_len), Dim("past", min=1, max=max_len - 1)
    tokens = torch.zeros(EXAMPLE_BATCH, EXAMPLE_PROMPT, dtype=torch.long, device=weight.device)
    pad = torch.zeros(EXAMPLE_BATCH, dtype=torch.long, device=weight.device)
    past_kv = torch.zeros(cache_shape(model, EXAMPLE_BATCH, EXAMPLE_PAST), dtype=weight.dtype, device=weight.device)
    prefill = torch.export.export(Prefill(model), (tokens, pad), dynamic_shapes=({0: batch, 1: prompt}, {0: batch}))
    kv_dims = {1: batch, 3: past}
    decode = torch.export.export(Decode(model), (tokens[:, :1].clone(), pad, past_kv, past_kv.clone()),
                                 dynamic_shapes=({0: batch}, {0: batch}, kv_dims, kv_dims))
    return {"prefill": prefill, "decode": decode}


def compile_package(programs: dict[str, torch.export.ExportedProgram], path: Path) -> None:
    """AOTInductor-compile each program and package them together at `path` (a .pt2 file)."""
    from torch._inductor import aot_compile
    from torch._inductor.package import package_aoti

    files = {}
    for name, program in programs.items():
        args, kwargs = program.example_inputs
        files[name] = aot_compile(program.module(check_guards=False), args, kwargs,
                                  options={"aot_inductor.package": True})
    package_aoti(str(path), files)


def signature() -> dict:
    """The programs' inputs and outputs, as the manifest states them (symbolic sizes by name)."""
    kv = "[layers, batch, kv_heads, {}, head_dim]"
    return {
        "prefill": {"inputs": {"tokens": "[batch, prompt] int64", "pad": "[batch] int64"},
                    "outputs": {"logits": "[batch, vocab]", "keys": kv.format("prompt"), "values": kv.format("prompt")}},
        "decode": {"inputs": {"tokens": "[batch, 1] int64", "pad": "[batch] int64", "keys": kv.format("past"),
                              "values": kv.format("past")},
                   "outputs": {"logits": "[batch, vocab]", "keys": kv.format(1), "values": kv.format(1)}},
    }
