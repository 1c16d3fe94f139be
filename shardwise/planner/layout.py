"""A layout as the planner sees it: degrees, batch, schedule, recomputation and dtypes.

The fields mirror the runtime's knobs (`parallel.*`, `train.*`): world size = dp*tp*pp*cp
(`dp` counts every data-parallel rank; with HSDP, `dp_replicate` groups of dp/dp_replicate
shards), expert parallelism borrows its ranks from dp*cp (as torchtitan does), one optimizer
step = `grad_accum` micro-batches of `micro_batch` sequences of `seq_len` tokens per
data-parallel rank (a pipeline runs those grad_accum micro-batches through its schedule).

dtype "bf16" is mixed precision: bf16 parameters and gradients, fp32 master weights and Adam
moments (ZeRO paper section 3.1, 2+2+12 bytes per parameter); `grad_accum_dtype = "fp32"`
adds an fp32 gradient-accumulation buffer (4 bytes per parameter, the Ultra-Scale Playbook's
setting). dtype "fp32" is the shardwise runtime's default: fp32 weights, gradients and
moments (4+4+8), with `compute_dtype = "bf16"` for `train.autocast_dtype = bfloat16`.

`validate()` and `check_against(model)` raise a one-line ValueError naming the field, the
value and the fix: the first violation of the rules in `core/layout_rules.py`, the ones the
config and the runtime apply, less the runtime's limits (layouts the planner can estimate but the
runtime does not run yet; `search.runtime_refuses` names those). The planner assumes
load-balanced ring attention (2cp chunks per sequence), the runtime's default.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from collections.abc import Iterable
from itertools import chain

from shardwise.core.layout_rules import (
    CP_MODES,
    PP_SCHEDULES,
    RECOMPUTE_BY_COST,
    ZERO_STAGES,
    LayoutNames,
    Violation,
    cp_head_violations,
    expert_rank_violations,
    expert_split_violations,
    parallel_violations,
    sequence_violations,
    stage_count_violations,
    tp_shape_violations,
)
from shardwise.models.families import spec_of

RECOMPUTE_MODES = RECOMPUTE_BY_COST  # the planner lists them least recomputation first
DTYPE_ALIASES = {"bf16": "bf16", "bfloat16": "bf16", "fp32": "fp32", "float32": "fp32"}
COMM_OVERLAPS = ("tp", "p2p", "dp")
INT_FIELDS = ("dp", "tp", "pp", "cp", "ep", "dp_replicate", "micro_batch", "grad_accum", "seq_len", "virtual_stages")


def invalid(name: str, value, fix: str) -> ValueError:
    return ValueError(f"layout.{name} = {value!r} is invalid: {fix}")


def raise_first(violations: Iterable[Violation]) -> None:
    """Raise the first violation of core/layout_rules.py, worded with the layout's own field names;
    the runtime's limits are not the planner's (it estimates those layouts; `runtime_refuses` names them)."""
    for violation in violations:
        if violation.runtime_limit:
            continue
        raise invalid(violation.field, violation.value, violation.fix_for(LayoutNames()))


def role_problem(model, roles: tuple[str, ...]) -> str | None:
    """How to fix LoRA roles that are not the family's (None: they all are)."""
    known = spec_of(model.family).lora_roles
    if all(role in known for role in roles):
        return None
    if not known:
        return f"model.family {model.family} takes no adapters"
    return f"use roles of model.family {model.family}: {','.join(known)}"


@dataclass(frozen=True, kw_only=True)
class Layout:
    dp: int = 1
    tp: int = 1
    pp: int = 1
    cp: int = 1
    ep: int = 1
    zero: int = 0
    dp_replicate: int = 1
    micro_batch: int = 1
    grad_accum: int = 1
    seq_len: int = 4096
    recompute: str = "none"
    pp_schedule: str = "1f1b"
    virtual_stages: int = 1
    sp: bool = False
    cp_mode: str = "ring"
    dtype: str = "bf16"
    grad_accum_dtype: str = ""
    """"" = the parameter dtype (no separate accumulation buffer); "fp32" with dtype bf16 adds one."""
    compute_dtype: str = ""
    """"" = dtype; "bf16" with dtype fp32 is autocast (fp32 states, bf16 matmuls)."""
    compile: bool = False
    """Blocks compiled with the rewrite rules (`train.compile` and `train.rewrite_rules`): dense
    blocks keep fewer activations (planner/memory.py, `compiled_block_elements`)."""
    chunked_loss: bool = False
    """The output projection and the cross-entropy taken a chunk of tokens at a time
    (`train.chunked_loss`, on by default in the trainer): the loss holds no [tokens, vocab]
    logits. The runtime chunks only without pp (under tp, each rank its vocabulary columns), and
    only for the families whose model takes the targets (planner/memory.py, `loss_is_chunked`);
    elsewhere the flag changes nothing. Off
    here so that a bare layout is what the frameworks the planner is validated against run."""
    lora_rank: int = 0
    """LoRA (`train.lora_rank`): rank-r adapters beside the frozen linears of `lora_targets`; only the
    adapters have gradients and optimizer states (planner/adapters.py). 0 = every weight trains."""
    lora_targets: str = "q,k,v,o,gate,up,down"
    """The roles that get adapters (`train.lora_targets`, the family's `lora_roles`)."""
    lora_base_dtype: str = ""
    """The dtype the adapted linears' frozen weights are held in (`train.lora_base_dtype`); "" = dtype."""
    lora_dropout: float = 0.0
    """`train.lora_dropout`: above 0 each adapter keeps its own dropped-out input and mask for backward."""
    packed: bool = False
    """Packed sequences with document masks (`data.packing`, `data.document_mask`): every token is an
    example's, none is padding; attention is masked per document (planner/memory.py, step_time.py)."""
    comm_overlap: str = ""
    """Communication a runtime overlaps beyond what shardwise's does, for estimating runs of other
    frameworks (benchmarks/weak_scaling.py): a comma-separated subset of COMM_OVERLAPS. "tp": the
    tensor-parallel collectives run asynchronously, pipelined with the matmuls they feed or follow
    (Megatron-Core's --tp-comm-overlap, torch's async TP); "p2p": the pipeline's transfers are issued
    ahead of need and waited for on the device, not the host (Megatron-Core's --overlap-p2p-communication,
    Llama 3's asynchronous point-to-point), so the tp ranks stay in step and the transfers hide behind
    compute; "dp": ZeRO-0-2's bucketed gradient reduction and parameter all-gather run asynchronously,
    the gather behind the next step's first forward (--overlap-grad-reduce, --overlap-param-gather).
    The shardwise runtime does none of them (`search.runtime_refuses`); planner/step_time.py says how
    each is counted."""

    @property
    def world_size(self) -> int:
        return self.dp * self.tp * self.pp * self.cp

    @property
    def num_stages(self) -> int:
        return self.pp * self.virtual_stages

    @property
    def state_dtype(self) -> str:
        return DTYPE_ALIASES[self.dtype]

    @property
    def matmul_dtype(self) -> str:
        return DTYPE_ALIASES[self.compute_dtype or self.dtype]

    @property
    def accum_dtype(self) -> str:
        return DTYPE_ALIASES[self.grad_accum_dtype or self.dtype]

    @property
    def chunks_loss(self) -> bool:
        """`chunked_loss` where the runtime can chunk: no pp (whose schedule takes the last stage's
        logits); under tp each rank chunks its columns of the vocabulary."""
        return self.chunked_loss and self.pp == 1

    @property
    def base_dtype(self) -> str:
        """The dtype of the adapted linears' frozen weights under LoRA."""
        return DTYPE_ALIASES[self.lora_base_dtype or self.dtype]

    @property
    def lora_roles(self) -> tuple[str, ...]:
        """The roles that get adapters (none without LoRA)."""
        if not self.lora_rank:
            return ()
        return tuple(name.strip() for name in self.lora_targets.split(",") if name.strip())

    @property
    def overlaps(self) -> tuple[str, ...]:
        """The names of `comm_overlap` (none: shardwise's own runtime)."""
        return tuple(name.strip() for name in self.comm_overlap.split(",") if name.strip())

    @property
    def tokens_per_step(self) -> int:
        return self.dp * self.micro_batch * self.grad_accum * self.seq_len

    def validate(self) -> "Layout":
        for name in INT_FIELDS:
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise invalid(name, value, "use a positive integer")
        if self.zero not in ZERO_STAGES or isinstance(self.zero, bool):
            raise invalid("zero", self.zero, "use 0, 1, 2 or 3")
        for name in ("sp", "compile", "chunked_loss", "packed"):
            if not isinstance(getattr(self, name), bool):
                raise invalid(name, getattr(self, name), "use true or false")
        if self.recompute not in RECOMPUTE_MODES:
            raise invalid("recompute", self.recompute, f"use one of {', '.join(RECOMPUTE_MODES)}")
        if self.pp_schedule not in PP_SCHEDULES:
            raise invalid("pp_schedule", self.pp_schedule, f"use one of {', '.join(PP_SCHEDULES)}")
        if self.cp_mode not in CP_MODES:
            raise invalid("cp_mode", self.cp_mode, f"use one of {', '.join(CP_MODES)}")
        for name in ("dtype", "grad_accum_dtype", "compute_dtype", "lora_base_dtype"):
            value = getattr(self, name)
            if (value or name == "dtype") and value not in DTYPE_ALIASES:
                raise invalid(name, value, "use bf16 or fp32")
        self.validate_lora()
        if not isinstance(self.comm_overlap, str) or not set(self.overlaps) <= set(COMM_OVERLAPS):
            fix = f"use a comma-separated subset of {', '.join(COMM_OVERLAPS)}, or \"\" (shardwise's runtime)"
            raise invalid("comm_overlap", self.comm_overlap, fix)
        violations = chain(
            self.degree_violations(),
            expert_rank_violations(self.ep, self.dp * self.cp),
            sequence_violations(seq_len=self.seq_len, tp=self.tp, sp=self.sp, cp=self.cp, cp_mode=self.cp_mode))
        raise_first(violations)
        return self

    def validate_lora(self) -> None:
        if not isinstance(self.lora_rank, int) or isinstance(self.lora_rank, bool) or self.lora_rank < 0:
            raise invalid("lora_rank", self.lora_rank, "use 0 (no LoRA: every weight trains) or a rank, e.g. 8")
        if not isinstance(self.lora_dropout, (int, float)) or not 0.0 <= self.lora_dropout < 1.0:
            raise invalid("lora_dropout", self.lora_dropout, "use a probability in [0, 1)")
        if self.lora_rank and not self.lora_roles:
            raise invalid("lora_targets", self.lora_targets, "name the roles that get adapters, e.g. q,k,v,o")

    def degree_violations(self):
        """`layout_rules.parallel_violations` of this layout's degrees."""
        return parallel_violations(tp=self.tp, pp=self.pp, zero=self.zero, dp_replicate=self.dp_replicate, sp=self.sp,
                                   pp_schedule=self.pp_schedule, virtual_stages=self.virtual_stages, dp=self.dp)

    def check_against(self, model) -> "Layout":
        """What the model's shape needs of the layout (tp divides heads and widths, enough layers, experts)."""
        raise_first(chain(
            tp_shape_violations(self.tp, model, spec_of(model.family)),
            stage_count_violations(pp=self.pp, num_stages=self.num_stages, n_layers=model.n_layers),
            expert_split_violations(self.ep, model.n_experts),
            cp_head_violations(cp=self.cp, tp=self.tp, cp_mode=self.cp_mode, model=model)))
        problem = role_problem(model, self.lora_roles)
        if problem:
            raise invalid("lora_targets", self.lora_targets, problem)
        return self

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def describe(self) -> str:
        parts = [f"dp{self.dp}"] + [f"{k}{getattr(self, k)}" for k in ("tp", "pp", "cp", "ep") if getattr(self, k) > 1]
        if self.dp_replicate > 1:
            parts[0] = f"hsdp{self.dp_replicate}x{self.dp // self.dp_replicate}"
        parts.append(f"z{self.zero}")
        if self.sp:
            parts.append("sp")
        if self.pp > 1:
            parts.append(self.pp_schedule + (f"/v{self.virtual_stages}" if self.virtual_stages > 1 else ""))
        if self.cp > 1:
            parts.append(self.cp_mode)
        parts.append(f"mbs{self.micro_batch}x{self.grad_accum}")
        if self.recompute != "none":
            parts.append(f"rc-{self.recompute}")
        if self.compile:
            parts.append("compiled")
        if self.chunks_loss:
            parts.append("chunked-loss")
        if self.packed:
            parts.append("packed")
        if self.overlaps:
            parts.append("overlap-" + "+".join(self.overlaps))
        if self.lora_rank:
            parts.append(f"lora-r{self.lora_rank}" + (f"-base-{self.base_dtype}" if self.base_dtype != self.state_dtype
                                                      else ""))
        return " ".join(parts)


LAYOUT_FIELDS = {f.name for f in dataclasses.fields(Layout)}
ALIASES = {"mbs": "micro_batch", "micro_batch_size": "micro_batch", "gradient_accumulation": "grad_accum",
           "grad_acc": "grad_accum", "pp_virtual_stages": "virtual_stages", "seq": "seq_len"}


def layout_from_dict(values: dict) -> Layout:
    """A validated Layout from a JSON object; missing fields take the defaults."""
    if not isinstance(values, dict):
        raise ValueError(f"layout = {values!r} is invalid: give a JSON object of fields (dp, tp, pp, ...)")
    fields = {}
    for key, value in values.items():
        name = ALIASES.get(key, key)
        if name not in LAYOUT_FIELDS:
            raise ValueError(f"layout.{key} is invalid: not a layout field; use one of {', '.join(sorted(LAYOUT_FIELDS))}")
        if name in INT_FIELDS or name in ("zero", "lora_rank"):
            if isinstance(value, float) and value.is_integer():
                value = int(value)
        fields[name] = value
    for name in ("dtype", "lora_base_dtype"):  # the config's names (float32, bfloat16) are accepted too
        if fields.get(name) in DTYPE_ALIASES:
            fields[name] = DTYPE_ALIASES[fields[name]]
    return Layout(**fields).validate()
