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
value and the fix.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from shardwise.config.layout_rules import CP_MODES, INTERLEAVED_SCHEDULES, PP_SCHEDULES, RECOMPUTE_BY_COST

RECOMPUTE_MODES = RECOMPUTE_BY_COST  # the planner lists them least recomputation first
DTYPE_ALIASES = {"bf16": "bf16", "bfloat16": "bf16", "fp32": "fp32", "float32": "fp32"}
INT_FIELDS = ("dp", "tp", "pp", "cp", "ep", "dp_replicate", "micro_batch", "grad_accum", "seq_len", "virtual_stages")


def invalid(name: str, value, fix: str) -> ValueError:
    return ValueError(f"layout.{name} = {value!r} is invalid: {fix}")


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
    def tokens_per_step(self) -> int:
        return self.dp * self.micro_batch * self.grad_accum * self.seq_len

    def validate(self) -> "Layout":
        for name in INT_FIELDS:
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise invalid(name, value, "use a positive integer")
        if self.zero not in (0, 1, 2, 3) or isinstance(self.zero, bool):
            raise invalid("zero", self.zero, "use 0, 1, 2 or 3")
        if not isinstance(self.sp, bool):
            raise invalid("sp", self.sp, "use true or false")
        if self.recompute not in RECOMPUTE_MODES:
            raise invalid("recompute", self.recompute, f"use one of {', '.join(RECOMPUTE_MODES)}")
        if self.pp_schedule not in PP_SCHEDULES:
            raise invalid("pp_schedule", self.pp_schedule, f"use one of {', '.join(PP_SCHEDULES)}")
        if self.cp_mode not in CP_MODES:
            raise invalid("cp_mode", self.cp_mode, f"use one of {', '.join(CP_MODES)}")
        for name in ("dtype", "grad_accum_dtype", "compute_dtype"):
            value = getattr(self, name)
            if (value or name == "dtype") and value not in DTYPE_ALIASES:
                raise invalid(name, value, "use bf16 or fp32")
        if self.sp and self.tp == 1:
            raise invalid("sp", self.sp, "sequence parallelism needs tp > 1")
        if self.dp % self.dp_replicate:
            raise invalid("dp_replicate", self.dp_replicate, f"use a divisor of dp ({self.dp})")
        if self.dp_replicate > 1 and self.zero != 3:
            raise invalid("dp_replicate", self.dp_replicate, "HSDP shards within each group: set zero = 3")
        if self.virtual_stages > 1 and self.pp_schedule not in INTERLEAVED_SCHEDULES:
            raise invalid("virtual_stages", self.virtual_stages,
                          f"{self.pp_schedule} runs one stage per rank; use 1 or an interleaved schedule")
        if self.pp_schedule == "zbv" and self.pp > 1 and self.virtual_stages != 2:
            raise invalid("virtual_stages", self.virtual_stages, "zbv places exactly 2 stages per rank; set it to 2")
        if self.pp > 1 and self.zero == 2:
            raise invalid("zero", self.zero, "ZeRO-2 frees gradients the pipeline still accumulates; use 0, 1 or 3")
        if (self.dp * self.cp) % self.ep:
            raise invalid("ep", self.ep, f"expert parallelism uses data/context ranks: use a divisor of "
                          f"dp*cp = {self.dp * self.cp}")
        if self.seq_len % (2 * self.cp if self.cp > 1 else 1):
            raise invalid("seq_len", self.seq_len, f"context parallelism cuts each sequence into 2*cp = "
                          f"{2 * self.cp} chunks (load balancing): use a multiple of {2 * self.cp}")
        if self.sp and self.seq_len % self.tp:
            raise invalid("seq_len", self.seq_len, f"sequence parallelism splits it over tp: use a multiple of {self.tp}")
        return self

    def check_against(self, model) -> "Layout":
        """What the model's shape needs of the layout (tp divides heads and widths, enough layers, experts)."""
        for value, what in ((model.n_heads, "n_heads"), (model.n_kv_heads, "n_kv_heads"), (model.ffn_dim, "ffn_dim")):
            if value % self.tp:
                raise invalid("tp", self.tp, f"use a divisor of model.{what} ({value})")
        if self.num_stages > model.n_layers:
            raise invalid("pp", self.pp, f"pp x virtual_stages = {self.num_stages} exceeds model.n_layers "
                          f"({model.n_layers}); use fewer stages")
        if self.ep > 1 and not model.n_experts:
            raise invalid("ep", self.ep, "the model is dense (no experts); use 1")
        if self.ep > 1 and model.n_experts % self.ep:
            raise invalid("ep", self.ep, f"use a divisor of model.n_experts ({model.n_experts})")
        if self.cp_mode == "alltoall" and self.cp > 1 and (model.n_heads // self.tp) % self.cp:
            raise invalid("cp", self.cp, f"all-to-all context parallelism splits the {model.n_heads // self.tp} heads "
                          f"per tensor-parallel rank: use a divisor, or cp_mode = ring")
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
        if name in INT_FIELDS or name == "zero":
            if isinstance(value, float) and value.is_integer():
                value = int(value)
        fields[name] = value
    if "dtype" in fields and fields["dtype"] in DTYPE_ALIASES:
        fields["dtype"] = DTYPE_ALIASES[fields["dtype"]]
    return Layout(**fields).validate()
