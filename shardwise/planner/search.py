"""Plan search: every layout of N devices for a model and a global batch, estimated and ranked.

Enumerated: tp over divisors of N that divide the heads, KV heads and FFN width (sequence
parallel on whenever tp > 1 and the runtime allows it), pp over divisors up to the number of
blocks (1F1B, and interleaved 1F1B with 2 stages per rank where the blocks allow), cp over
powers of two that divide the sequence, ep over divisors of the experts (MoE models), dp = the
rest, every ZeRO stage, micro-batches over the divisors of each replica's share of the batch
(up to MAX_MICRO_BATCH sequences), recomputation only when a layout does not fit without it
(none, then selective, then full), where fitting keeps PLANNING_HEADROOM of the memory free.
Layouts the shardwise runtime refuses are skipped
(`runtime_refuses`: the runtime limits of core/layout_rules.py, which the config and the
runtime's checks apply; a test keeps the planner and `ParallelConfig.validate` equal). The
rest are estimated, the ones that do not fit dropped, and the others ranked by predicted
tokens/s per device.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import chain

from shardwise.core.layout_rules import (
    RECOMPUTE_BY_COST,
    LayoutNames,
    compile_violations,
    cp_family_violations,
    pipeline_family_violations,
    sp_family_violations,
    cp_head_violations,
    expert_split_violations,
    expert_violations,
    pipeline_violations,
    sequence_violations,
    stage_count_violations,
    tp_shape_violations,
)
from shardwise.core.model import ModelConfig
from shardwise.core.units import GIB
from shardwise.planner.estimate import Estimate, estimate
from shardwise.planner.hardware import Hardware
from shardwise.planner.layout import Layout, role_problem
from shardwise.models.families import spec_of

MAX_MICRO_BATCH = 32
PLANNING_HEADROOM = 0.10
"""The planner keeps this fraction of device memory free: within ~10% of capacity the caching
allocator frees its cache and retries allocations, and steps slow down (in the playbook sweep,
runs that reserved over 90% of the GPU ran at a median 0.2 of the predicted throughput, against
~1.0 for those between 40% and 90%)."""
RECOMPUTE_ORDER = RECOMPUTE_BY_COST


def runtime_refuses(layout: Layout, model: ModelConfig) -> str | None:
    """Why the shardwise runtime would refuse this layout of `model` today (None: it runs it): the
    first runtime limit (core/layout_rules.py) it hits. `Layout.validate` and `check_against`
    have already refused what is not a layout at all."""
    violations = chain(
        layout.degree_violations(),
        expert_violations(ep=layout.ep, n_experts=model.n_experts, sp=layout.sp, dp_replicate=layout.dp_replicate,
                          data_ranks=layout.dp * layout.cp),
        cp_head_violations(cp=layout.cp, tp=layout.tp, cp_mode=layout.cp_mode, model=model),
        cp_family_violations(cp=layout.cp, spec=spec_of(model.family)),
        pipeline_family_violations(pp=layout.pp, spec=spec_of(model.family)),
        sp_family_violations(sp=layout.sp, spec=spec_of(model.family)),
        pipeline_violations(pp=layout.pp, pp_schedule=layout.pp_schedule, num_micro_batches=layout.grad_accum,
                            tie_embeddings=model.tie_embeddings),
        compile_violations(compile=layout.compile, tp=layout.tp, sp=layout.sp, recompute=layout.recompute))
    for violation in violations:
        if violation.runtime_limit:
            return violation.fix_for(LayoutNames())
    if layout.overlaps:  # estimating other runtimes' runs; candidate_layouts never sets it
        return (f"comm_overlap = {layout.comm_overlap!r} is another runtime's overlap (Megatron-Core's, Llama 3's): "
                "the shardwise runtime does none of it; leave comm_overlap empty")
    if layout.packed and layout.cp > 1:  # Config.validate_post_training's rule
        return "context parallelism's attention takes no document mask: use cp = 1 with packed sequences"
    return None


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


@dataclass(frozen=True)
class PlanRequest:
    model: ModelConfig
    hardware: Hardware
    devices: int
    global_batch_tokens: int
    seq_len: int
    dtype: str = "bf16"
    grad_accum_dtype: str = ""
    compute_dtype: str = ""
    compile: bool = False
    chunked_loss: bool = False
    """Layouts take the loss chunked where the runtime does (`Layout.chunked_loss`)."""
    runtime_only: bool = True
    zero_stages: tuple = (0, 1, 2, 3)
    micro_batches: tuple = ()
    """Restrict the micro-batch sizes tried (empty: all divisors up to MAX_MICRO_BATCH)."""
    lora_rank: int = 0
    """LoRA (`Layout.lora_rank` and the fields below, as train.lora_* set them); 0 = no adapters."""
    lora_targets: str = "q,k,v,o,gate,up,down"
    lora_base_dtype: str = ""
    lora_dropout: float = 0.0
    packed: bool = False
    """Packed sequences with document masks (`Layout.packed`)."""
    model_name: str = "custom"
    """What `shardwise plan` calls the model (`model_resolution.resolve_model_and_name`): a config holds no name."""

    def validate(self) -> "PlanRequest":
        for name in ("devices", "global_batch_tokens", "seq_len"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"--{name.replace('_', '-')} = {value!r} is invalid: use a positive integer")
        if self.global_batch_tokens % self.seq_len:
            raise ValueError(f"--global-batch-tokens = {self.global_batch_tokens} is invalid: use a multiple of "
                             f"--seq-len ({self.seq_len}), the batch is whole sequences")
        # a bad LoRA field would otherwise leave no layout to consider, without a word
        if not 0.0 <= self.lora_dropout < 1.0:
            raise ValueError(f"--lora-dropout = {self.lora_dropout!r} is invalid: use a probability in [0, 1)")
        problem = role_problem(self.model, Layout(**self.adaptation()).lora_roles)
        if problem:
            raise ValueError(f"--lora-targets = {self.lora_targets!r} is invalid: {problem}")
        return self

    def adaptation(self) -> dict:
        """The LoRA and packing fields every candidate layout takes from the request."""
        return dict(lora_rank=self.lora_rank, lora_targets=self.lora_targets, lora_base_dtype=self.lora_base_dtype,
                    lora_dropout=self.lora_dropout, packed=self.packed)

    @property
    def sequences(self) -> int:
        return self.global_batch_tokens // self.seq_len


def candidate_degrees(request: PlanRequest):
    """(tp, pp, cp, ep, dp) with tp*pp*cp*dp = devices that the model's shape allows."""
    model, n = request.model, request.devices
    for tp in divisors(n):
        if any(tp_shape_violations(tp, model, spec_of(model.family))):
            continue
        for pp in divisors(n // tp):
            if any(stage_count_violations(pp=pp, num_stages=pp, n_layers=model.n_layers)):
                continue
            for cp in divisors(n // (tp * pp)):
                if cp & (cp - 1) or any(sequence_violations(seq_len=request.seq_len, tp=tp, sp=False, cp=cp,
                                                            cp_mode="ring")):
                    continue
                dp = n // (tp * pp * cp)
                if request.sequences % dp:
                    continue
                eps = [e for e in divisors(dp * cp) if not any(expert_split_violations(e, model.n_experts))]
                for ep in eps:
                    yield tp, pp, cp, ep, dp


def candidate_layouts(request: PlanRequest):
    """Every runnable layout without recomputation (recompute is tried later, when needed)."""
    model = request.model
    for tp, pp, cp, ep, dp in candidate_degrees(request):
        per_replica = request.sequences // dp
        sizes = request.micro_batches or [m for m in divisors(per_replica) if m <= MAX_MICRO_BATCH]
        schedules = [("1f1b", 1)]
        if pp > 1 and model.n_layers >= 2 * pp:
            schedules.append(("interleaved-1f1b", 2))
        for zero in request.zero_stages:
            for micro_batch in sizes:
                if per_replica % micro_batch:
                    continue
                for schedule, virtual in schedules:
                    base = dict(dp=dp, tp=tp, pp=pp, cp=cp, ep=ep, zero=zero, micro_batch=micro_batch,
                                grad_accum=per_replica // micro_batch, seq_len=request.seq_len,
                                pp_schedule=schedule, virtual_stages=virtual, dtype=request.dtype,
                                grad_accum_dtype=request.grad_accum_dtype, compute_dtype=request.compute_dtype,
                                compile=request.compile,
                                chunked_loss=request.chunked_loss and spec_of(model.family).chunked_loss,
                                **request.adaptation())
                    sp_options = [True, False] if tp > 1 else [False]
                    for sp in sp_options:
                        layout = Layout(**base, sp=sp)
                        try:
                            layout.validate().check_against(model)
                        except ValueError:
                            continue
                        if request.runtime_only and runtime_refuses(layout, model):
                            continue
                        yield layout
                        break  # sp when allowed (less memory, same communication volume)


def fits_with_headroom(result: Estimate) -> bool:
    hardware = result.hardware
    return result.memory.peak + hardware.reserved_bytes <= (1 - PLANNING_HEADROOM) * hardware.memory_bytes


def fitting_estimate(request: PlanRequest, layout: Layout) -> Estimate | None:
    """The layout's estimate with the least recomputation that fits with headroom (None if none does)."""
    for mode in RECOMPUTE_ORDER:
        candidate = layout if mode == "none" else Layout(**{**layout.to_dict(), "recompute": mode})
        result = estimate(request.model, candidate, request.hardware)
        if fits_with_headroom(result):
            return result
    return None


def plan(request: PlanRequest) -> tuple[list[Estimate], int]:
    """(fitting estimates, fastest first; how many layouts were considered)."""
    request.validate()
    results, considered = [], 0
    for layout in candidate_layouts(request):
        considered += 1
        found = fitting_estimate(request, layout)
        if found is not None:
            results.append(found)
    results.sort(key=ranking_key)
    return results, considered


def ranking_key(result: Estimate) -> tuple:
    """Fastest first; within 0.1% of each other the simpler layout (fewer split axes, lower ZeRO
    stage, no recomputation), then less memory."""
    layout = result.layout
    axes = sum(degree > 1 for degree in (layout.tp, layout.pp, layout.cp, layout.ep))
    recompute = RECOMPUTE_ORDER.index(layout.recompute)
    return -_bucket(result.tokens_per_s_per_device), axes, layout.zero, recompute, result.memory.peak


def _bucket(value: float) -> float:
    """value rounded to 0.1% (a relative grid), so that near-ties fall to the simpler layout."""
    import math

    return round(math.log(value) / math.log(1.001)) if value > 0 else float("-inf")


def why_it_wins(results: list[Estimate]) -> str:
    """One line: what the winner saves against the best layout that differs in its degrees."""
    if not results:
        return "no layout fits: use more devices, a shorter sequence or a smaller batch"
    best = results[0]
    head = (f"{best.layout.describe()} wins at {best.tokens_per_s_per_device:,.0f} tokens/s/device "
            f"(MFU {best.mfu:.0%}, peak {best.memory.peak / GIB:.1f} GiB)")
    degrees = lambda e: (e.layout.dp, e.layout.tp, e.layout.pp, e.layout.cp, e.layout.ep)  # noqa: E731
    rival = next((e for e in results[1:] if degrees(e) != degrees(best)), None)
    if rival is None:
        return head + ": the only split of the devices that fits"
    if rival.tokens_per_s_per_device >= best.tokens_per_s_per_device * 0.999:
        return head + f": ties with {rival.layout.describe()}; the one with fewer split axes is listed first"
    gaps = {key: rival.time.breakdown[key] - best.time.breakdown[key]
            for key in best.time.breakdown if key != "dp_comm_overlapped"}
    key = max(gaps, key=gaps.get)
    slower = best.tokens_per_s_per_device / rival.tokens_per_s_per_device - 1
    return (head + f": the best other split, {rival.layout.describe()}, is {slower:.1%} slower, "
            f"mostly {key.replace('_', ' ')} (+{gaps[key]:.3g} s per step)")
