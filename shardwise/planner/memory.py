"""Per-rank peak memory of a layout, with its breakdown, from first principles.

Model states (ZeRO paper, Rajbhandari et al. 2020, section 3.1 and figure 1), per parameter Ψ
this rank holds after pipeline, tensor and expert parallelism (`placement.rank_params`):

    dtype fp32 (shardwise's default):    params 4Ψ, grads 4Ψ, optimizer 8Ψ (Adam m, v)
    dtype bf16 (mixed precision):        params 2Ψ, grads 2Ψ, optimizer 12Ψ (fp32 master, m, v)
    grad_accum_dtype fp32 with bf16:     + a 4Ψ fp32 gradient-accumulation buffer (Ultra-Scale Playbook)

ZeRO-1 divides the optimizer by the data-parallel shard count N_d, ZeRO-2 also the gradients
(and the accumulation buffer), ZeRO-3 also the parameters. N_d = dp/dp_replicate x cp for dense
parameters (context-parallel ranks hold the same weights and reduce their gradients too);
routed experts are replicated over dp*cp/ep ranks and sharded over those.

Communication buffers: ZeRO-3 gathers one block ahead (FSDP prefetch): 2 blocks of
parameters + 1 block of gradients for its reduce-scatter; mixed-precision ZeRO-1/2 gathers the
updated bf16 parameters into a full-size staging buffer from a 2Ψ/N_d shard (2Ψ + 2Ψ/N_d, the
flat-buffer all-gather of nanotron and Megatron's distributed optimizer); DDP (ZeRO-0) with
fp32 states reduces in place in its gradient buckets (2 x bucket size in flight).

Activations (Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer
Models", section 4, adapted to a Llama block with fused attention, SwiGLU and no dropout), in
elements saved per token per block, t = tp, s over tp only with sequence parallelism (the GPT-2,
BERT and ViT blocks keep 2h per LayerNorm and 2f for the GELU MLP instead: 8h + 2f, Korthikanti's
count without dropout, 16h at f = 4h; tests/planner/test_family_memory.py measures it):

    norms (input, normalised, scaled) x 2     6h   (/t with sp)
    q, k, v and attention output             (2a*d + 2k*d) / t
    SwiGLU: gate, up, silu(gate), product     4f / t
    MoE block: routed tokens k*(2h + 4f_e) + shared 4f_s + router logits E (fp32); not /t,
               the runtime replicates MoE layers over tensor-parallel ranks

Blocks compiled with the rewrite rules (`Layout.compile`, dense blocks, no recomputation) keep
what `observe/block_memory.py` measures on the Llama 3 8B block (13.6h per token in bf16 and in
fp32, against 24.6h eager): the two norms' inputs and their normalised outputs 4h (/t with sp),
q, k, v and the attention output (2a*d + 2k*d) / t, and the MLP's gate and up 2f / t (the
swiglu_down rule recomputes their product in backward; torch.compile's fused RMSNorm keeps no
fp32 copy and GQA's kv heads are kept unrepeated) - 13.5h by this count.

times the activation bytes (2 for bf16 compute, 4 for fp32), times tokens = micro_batch x
seq_len / cp. `recompute = "full"` keeps only each block's input (h, /t with sp) and rebuilds
one block at a time in backward; `"selective"` keeps the matmul outputs (q, k, v, attention
projection, gate, up, down: 3h + a*d + 2k*d + 2f) and recomputes norms, element-wise ops and
attention. The loss holds the logits of one micro-batch: V/t x (activation bytes + 4 + 4)
per token: the fp32 log-probabilities kept for backward (4 bytes, "logits") and, while the
loss runs, the logits themselves and the log-probabilities' gradient ("loss_workspace").
Backward needs one more block's worth of activation gradients as workspace.

A pipeline rank holds several micro-batches' activations: 1F1B rank r holds min(pp - r, m)
(rank 0: pp, i.e. all L layers' worth), interleaved 1F1B L(1 + (pp-1)/(pp*v)) on rank 0
(Korthikanti et al. section 4.2.3), GPipe all m micro-batches, zbv pp micro-batches.

The caching allocator reserves more than is live: a calibrated fraction ALLOCATOR_FRAGMENTATION
of the transient (activation) memory, freed and re-allocated in different sizes every
micro-batch. Model states are allocated once and do not fragment.
"""

from __future__ import annotations

from dataclasses import dataclass

from shardwise.config.units import GIB, GRADIENT_BUCKET_BYTES
from shardwise.planner.layout import Layout
from shardwise.planner.model_shape import ModelShape
from shardwise.planner.placement import RankParams, rank_params

ALLOCATOR_FRAGMENTATION = 0.25
"""Reserved-but-unused memory as a fraction of the transient memory (activations, loss and
backward workspace: caching-allocator blocks split and cached between micro-batches). One
global constant, calibrated on the reserved memory of the Ultra-Scale Playbook sweep
(benchmarks/playbook.py): median error 12.5% at 0.1, 10.3% at 0.2, 9.8% at 0.25, 10.2% at 0.3."""
NORM_SAVED_TENSORS = 3
"""Per RMSNorm, tensors of width h saved for backward: its input, the normalised x and the scaled
output (the next matmul's input), as the eager implementation in models/common/norm.py does."""
LAYER_NORM_SAVED_TENSORS = 2
"""Per LayerNorm (GPT-2, BERT, ViT: torch's fused kernel), its input and its output (the next
matmul's input); the per-token mean and rstd it also keeps are not counted."""
LAYER_NORM_FAMILIES = ("gpt2", "bert", "vit")


def norm_saved_tensors(model: ModelShape) -> int:
    return LAYER_NORM_SAVED_TENSORS if model.family in LAYER_NORM_FAMILIES else NORM_SAVED_TENSORS


def mlp_saved_elements(model: ModelShape) -> int:
    """A dense MLP's saved elements per token: SwiGLU's gate, up, silu(gate) and product (4f), or
    the GELU MLP's up output and GELU output (2f)."""
    return (2 if model.family in LAYER_NORM_FAMILIES else 4) * model.ffn_dim
SP_SAVES_GATHERED_INPUT = False
"""Sequence parallelism: the column-parallel matmuls keep the all-gathered input for backward
(PyTorch's DTensor styles do; Megatron with its default re-gathers instead, Korthikanti's count)."""
"""DDP's default gradient bucket (bucket_cap_mb = 25)."""

PARAM_BYTES = {"fp32": 4, "bf16": 2}
OPTIMIZER_BYTES = {"fp32": 8, "bf16": 12}
MEMORY_KEYS = ("params", "grads", "grad_accum_buffer", "optimizer", "comm_buffers", "activations",
               "logits", "loss_workspace", "backward_workspace", "allocator_overhead")


@dataclass(frozen=True)
class MemoryEstimate:
    """One rank's bytes by kind; `peak` is their sum."""

    breakdown: dict
    pp_rank: int
    step_buffers: float = 0.0
    """Buffers that exist only during the optimizer step (the ZeRO-1/2 parameter gather)."""

    @property
    def peak(self) -> float:
        return sum(self.breakdown.values())

    @property
    def states(self) -> float:
        """Memory at the optimizer step: parameters, gradients, optimizer states and buffers."""
        kept = sum(self.breakdown[k] for k in ("params", "grads", "grad_accum_buffer", "optimizer"))
        return kept + max(self.breakdown["comm_buffers"], self.step_buffers)

    def gib(self) -> dict:
        return {key: value / GIB for key, value in self.breakdown.items()}


def zero_shards(layout: Layout) -> int:
    """Ranks that one dense parameter's ZeRO shards are spread over."""
    return layout.dp // layout.dp_replicate * layout.cp


def expert_shards(layout: Layout) -> int:
    """Ranks that hold a copy of one routed expert (its data-parallel group): dp*cp/ep."""
    return max(1, layout.dp * layout.cp // layout.ep)


def state_bytes(params: RankParams, layout: Layout) -> dict:
    """Parameter, gradient, accumulation-buffer and optimizer bytes of one rank (ZeRO paper)."""
    dtype = layout.state_dtype
    p_bytes, o_bytes = PARAM_BYTES[dtype], OPTIMIZER_BYTES[dtype]
    buffer_bytes = 4 if (dtype == "bf16" and layout.accum_dtype == "fp32") else 0
    result = {"params": 0.0, "grads": 0.0, "grad_accum_buffer": 0.0, "optimizer": 0.0}
    # shardwise's ZeRO-1/2 row-shard the dense parameters only; routed experts (already split
    # over ep) keep full states on their dp*cp/ep replicas, unless ZeRO-3 shards them (FSDP2).
    for count, shards, z in ((params.dense, zero_shards(layout), layout.zero),
                             (params.experts, expert_shards(layout), 3 if layout.zero == 3 else 0)):
        result["params"] += count * p_bytes / (shards if z >= 3 else 1)
        result["grads"] += count * p_bytes / (shards if z >= 2 else 1)
        result["grad_accum_buffer"] += count * buffer_bytes / (shards if z >= 2 else 1)
        result["optimizer"] += count * o_bytes / (shards if z >= 1 else 1)
    return result


def comm_buffer_bytes(params: RankParams, layout: Layout) -> float:
    dtype = layout.state_dtype
    p_bytes = PARAM_BYTES[dtype]
    shards = zero_shards(layout)
    if layout.dp * layout.cp == 1:
        return 0.0
    if layout.zero == 3:
        grad_bytes = 4 if layout.accum_dtype == "fp32" else p_bytes
        return params.largest_block * (2 * p_bytes + grad_bytes)
    if layout.zero in (1, 2) and dtype == "bf16":
        return params.total * p_bytes * (1 + 1 / shards)
    if layout.zero == 0:
        return 2 * GRADIENT_BUCKET_BYTES
    return 0.0


def block_activation_elements(model: ModelShape, layout: Layout, layer: int, recompute: str = "") -> float:
    """Elements saved per token by one block in forward (see the module docstring)."""
    h, t = model.dim, layout.tp
    norm_share = t if layout.sp else 1
    recompute = recompute or layout.recompute
    if recompute == "full":
        return h / norm_share
    attention = (2 * model.q_width + 2 * model.kv_width) / t
    if layout.compile and recompute == "none" and not model.is_moe_layer(layer) and model.family == "llama":
        return compiled_block_elements(model, layout)
    if model.is_moe_layer(layer):
        k = model.experts_per_token
        # replicated over tp: every tp rank routes and computes all of its tokens' experts
        mlp = k * (2 * h + 4 * model.expert_ffn_dim) + 4 * model.shared_ffn_dim + 2 * model.n_experts
    else:
        mlp = mlp_saved_elements(model) / t
    if recompute == "selective":
        mlp_outputs = mlp / 2 if not model.is_moe_layer(layer) else mlp
        return h / norm_share + (model.q_width + 2 * model.kv_width) / t + 2 * h / norm_share + mlp_outputs
    # The q/k/v and gate/up matmuls save their input; with sequence parallelism that is the
    # all-gathered (full-sequence) norm output unless the runtime re-gathers it in backward.
    matmul_inputs = 2 * h / (1 if SP_SAVES_GATHERED_INPUT else norm_share)
    return 2 * (norm_saved_tensors(model) - 1) * h / norm_share + matmul_inputs + attention + mlp


def compiled_block_elements(model: ModelShape, layout: Layout) -> float:
    """A dense block compiled with the rewrite rules (see the module docstring)."""
    h, t = model.dim, layout.tp
    norm_share = t if layout.sp else 1
    norms = 2 * h / norm_share + 2 * h / (1 if SP_SAVES_GATHERED_INPUT else norm_share)
    return norms + (2 * model.q_width + 2 * model.kv_width) / t + 2 * model.ffn_dim / t


def full_block_elements(model: ModelShape, layout: Layout, layer: int) -> float:
    """Elements of one block's activations without recomputation (what backward rebuilds)."""
    return block_activation_elements(model, layout, layer, recompute="none")


def in_flight_micro_batches(layout: Layout, pp_rank: int) -> float:
    """How many micro-batches' activations of all its stages this pp rank holds at its peak."""
    pp, m, v = layout.pp, layout.grad_accum, layout.virtual_stages
    if pp == 1:
        return 1.0
    if layout.pp_schedule == "gpipe":
        return float(m)
    if layout.pp_schedule in ("interleaved-1f1b", "zero-bubble"):
        return min(float(m), (pp - pp_rank) * (1 + (pp - 1) / (pp * v)))
    if layout.pp_schedule == "zbv":
        return float(min(m, pp))
    return float(min(m, pp - pp_rank))


def activation_bytes_per_element(layout: Layout) -> int:
    return 2 if layout.matmul_dtype == "bf16" else 4


def rank_memory(model: ModelShape, layout: Layout, pp_rank: int) -> MemoryEstimate:
    params = rank_params(model, layout, pp_rank)
    breakdown = dict.fromkeys(MEMORY_KEYS, 0.0)
    breakdown.update(state_bytes(params, layout))
    breakdown["comm_buffers"] = comm_buffer_bytes(params, layout)
    element = activation_bytes_per_element(layout)
    tokens = layout.micro_batch * layout.seq_len / layout.cp
    per_micro_batch = sum(block_activation_elements(model, layout, i) for i in params.layers) * tokens * element
    if params.has_first:
        per_micro_batch += tokens * model.dim * element / (layout.tp if layout.sp else 1)  # embedding output
    breakdown["activations"] = per_micro_batch * in_flight_micro_batches(layout, pp_rank)
    largest = max((full_block_elements(model, layout, i) for i in params.layers), default=0.0)
    breakdown["backward_workspace"] = largest * tokens * element
    if params.has_last:
        # Kept for backward: the final norm's tensors and the fp32 log-probabilities; transient at
        # the loss: the logits in the compute dtype and the fp32 gradient of the log-probabilities.
        held = layout.grad_accum if (layout.pp > 1 and layout.pp_schedule == "gpipe") else 1
        vocab = model.vocab_size / layout.tp
        saved = vocab * 4 + norm_saved_tensors(model) * model.dim * element
        breakdown["logits"] = saved * tokens * held
        breakdown["loss_workspace"] = vocab * (element + 4) * tokens
    transient = (breakdown["activations"] + breakdown["logits"] + breakdown["loss_workspace"]
                 + breakdown["backward_workspace"])
    breakdown["allocator_overhead"] = ALLOCATOR_FRAGMENTATION * transient
    staging = 0.0
    if breakdown["comm_buffers"] and layout.zero in (1, 2):
        # The ZeRO-1/2 gather buffer lives during the optimizer step only; forward/backward reuse
        # its memory, so it adds to the peak only by what exceeds their transient memory.
        staging = breakdown["comm_buffers"]
        breakdown["comm_buffers"] = max(0.0, staging - transient - breakdown["allocator_overhead"])
    return MemoryEstimate(breakdown=breakdown, pp_rank=pp_rank, step_buffers=staging)


def peak_memory(model: ModelShape, layout: Layout) -> MemoryEstimate:
    """The rank with the highest peak (pipeline ranks differ; all others are symmetric)."""
    ranks = range(layout.pp) if layout.pp <= 8 else sorted({0, 1, layout.pp - 2, layout.pp - 1})
    return max((rank_memory(model, layout, r) for r in ranks), key=lambda m: m.peak)
