"""`train.init_from`: a laid-out model's weights from a Hugging Face directory or a shardwise run,
each rank reading only what it holds.

`load_pretrained(pm, cfg)` runs after `parallelize` (train/setup.py `build`) on every rank. Its
targets are the rank's own `state_dict()`: DTensors (ZeRO-3, tensor, expert parallel: the rank's
shard), plain tensors (replicated), and under a pipeline only the rank's stages. LoRA adapters
(`<linear>.lora_A.weight`, `.lora_B.weight`) are not the base's and keep their initial values.

  run directory   `torch.distributed.checkpoint` loads the checkpoint's `model/` tensors into the
                  targets: its planner reads only the chunks that overlap each rank's shards
                  (checkpoint/store.py `load_checkpoint`, as resuming does). RUN@STEP's checkpoint
                  must check out against its manifest; RUN takes the newest that does.
  HF directory    safetensors, read tensor by tensor through `safe_open`. The family's own mapping
                  (`models/<family>/hf_adapter.state_dict_from_hf`, which `convert --from-hf` uses) is
                  first run on meta tensors of the checkpoint's shapes under a dispatch mode that
                  records which HF tensors each of our tensors is computed from (`trace_mapping`).
                  A tensor the mapping returns unchanged is a rename: each rank reads just its
                  shard's rows and columns (`get_slice`, at the offset DTensor's placements give).
                  A computed one (GPT-2's fused, transposed c_attn; stacked MoE experts) is
                  computed for real from only the HF tensors it depends on, one group at a time,
                  and each rank keeps its shard: never the whole model at once.

Why not DCP's Hugging Face storage reader for HF directories: it reads tensors under their HF names
and shapes, so every family whose mapping transforms (GPT-2, MoE) would still need the full tensors;
the trace keeps one mapping per family, the one `convert` is tested with.

`pretrained_state_dict(source, model_cfg)` is the single-process form (convert, serve, merging
LoRA adapters into their base): the whole model's tensors, by the same code.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import safe_open
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from shardwise.config.init_source import InitSource, parse_init_from
from shardwise.core.errors import invalid
from shardwise.core.model import ModelConfig
from shardwise.models.build import build_on_meta, torch_family
from shardwise.models.common.lora import is_adapter_name
from shardwise.models.common.hf_files import few, weight_files
from shardwise.checkpoint.integrity import status_everywhere
from shardwise.checkpoint.store import MODEL_PREFIX, load_checkpoint, newest_valid_checkpoint

SAFETENSORS_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
                      "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
                      "U8": torch.uint8, "BOOL": torch.bool}


def load_pretrained(pm, cfg) -> int:
    """Copy train.init_from's weights into this rank's share of the laid-out model `pm`
    (collective: every rank calls it). Returns the bytes of weights this rank read."""
    return copy_source(parse_init_from(cfg.train.init_from), cfg.model, base_tensors(pm.model))


def pretrained_state_dict(source: str | InitSource, model_cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """The source's whole model as shardwise tensors (fp32, CPU), in one process; `model_cfg` is the model
    the config loader made of it (`load_config(...).model`)."""
    source = parse_init_from(source) if isinstance(source, str) else source
    model = build_on_meta(model_cfg)
    model.to_empty(device="cpu")  # every tensor is overwritten below
    tensors = model.state_dict()
    copy_source(source, model_cfg, tensors)
    return tensors


def base_tensors(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The tensors of `model` (this rank's stages and shards) a base model's weights fill: all but adapters."""
    return {name: tensor for name, tensor in model.state_dict().items() if not is_adapter_name(name)}


def copy_source(source: InitSource, model_cfg: ModelConfig, targets: dict[str, torch.Tensor]) -> int:
    if source.kind == "run":
        return load_from_run(source, targets)
    return load_from_hf(source, model_cfg, targets)


# -- a shardwise run ------------------------------------------------------------------------------


def load_from_run(source: InitSource, targets: dict[str, torch.Tensor]) -> int:
    checkpoint = run_checkpoint(source)
    load_checkpoint(checkpoint, tensors={f"{MODEL_PREFIX}{name}": tensor for name, tensor in targets.items()})
    return sum(local_of(tensor).nbytes for tensor in targets.values())


def run_checkpoint(source: InitSource) -> Path:
    """RUN@STEP's checkpoint, checked against its manifest, or RUN's newest that checks out (collective
    when a process group exists)."""
    wanted = source.step_checkpoint()
    if wanted is not None:
        status, why = status_everywhere(wanted)
        if status != "ok":
            raise invalid("train.init_from", source.text, f"its checkpoint {wanted} is {status} ({why}): "
                                                          "name another step, or the run for its newest good one")
        return wanted
    found = newest_valid_checkpoint(source.directory, when_none="train.init_from has no checkpoint to start from")
    if found is None:
        raise invalid("train.init_from", source.text, "none of the run's checkpoints checks out against its "
                                                      "manifest: name a run with a whole checkpoint")
    return found


# -- a Hugging Face directory ---------------------------------------------------------------------


@dataclass
class HFReadPlan:
    """How each of our tensors comes from a HF checkpoint's tensors, learnt from shapes alone."""

    mapping: Callable
    """The family's `state_dict_from_hf(hf_tensors, cfg)`."""
    cfg: ModelConfig
    file_of: dict[str, Path]
    """HF name -> the safetensors file holding it."""
    meta: dict[str, torch.Tensor]
    """HF name -> a meta tensor of its shape and dtype."""
    renamed: dict[str, str] = field(default_factory=dict)
    """Our name -> the HF tensor it is, unchanged."""
    computed: dict[str, frozenset[str]] = field(default_factory=dict)
    """Our name -> the HF tensors it is computed from."""


def load_from_hf(source: InitSource, model_cfg: ModelConfig, targets: dict[str, torch.Tensor]) -> int:
    plan = plan_hf_read(source.directory, model_cfg)
    missing = sorted(set(targets) - set(plan.renamed) - set(plan.computed))
    if missing:
        raise invalid("train.init_from", source.text, f"it lacks weights the model has: {few(missing)}")
    with SafetensorsFiles(plan.file_of) as files:
        for name, target in targets.items():
            if name in plan.renamed:
                hf_name = plan.renamed[name]
                copy_share(target, lambda region, hf_name=hf_name: files.read(hf_name, region))
        for outputs, inputs in groups_of(plan.computed):
            if outputs & targets.keys():
                for name, full in compute_group(plan, files, inputs, outputs).items():
                    if name in targets:
                        copy_share(targets[name], lambda region, full=full: full if region is None else full[region])
        return files.bytes_read


def plan_hf_read(directory: Path, model_cfg: ModelConfig) -> HFReadPlan:
    file_of, meta = {}, {}
    for file in weight_files(directory):
        with safe_open(file, framework="pt") as handle:
            for name in handle.keys():
                piece = handle.get_slice(name)
                file_of[name] = file
                meta[name] = torch.empty(piece.get_shape(), dtype=SAFETENSORS_DTYPES[piece.get_dtype()], device="meta")
    mapping = torch_family(model_cfg.family).hf_adapter.state_dict_from_hf
    plan = HFReadPlan(mapping, model_cfg, file_of, meta)
    hf_name_of = {id(tensor): name for name, tensor in meta.items()}
    for ours, (tensor, inputs) in trace_mapping(mapping, meta, model_cfg).items():
        if id(tensor) in hf_name_of:
            plan.renamed[ours] = hf_name_of[id(tensor)]
        else:
            plan.computed[ours] = inputs
    return plan


class InputTracker(TorchDispatchMode):
    """Records, for every tensor an op makes, the named input tensors it was computed from."""

    def __init__(self, inputs: dict[str, torch.Tensor]):
        super().__init__()
        # id -> (tensor, its inputs); the tensor is kept so that its id is never reused meanwhile.
        self.sources = {id(tensor): (tensor, frozenset([name])) for name, tensor in inputs.items()}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        result = func(*args, **(kwargs or {}))
        found = frozenset().union(*(self.sources[id(arg)][1] for arg in tree_flatten((args, kwargs))[0]
                                    if isinstance(arg, torch.Tensor) and id(arg) in self.sources))
        for tensor in tree_flatten(result)[0]:
            if isinstance(tensor, torch.Tensor):
                self.sources[id(tensor)] = (tensor, found)
        return result

    def inputs_of(self, tensor: torch.Tensor) -> frozenset[str]:
        return self.sources.get(id(tensor), (None, frozenset()))[1]


def trace_mapping(mapping: Callable, meta: dict[str, torch.Tensor], cfg: ModelConfig):
    """Our name -> (the tensor the mapping returns for it, the HF names it depends on), from meta tensors:
    nothing is read, and the mapping's own checks (names, shapes) run."""
    with InputTracker(meta) as tracker:
        ours = mapping(dict(meta), cfg)
    return {name: (tensor, tracker.inputs_of(tensor)) for name, tensor in ours.items()}


def groups_of(computed: dict[str, frozenset[str]]) -> list[tuple[set[str], set[str]]]:
    """(our names, HF names) of the computed tensors, grouped so that no two groups share an HF tensor: a
    group computes alone (no op of the mapping mixes its inputs with another group's)."""
    groups: list[tuple[set[str], set[str]]] = []
    for name, inputs in computed.items():
        names, needs, apart = {name}, set(inputs), []
        for other_names, other_needs in groups:
            if other_needs & needs:
                names, needs = names | other_names, needs | other_needs
            else:
                apart.append((other_names, other_needs))
        groups = apart + [(names, needs)]
    return groups


def compute_group(plan: HFReadPlan, files: SafetensorsFiles, inputs: set[str], outputs: set[str]):
    """The mapping run with this group's HF tensors read whole and the rest left on meta: our tensors of
    the group, computed."""
    tensors = dict(plan.meta) | {name: files.read(name) for name in inputs}
    mapped = plan.mapping(tensors, plan.cfg)
    return {name: mapped[name] for name in outputs}


class SafetensorsFiles:
    """The checkpoint's files, each opened once (memory-mapped by safetensors), and the bytes read."""

    def __init__(self, file_of: dict[str, Path]):
        self.file_of, self.handles, self.bytes_read = file_of, {}, 0
        self.stack = ExitStack()

    def __enter__(self) -> SafetensorsFiles:
        return self

    def __exit__(self, *exc) -> None:
        self.stack.close()

    def read(self, name: str, region: tuple[slice, ...] | None = None) -> torch.Tensor:
        """HF tensor `name`, or its `region` (one slice per dimension) alone."""
        file = self.file_of[name]
        if file not in self.handles:
            self.handles[file] = self.stack.enter_context(safe_open(file, framework="pt"))
        handle = self.handles[file]
        tensor = handle.get_tensor(name) if region is None else handle.get_slice(name)[region]
        self.bytes_read += tensor.nbytes
        return tensor


# -- this rank's share ---------------------------------------------------------------------------


def local_of(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def share_region(target: torch.Tensor) -> tuple[slice, ...] | None:
    """The rows and columns of the whole tensor that `target` holds on this rank (None: all of it, a plain tensor)."""
    if not isinstance(target, DTensor):
        return None
    shape, offset = compute_local_shape_and_global_offset(target.shape, target.device_mesh, target.placements)
    return tuple(slice(start, start + size) for start, size in zip(offset, shape))


@torch.no_grad()
def copy_share(target: torch.Tensor, read: Callable[[tuple[slice, ...] | None], torch.Tensor]) -> None:
    """Fill this rank's share of `target` with `read(region)`, the source's values there (None: all)."""
    local = local_of(target)
    if local.numel() == 0:  # a rank past the last row of an unevenly sharded tensor
        return
    values = read(share_region(target))
    if values.shape != local.shape:
        raise AssertionError(f"read {tuple(values.shape)} for a shard of {tuple(local.shape)}")
    local.copy_(values)
