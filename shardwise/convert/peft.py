"""`shardwise convert --to-peft RUN --out OUT`: a LoRA run's adapters as a PEFT adapter directory
(`adapter_config.json` + `adapter_model.safetensors`) that `peft.PeftModel.from_pretrained` loads
onto the Hugging Face base the run trained beside (its train.init_from).

PEFT names an adapter by the HF module it wraps: `base_model.model.<HF module>.lora_A.weight` [r, in]
and `...lora_B.weight` [out, r] (PEFT leaves the adapter's own name out of the file). Which HF module
holds each of our adapted linears, and how, is learnt from the family's own export mapping
(`hf_adapter.state_dict_to_hf`, the one `--to-hf` writes with), not written a second time here:

  1. the mapping runs on meta tensors under `checkpoint/init_from.InputTracker`, which records the
     tensors each HF tensor is computed from; one it returns unchanged is a rename (a Linear);
  2. a computed one (GPT-2's c_attn: q, k and v concatenated and transposed into a Conv1D weight)
     is computed again from probes, each of its linears' weights filled with its own element
     indices (float64: exact), which show where each landed: a block of rows (a Linear, W [out, in])
     or of columns (a Conv1D, W^T [in, out]: PEFT's fan_in_fan_out).

Several of our linears in one HF module share one PEFT adapter of rank k x r: its A stacks their
A's, its B puts each B at its linear's rows (zeros elsewhere), so that B A = [B_1 A_1; ...; B_k A_k];
its lora_alpha is k x train.lora_alpha, which keeps the scale alpha / r (PEFT's rank_pattern and
alpha_pattern). A linear laid out otherwise (split over HF tensors, its rows permuted) is refused,
naming the family. target_modules are the shortest module-name suffixes that name the adapted
modules and no other (PEFT matches a name or its dotted suffix).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors.torch import save_file

from shardwise.checkpoint.init_from import InputTracker
from shardwise.checkpoint.store import MODEL_PREFIX, load_checkpoint, newest_valid_checkpoint, write_json_atomic
from shardwise.config.schema import Config
from shardwise.convert.hf import check_out_dir, check_run_dir
from shardwise.core.model import ModelConfig
from shardwise.distributed.lora_layout import build_adapted_on_meta
from shardwise.infer.load import check_checkpoint_of_run, read_run_config
from shardwise.models.build import build_on_meta, torch_family_of
from shardwise.models.common.lora import ADAPTER_SUFFIXES, is_adapter_name

ADAPTER_CONFIG, ADAPTER_WEIGHTS = "adapter_config.json", "adapter_model.safetensors"
PEFT_PREFIX = "base_model.model."
"""What `PeftModel` puts before the wrapped model's own module names."""


@dataclass
class HFLinear:
    """One HF module that holds adapted linears of ours."""

    module: str
    """Its name in the HF model, e.g. `model.layers.0.self_attn.q_proj`."""
    out_features: int
    transposed: bool = False
    """A Conv1D (GPT-2): its weight is [in, out] (PEFT's fan_in_fan_out)."""
    rows: dict[str, int] = field(default_factory=dict)
    """Our adapted linear -> its first output feature in the module."""


def export_run_to_peft(run_dir: Path, out: Path, *, checkpoint: Path | None = None) -> Path:
    check_run_dir(run_dir, "--to-peft")
    cfg = read_run_config(run_dir)
    if not cfg.train.lora_rank:
        raise ValueError(f"--to-peft {str(run_dir)!r} is invalid: the run trains every weight (train.lora_rank = 0), "
                         "so it has no adapters; export it with --to-hf")
    check_out_dir(out, run_dir, importing=False)
    adapters = adapter_weights(run_dir, cfg, checkpoint)
    modules, hf_modules = hf_linears(cfg.model, sorted(adapters))
    tensors = peft_tensors(adapters, modules)
    config = adapter_config(cfg, modules, hf_modules)  # every check done before the first byte is written
    out.mkdir(parents=True, exist_ok=True)
    tmp = out / f".{ADAPTER_WEIGHTS}.tmp"
    save_file(tensors, str(tmp), metadata={"format": "pt"})
    os.replace(tmp, out / ADAPTER_WEIGHTS)
    write_json_atomic(out / ADAPTER_CONFIG, config)
    return out


def adapter_weights(run_dir: Path, cfg: Config, checkpoint: Path | None) -> dict[str, tuple[torch.Tensor, ...]]:
    """Our adapted linear -> (A [r, in], B [out, r]) from the run's checkpoint (its adapters alone: the
    base is not read)."""
    if checkpoint is not None:
        check_checkpoint_of_run(Path(checkpoint), run_dir)
    checkpoint = checkpoint or newest_valid_checkpoint(run_dir)
    if checkpoint is None:
        raise ValueError(f"--to-peft {str(run_dir)!r} has no checkpoint yet; train it (checkpoint.at_end = true) first")
    adapters = {name: param for name, param in build_adapted_on_meta(cfg).named_parameters() if is_adapter_name(name)}
    tensors = {f"{MODEL_PREFIX}{name}": torch.empty(param.shape, dtype=param.dtype) for name, param in adapters.items()}
    load_checkpoint(checkpoint, tensors=tensors)
    a_suffix, b_suffix = (f".{suffix}" for suffix in ADAPTER_SUFFIXES)
    return {name.removesuffix(a_suffix): (tensors[f"{MODEL_PREFIX}{name}"],
                                          tensors[f"{MODEL_PREFIX}{name.removesuffix(a_suffix)}{b_suffix}"])
            for name in adapters if name.endswith(a_suffix)}


# -- where each adapted linear is in the HF model --------------------------------------------------


def hf_linears(model_cfg: ModelConfig, linears: list[str]) -> tuple[dict[str, HFLinear], list[str]]:
    """(HF weight name -> the HF module holding some of `linears`, our adapted linears; every HF module
    with a weight)."""
    to_hf = torch_family_of(model_cfg).hf_adapter.state_dict_to_hf
    ours = build_on_meta(model_cfg).state_dict()
    weights = {f"{linear}.weight": linear for linear in linears}
    with InputTracker(ours) as tracker:
        mapped = to_hf(dict(ours), model_cfg)
    found: dict[str, HFLinear] = {}
    for hf_name, tensor in mapped.items():
        sources = tracker.inputs_of(tensor) & weights.keys()
        if not sources:
            continue
        source = next(iter(sources))
        if tensor is ours[source]:  # a rename: the very tensor, in a Linear's layout
            found[hf_name] = HFLinear(hf_name.removesuffix(".weight"), tensor.shape[0], rows={weights[source]: 0})
        else:
            found[hf_name] = probe_layout(model_cfg, to_hf, ours, hf_name, tracker.inputs_of(tensor),
                                          {weights[name] for name in sources})
    placed = [linear for module in found.values() for linear in module.rows]
    if sorted(placed) != sorted(linears):
        refuse(model_cfg, "its HF export does not put each adapted linear's weight in exactly one HF weight")
    return found, [name.removesuffix(".weight") for name in mapped if name.endswith(".weight")]


def probe_layout(model_cfg: ModelConfig, to_hf, ours: dict, hf_name: str, inputs: frozenset[str],
                 linears: set[str]) -> HFLinear:
    """Where each of `linears` lies in HF tensor `hf_name`: the mapping run again with the tensors it is
    computed from (`inputs`) filled with their element indices, the others left on meta."""
    probes, start = {}, 0
    for name in sorted(inputs):
        shape = ours[name].shape
        probes[name] = torch.arange(start, start + shape.numel(), dtype=torch.float64).view(shape)
        start += shape.numel()
    hf = to_hf({**ours, **probes}, model_cfg)[hf_name]
    placements = {linear: placement_of(hf, probes[f"{linear}.weight"]) for linear in sorted(linears)}
    for linear, placement in placements.items():
        if placement is None:
            refuse(model_cfg, f"{linear} is neither whole rows nor whole columns of {hf_name}")
    if len({transposed for transposed, _ in placements.values()}) > 1:
        refuse(model_cfg, f"{hf_name} holds some adapted linears as rows and others as columns")
    transposed = next(iter(placements.values()))[0]
    return HFLinear(hf_name.removesuffix(".weight"), hf.shape[1] if transposed else hf.shape[0], transposed,
                    {linear: row for linear, (_, row) in placements.items()})


def placement_of(hf: torch.Tensor, probe: torch.Tensor) -> tuple[bool, int] | None:
    """(transposed, its first output feature) of `probe` [out, in] inside `hf`: a block of whole rows
    (a Linear) or of whole columns (a Conv1D, [in, out]); None: neither."""
    where = (hf == probe[0, 0]).nonzero()
    if hf.dim() != 2 or len(where) != 1:
        return None
    row, column = where[0].tolist()
    out_features, in_features = probe.shape
    if column == 0 and hf.shape[1] == in_features and torch.equal(hf[row:row + out_features], probe):
        return False, row
    if row == 0 and hf.shape[0] == in_features and torch.equal(hf[:, column:column + out_features], probe.t()):
        return True, column
    return None


def refuse(model_cfg: ModelConfig, why: str):
    raise ValueError(f"--to-peft is invalid for model.family {model_cfg.family}: {why}; PEFT takes only adapters "
                     "on whole HF linears; use --to-hf --merge")


# -- PEFT's tensors and config --------------------------------------------------------------------


def peft_tensors(adapters: dict, modules: dict[str, HFLinear]) -> dict[str, torch.Tensor]:
    """PEFT's lora_A and lora_B of each module: one linear's own, or several stacked (module docstring)."""
    tensors = {}
    for module in modules.values():
        parts = sorted(module.rows.items(), key=lambda item: item[1])
        rank = adapters[parts[0][0]][0].shape[0]
        a = torch.cat([adapters[linear][0] for linear, _ in parts])
        b = torch.zeros(module.out_features, rank * len(parts))
        for index, (linear, row) in enumerate(parts):
            b_part = adapters[linear][1]
            b[row:row + b_part.shape[0], index * rank:(index + 1) * rank] = b_part
        tensors[f"{PEFT_PREFIX}{module.module}.lora_A.weight"] = a.contiguous()
        tensors[f"{PEFT_PREFIX}{module.module}.lora_B.weight"] = b
    return tensors


def target_names(modules: list[str], others: list[str]) -> dict[str, str]:
    """Module -> the shortest dotted suffix of its name that no other module's name ends with."""
    names = {}
    for module in modules:
        parts = module.split(".")
        for size in range(1, len(parts) + 1):
            suffix = ".".join(parts[-size:])
            if not any(other == suffix or other.endswith(f".{suffix}") for other in others):
                names[module] = suffix
                break
    return names


def adapter_config(cfg: Config, modules: dict[str, HFLinear], hf_modules: list[str]) -> dict:
    """adapter_config.json: PEFT's LoraConfig of these adapters (`hf_modules`: every module of the HF model)."""
    transposed = {module.transposed for module in modules.values()}
    if len(transposed) > 1:
        refuse(cfg.model, "its adapted HF modules mix Linear and Conv1D layouts, and PEFT's fan_in_fan_out is one flag")
    adapted = [module.module for module in modules.values()]
    names = target_names(adapted, [name for name in hf_modules if name not in adapted])
    train = cfg.train
    fused = {names[module.module]: len(module.rows) for module in modules.values() if len(module.rows) > 1}
    return {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": train.init_from or None,
        "r": train.lora_rank, "lora_alpha": train.lora_alpha, "lora_dropout": train.lora_dropout,
        "target_modules": sorted(set(names.values())), "fan_in_fan_out": transposed.pop(), "bias": "none",
        "rank_pattern": {name: count * train.lora_rank for name, count in fused.items()},
        "alpha_pattern": {name: count * train.lora_alpha for name, count in fused.items()},
        "use_rslora": False, "use_dora": False, "modules_to_save": None, "inference_mode": True,
        "init_lora_weights": True,
    }
