"""`shardwise rules`: every rewrite rule, and how many times it fires on the model's blocks."""

from __future__ import annotations

import torch

from shardwise.compile.rules.backend import count_matches
from shardwise.compile.rules.registry import RULES


def block_kinds(model_cfg) -> dict[str, int]:
    """One representative layer index per kind of block (dense, mixture-of-experts)."""
    kinds = {}
    for layer in range(model_cfg.n_layers):
        kinds.setdefault("moe" if model_cfg.is_moe_layer(layer) else "dense", layer)
    return kinds


NARROW = dict(head_width=8, ffn_dim=32, moe_ffn_dim=16, seq_len=16)
"""The narrowed copy of a block the rules are counted on (a match depends on the block's
structure, not its widths; a real 70B block would need gigabytes, and the meta device cannot
run the data-dependent routing of a mixture-of-experts block)."""


def narrowed(model_cfg):
    """The same blocks (heads, kv heads, experts, norms, RoPE, biases) at head width 8."""
    import dataclasses

    return dataclasses.replace(
        model_cfg, dim=model_cfg.n_heads * NARROW["head_width"], head_dim=0, ffn_dim=NARROW["ffn_dim"],
        moe_ffn_dim=NARROW["moe_ffn_dim"] if model_cfg.moe_ffn_dim else 0, max_seq_len=NARROW["seq_len"],
        rope_original_max_seq_len=min(model_cfg.rope_original_max_seq_len, NARROW["seq_len"]))


def block_matches(model_cfg, layer: int) -> dict[str, int]:
    """Matches of each rule on the graph(s) of block `layer` (narrowed, see NARROW)."""
    from shardwise.models.common.rope import RopeSpec, rope_cos_sin
    from shardwise.models.llama.model import Block

    small = narrowed(model_cfg)
    block = Block(small, layer)
    for param in block.parameters():
        if param.dim() > 1:
            torch.nn.init.normal_(param, std=0.02)
        else:
            torch.nn.init.ones_(param)
    x = torch.randn(1, NARROW["seq_len"], small.dim)
    cos, sin = rope_cos_sin(RopeSpec.of(small), torch.arange(NARROW["seq_len"]), x.dtype)
    with torch.no_grad():
        return count_matches(block, x, cos, sin)


def rules_report(cfg) -> str:
    model, kinds = cfg.model, block_kinds(cfg.model)
    counts = {kind: block_matches(model, layer) for kind, layer in kinds.items()}
    n_blocks = {kind: sum(1 for i in range(model.n_layers) if ("moe" if model.is_moe_layer(i) else "dense") == kind)
                for kind in kinds}
    header = f"{'rule':<14}" + "".join(f"{f'per {kind} block':>18}" for kind in kinds) + f"{'whole model':>13}  what it does"
    lines = [f"rewrite rules on model.preset = {model.preset} ({model.n_layers} blocks; applied when "
             f"train.compile and train.rewrite_rules are on)", header, "-" * len(header)]
    for rule in RULES:
        total = sum(counts[kind][rule.name] * n_blocks[kind] for kind in kinds)
        lines.append(f"{rule.name:<14}" + "".join(f"{counts[kind][rule.name]:>18}" for kind in kinds)
                     + f"{total:>13}  {rule.description}")
    lines.append(f"{'linear_cross_entropy':<14}  module-level, not a graph rule: "
                 + ("on" if cfg.train.chunked_loss else "off") + " (train.chunked_loss)")
    return "\n".join(lines)

