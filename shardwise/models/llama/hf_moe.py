"""HF `transformers` Mixtral and Qwen2-MoE <-> shardwise MoE: config fields and expert weights.

Both store one Linear per expert on disk (what `save_pretrained` writes in 4.x and 5.x):

    Mixtral    model.layers.i.block_sparse_moe.gate.weight          [E, D]  -> layers.i.mlp.router.weight
               ...block_sparse_moe.experts.e.w1 / w3 / w2.weight   gate [F, D], up [F, D], down [D, F]
    Qwen2-MoE  model.layers.i.mlp.gate.weight                       [E, D]  -> layers.i.mlp.router.weight
               ...mlp.experts.e.gate_proj / up_proj / down_proj.weight
               ...mlp.shared_expert.{gate,up,down}_proj.weight             -> layers.i.mlp.shared_experts.*
               ...mlp.shared_expert_gate.weight                   [1, D]  -> layers.i.mlp.shared_gate.weight

shardwise stacks an expert's matrices input-major: experts.gate_proj [E, D, F] = stack(w1^T),
experts.down_proj [E, F, D] = stack(w2^T). `stack_experts` turns the HF names into
"HF-spelled shardwise names" (model.layers.i.mlp.router.weight, ...mlp.experts.gate_proj) that
hf_adapter's generic renames finish; `unstack_experts` undoes it after them.

Routing: Mixtral = softmax, top-k, renormalised; Qwen2-MoE = softmax, top-k, renormalised only
with norm_topk_prob, plus a sigmoid-gated shared expert. HF routes dropless: export a model
trained with capacity dropping and HF computes every assignment (so does shardwise with
model.capacity_factor = 0).
"""

from __future__ import annotations

import re

import torch

from shardwise.models.llama.hf_moe_config import MOE_ARCHITECTURES

_EXPERT_NAMES = {  # our stacked name -> (HF per-expert name) per arch
    "mixtral": {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"},
    "qwen2_moe": {"gate_proj": "gate_proj", "up_proj": "up_proj", "down_proj": "down_proj"},
}
_HF_EXPERT = re.compile(r"model\.layers\.(\d+)\.(?:block_sparse_moe|mlp)\.experts\.(\d+)\.(\w+)\.weight")
_RENAMES_FROM_HF = (  # after stacking, longest first
    (".block_sparse_moe.gate.weight", ".mlp.router.weight"),
    (".mlp.shared_expert_gate.", ".mlp.shared_gate."),
    (".mlp.shared_expert.", ".mlp.shared_experts."),
    (".mlp.gate.weight", ".mlp.router.weight"),
)
_RENAMES_TO_HF = {
    "mixtral": ((".mlp.router.weight", ".block_sparse_moe.gate.weight"),),
    "qwen2_moe": tuple((ours, hf) for hf, ours in _RENAMES_FROM_HF[1:]),
}


# -- weights ---------------------------------------------------------------------------------


def stack_experts(hf_sd: dict[str, torch.Tensor], cfg) -> dict[str, torch.Tensor]:
    """Per-expert HF tensors -> stacked ones under HF-spelled shardwise names. A layer whose
    experts are incomplete is left alone, so the caller's key check reports it."""
    if not cfg.n_experts:
        return hf_sd
    found: dict[tuple[str, str], dict[int, torch.Tensor]] = {}
    rest = {}
    for name, tensor in hf_sd.items():
        match = _HF_EXPERT.fullmatch(name)
        if match is None:
            rest[_first_rename(name, _RENAMES_FROM_HF)] = tensor
            continue
        layer, expert, kind = match.groups()
        found.setdefault((layer, kind), {})[int(expert)] = (name, tensor)
    ours_of = {hf: ours for names in _EXPERT_NAMES.values() for ours, hf in names.items()}
    for (layer, kind), by_expert in found.items():
        if sorted(by_expert) != list(range(cfg.n_experts)) or kind not in ours_of:
            rest.update(dict(by_expert.values()))
            continue
        stacked = torch.stack([by_expert[e][1].t() for e in range(cfg.n_experts)])
        rest[f"model.layers.{layer}.mlp.experts.{ours_of[kind]}"] = stacked
    return rest


def _first_rename(name: str, renames) -> str:
    for old, new in renames:
        if old in name:
            return name.replace(old, new)
    return name


def unstack_experts(hf_sd: dict[str, torch.Tensor], cfg, arch: str) -> dict[str, torch.Tensor]:
    """The inverse of `stack_experts` for `arch` (views: nothing is copied here)."""
    if not cfg.n_experts:
        return hf_sd
    moe_prefix = "block_sparse_moe" if arch == "mixtral" else "mlp"
    stacked = re.compile(r"model\.layers\.(\d+)\.mlp\.experts\.(\w+)")
    out = {}
    for name, tensor in hf_sd.items():
        match = stacked.fullmatch(name)
        if match is None:
            out[_first_rename(name, _RENAMES_TO_HF[arch])] = tensor
            continue
        layer, kind = match.groups()
        hf_kind = _EXPERT_NAMES[arch][kind]
        for e in range(tensor.shape[0]):
            out[f"model.layers.{layer}.{moe_prefix}.experts.{e}.{hf_kind}.weight"] = tensor[e].t()
    return out
