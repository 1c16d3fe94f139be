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

T5 (model.family "t5", encoder-decoder, models/t5/model.py; eager, fp32-validated in
tests/planner/test_family_memory.py): its blocks are counted per token of their own stack, over
the lengths span corruption gives one sequence of seq_len S (data/objectives.py): n = max(1,
round(mask_fraction x S / 3)) spans of 3 tokens, an encoder input of S_e = S - 2n + 1 tokens and
decoder targets of S_d = 4n + 1. The planner has no data config, so it takes the config's default
data.mask_fraction (0.15): S = 512 gives n = 26, S_e = 461, S_d = 105. With a = heads, d = head_dim:

    RMSNorms (input, normalised, scaled) x 2 (encoder) or 3 (decoder)   6h or 9h
    self-attention q, k, v and attention output                         4a*d
    attention probabilities (SDPA's math kernel: the learned, float     a*S_e (encoder), a*S_d (decoder)
      position bias needs a gradient, which the fused kernels lack)
    decoder: cross-attention q and output                               2a*d
    decoder: the keys and values each block projects from the encoder   2a*d * S_e / S_d
      output, per decoder token (the fused kernel runs: no bias, no mask)
    MLP v1.0: relu(up) (ReLU saves its output, the down matmul's input)  f
    MLP v1.1: gate, gelu(gate), up, product                              4f

each head-split term /t. Not counted: each norm's fp32 rsqrt (1 per token), the cross-attention's
log-sum-exp (a per decoder token), the relative-position buckets (S^2 integers per stack, once).
`recompute = "full"` keeps the block input h (the encoder output and biases are shared by all
blocks); `"selective"` the input and the matmul outputs: q, k, v, o, up (and gate), down, and a
decoder block's cross-attention q, o and its k, v over the encoder output (2a*d * S_e / S_d).
The encoder's final norm (3h per encoder token) is held with the embedding outputs (h per token of
each stack); the head and the loss run over the decoder's tokens.

Blocks compiled with the rewrite rules (`Layout.compile`, dense blocks, no recomputation) keep
what `observe/block_memory.py` measures on the Llama 3 8B block (11.6h per token in bf16 and in
fp32, against 24.6h eager): the two norms' inputs 2h (/t with sp), q, k, v and the attention
output (2a*d + 2k*d) / t, and the MLP's gate and up 2f / t - 11.5h by this count. Backward
rebuilds the norms' normalised outputs and the SwiGLU product (the swiglu rule's recomputation
tag, and `rules/backend.PARTITIONER`); torch.compile's fused RMSNorm keeps no fp32 copy and GQA's
kv heads are kept unrepeated. With sp the normalised outputs are counted too (2h/t): an
all-gather stands between each and its matmul, and collectives are never recomputed
(not measured: the measurement runs on one process).

times the activation bytes (2 for bf16 compute, 4 for fp32), times tokens = micro_batch x
seq_len / cp. `recompute = "full"` keeps only each block's input (h, /t with sp) and rebuilds
one block at a time in backward; `"selective"` keeps the matmul outputs (q, k, v, attention
projection, gate, up, down: 3h + a*d + 2k*d + 2f) and recomputes norms, element-wise ops and
attention. The loss on full logits holds one micro-batch's: V/t x (activation bytes + 4 + 4)
per token: the fp32 log-probabilities kept for backward (4 bytes, "logits") and, while the
loss runs, the logits themselves and the log-probabilities' gradient ("loss_workspace").
The chunked loss (`Layout.chunked_loss`, where `loss_is_chunked`; models/common/chunked_loss.py)
makes the gradients of its input and of the head weight in its forward and keeps them for
backward ("logits": tokens x h + V x h, in the state dtype). "loss_workspace" is what its peak
adds to those, the larger of two moments: the last chunk (the input gradient, the fp32
weight-gradient sum V x h x 4, the head weight in the compute dtype where that differs, and one
chunk of logits, min(tokens, LOSS_CHUNK_ELEMENTS / V) rows at 4 bytes a logit in fp32 or
2 + 4 + 2 with 16-bit compute: the logits, their fp32 copy and the gradient cast back; on a GPU
with compiled blocks the chunk's softmax and gradient run compiled, logits in and gradient out,
2 x the compute bytes) and the sum cast to a 16-bit weight's dtype. Under tp, V is this rank's
columns (ceil(V/t)), the input gradient still covers every token (summed over the ranks in
backward), the chunks run eagerly and, with sp, the loss all-gathers h first. Each count is
held to the measured peak: on a CPU tensor by tensor, on CUDA by the allocator (within 0.7% on
an H200). Backward scales the kept gradients in place. On a CPU the chunk's logits buffer is
kept between calls, so it counts throughout. Where the micro-batch is
one GPU chunk (up to 2,093 tokens at vocabulary 128k) the chunked loss holds about what full
logits do, and the fp32 weight-gradient sum (V x h x 4) adds to it.
`benchmarks/loss_memory.py` measures it (tests/planner/test_loss_memory.py holds the two).
Backward needs one more block's worth of activation gradients as workspace.

LoRA (`Layout.lora_rank`; planner/adapters.py counts the adapters, models/common/lora.py is the
runtime): the base is frozen, so it holds its parameters only, the adapted linears' weights (and
biases) in `lora_base_dtype` and the rest in the state dtype, sharded by ZeRO-3 alone; the adapters
are the only parameters with gradients, an accumulation buffer and optimizer states, ZeRO-sharded
as any dense parameter. Communication buffers: ZeRO-3 gathers whole blocks (base and adapters) and
reduce-scatters the adapters' gradients; the others move the adapters' alone. Activations: a
frozen weight needs no gradient, so autograd keeps nothing for one (measured on this CPU,
tests/planner/test_lora_memory.py); per token of an adapted block, eager, no recomputation:

    norms: each its input (the frozen scale keeps no normalised x)      2h     (/t with sp)
    q, k, v and the attention output (SDPA's, as full fine-tuning)        (2a*d + 2k*d) / t
    MLP: all but down's input (SwiGLU: gate, up, silu(gate); GELU: up)    (4f or 2f) / t - f / t
    an adapted linear's input, only where an adapter reads it:
      the attention norm's output (q, k or v adapted), the MLP norm's     h each (/t with sp)
      (gate or up), down's input (down); o's is the attention output      f / t
    each adapter: A x, which B keeps                                       r
    with lora_dropout > 0, instead of the inputs: each adapter keeps its   2 x in_features
      dropped-out input and the mask (on a CPU a float tensor; CUDA's      (/t rowwise; colwise
      fused kernel keeps a byte mask, which this over-counts)               as the inputs above)

The embedding table is frozen, so the first block keeps no input for its first norm (nor q, k, v
without an adapter among them) and the embedding output is not kept; the final norm keeps its
input alone (its scale and the head are frozen). The loss is counted as full fine-tuning's, less
the head weight's gradient: the chunked loss makes none for a frozen head (neither its fp32 sum nor
the kept one).
`"selective"` recomputation adds the adapters' A x to the matmul outputs it keeps; MoE layers
(whose experts get no adapters) and compiled blocks are counted as without LoRA (not measured).

Packed sequences (`Layout.packed`: data.packing, data.document_mask): no token is padding, so
the counts above hold per token as they are; each row's RoPE cos and sin (2 x head_dim per token,
positions restart per document) are kept once, and where attention runs SDPA with the dense
document mask (every device but CUDA, which runs FlexAttention's block mask) SDPA makes a mask in
the compute dtype of it in every block and keeps it: seq_len elements per token per block.

A pipeline rank holds several micro-batches' activations: 1F1B rank r holds min(pp - r, m)
(rank 0: pp, i.e. all L layers' worth), interleaved 1F1B L(1 + (pp-1)/(pp*v)) on rank 0
(Korthikanti et al. section 4.2.3), GPipe all m micro-batches, zbv pp micro-batches.

The caching allocator reserves more than is live: a calibrated fraction ALLOCATOR_FRAGMENTATION
of the transient (activation) memory, freed and re-allocated in different sizes every
micro-batch. Model states are allocated once and do not fragment.
"""

from __future__ import annotations

from dataclasses import dataclass

from shardwise.core.model import ModelConfig
from shardwise.core.model_counts import decoder_layers, kv_width, q_width, span_corruption_lengths
from shardwise.core.units import GIB, GRADIENT_BUCKET_BYTES, loss_chunk_tokens
from shardwise.planner.adapters import adapted_linears
from shardwise.planner.layout import Layout
from shardwise.planner.placement import RankParams, rank_params
from shardwise.models.families import spec_of

ALLOCATOR_FRAGMENTATION = 0.25
"""Reserved-but-unused memory as a fraction of the transient memory (activations, loss and
backward workspace: caching-allocator blocks split and cached between micro-batches). One
global constant, calibrated on the reserved memory of the Ultra-Scale Playbook sweep
(benchmarks/playbook.py): median error 12.5% at 0.1, 10.3% at 0.2, 9.8% at 0.25, 10.2% at 0.3."""


def norm_saved_tensors(model: ModelConfig) -> int:
    """Tensors of width h each norm saves for backward (the family's spec says why)."""
    return spec_of(model.family).norm_saved_tensors


def mlp_saved_elements(model: ModelConfig) -> int:
    """A dense MLP's saved elements per token (the family's spec: SwiGLU 4f, a GELU MLP 2f)."""
    return spec_of(model.family).mlp_saved_per_ffn_dim * model.ffn_dim
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
    if layout.lora_rank:
        return lora_state_bytes(params, layout)
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


def lora_state_bytes(params: RankParams, layout: Layout) -> dict:
    """LoRA: the frozen base holds its parameters only (the adapted linears' weights in the base dtype,
    the rest in the state dtype), sharded by ZeRO-3 alone; the adapters, the only trainable
    parameters, hold what any trainable dense parameter does."""
    p_bytes, o_bytes = PARAM_BYTES[layout.state_dtype], OPTIMIZER_BYTES[layout.state_dtype]
    buffer_bytes = 4 if (layout.state_dtype == "bf16" and layout.accum_dtype == "fp32") else 0
    lora, shards, z = params.lora, zero_shards(layout), layout.zero
    frozen = (params.dense - lora.adapted_base) * p_bytes + lora.adapted_base * PARAM_BYTES[layout.base_dtype]
    frozen_experts = params.experts * p_bytes / (expert_shards(layout) if z == 3 else 1)
    return {"params": (frozen + lora.adapters * p_bytes) / (shards if z == 3 else 1) + frozen_experts,
            "grads": lora.adapters * p_bytes / (shards if z >= 2 else 1),
            "grad_accum_buffer": lora.adapters * buffer_bytes / (shards if z >= 2 else 1),
            "optimizer": lora.adapters * o_bytes / (shards if z >= 1 else 1)}


def lora_comm_buffer_bytes(params: RankParams, layout: Layout) -> float:
    """comm_buffer_bytes with LoRA: ZeRO-3 gathers whole blocks (frozen base and adapters) and
    reduce-scatters the adapters' gradients only; the others move the adapters' alone."""
    p_bytes, lora = PARAM_BYTES[layout.state_dtype], params.lora
    grad_bytes = 4 if layout.accum_dtype == "fp32" else p_bytes
    if layout.zero == 3:
        base = lora.largest_block_adapted_base
        block = (params.largest_block - base) * p_bytes + base * PARAM_BYTES[layout.base_dtype]
        return 2 * (block + lora.largest_block_adapters * p_bytes) + lora.largest_block_adapters * grad_bytes
    if layout.zero in (1, 2) and layout.state_dtype == "bf16":
        return lora.adapters * p_bytes * (1 + 1 / zero_shards(layout))
    if layout.zero == 0:
        return min(2 * GRADIENT_BUCKET_BYTES, lora.adapters * grad_bytes)
    return 0.0


def comm_buffer_bytes(params: RankParams, layout: Layout) -> float:
    dtype = layout.state_dtype
    p_bytes = PARAM_BYTES[dtype]
    shards = zero_shards(layout)
    if layout.dp * layout.cp == 1:
        return 0.0
    if layout.lora_rank:
        return lora_comm_buffer_bytes(params, layout)
    if layout.zero == 3:
        grad_bytes = 4 if layout.accum_dtype == "fp32" else p_bytes
        return params.largest_block * (2 * p_bytes + grad_bytes)
    if layout.zero in (1, 2) and dtype == "bf16":
        return params.total * p_bytes * (1 + 1 / shards)
    if layout.zero == 0:
        return 2 * GRADIENT_BUCKET_BYTES
    return 0.0


def block_activation_elements(model: ModelConfig, layout: Layout, layer: int, recompute: str = "") -> float:
    """Elements saved per token by one block in forward (see the module docstring). T5: layers
    0..n_layers-1 are the encoder's blocks, per encoder token; layers from n_layers on the decoder's,
    per decoder token; both at span corruption's lengths of layout.seq_len."""
    if spec_of(model.family).encoder_decoder:
        encoder_len, decoder_len = span_corruption_lengths(layout.seq_len)
        return t5_block_elements(model, layout, decoder=layer >= model.n_layers, encoder_len=encoder_len,
                                 decoder_len=decoder_len, recompute=recompute)
    h, t = model.dim, layout.tp
    norm_share = t if layout.sp else 1
    recompute = recompute or layout.recompute
    if recompute == "full":
        return h / norm_share
    if layout.lora_rank and recompute == "none":
        return lora_block_elements(model, layout, layer)
    attention = (2 * q_width(model) + 2 * kv_width(model)) / t
    if layout.compile and recompute == "none" and not model.is_moe_layer(layer) and spec_of(model.family).compiled_block_counted:
        return compiled_block_elements(model, layout)
    if model.is_moe_layer(layer):
        k = model.experts_per_token
        # replicated over tp: every tp rank routes and computes all of its tokens' experts
        mlp = k * (2 * h + 4 * model.expert_ffn_dim) + 4 * model.shared_ffn_dim + 2 * model.n_experts
    else:
        mlp = mlp_saved_elements(model) / t
    if recompute == "selective":
        mlp_outputs = mlp / 2 if not model.is_moe_layer(layer) else mlp
        adapters = layout.lora_rank * len(adapted_linears(model, layout.lora_roles, layer))  # A's outputs
        return h / norm_share + (q_width(model) + 2 * kv_width(model)) / t + 2 * h / norm_share + mlp_outputs + adapters
    # The q/k/v and gate/up matmuls save their input; with sequence parallelism that is the
    # all-gathered (full-sequence) norm output unless the runtime re-gathers it in backward.
    matmul_inputs = 2 * h / (1 if SP_SAVES_GATHERED_INPUT else norm_share)
    return 2 * (norm_saved_tensors(model) - 1) * h / norm_share + matmul_inputs + attention + mlp


def lora_block_elements(model: ModelConfig, layout: Layout, layer: int) -> float:
    """Elements an adapted decoder block keeps per token, eager and without recomputation (see the
    module docstring's LoRA section)."""
    h, f, t = model.dim, model.ffn_dim, layout.tp
    norm_share = t if layout.sp else 1
    gathered_share = 1 if SP_SAVES_GATHERED_INPUT else norm_share
    linears = adapted_linears(model, layout.lora_roles, layer)
    roles = {linear.role for linear in linears}
    kept = 2 * h / norm_share  # each norm's input; its scale is frozen, so its normalised x is not kept
    kept += (2 * q_width(model) + 2 * kv_width(model)) / t  # q, k, v and the attention output (SDPA's)
    if model.is_moe_layer(layer):  # counted as full fine-tuning keeps it (frozen experts: an over-count)
        k = model.experts_per_token
        kept += k * (2 * h + 4 * model.expert_ffn_dim) + 4 * model.shared_ffn_dim + 2 * model.n_experts
    else:  # the MLP's element-wise inputs; down's input (the last ffn-wide tensor) only for an adapter
        kept += (mlp_saved_elements(model) - f) / t
    if layout.lora_dropout:  # each adapter keeps its dropped-out input and the mask it scaled it by
        kept += sum(2 * linear.in_features / (gathered_share if linear.colwise else t) for linear in linears)
    else:  # a frozen linear keeps no input: an input is kept where an adapter reads it
        kept += h / gathered_share * ((not roles.isdisjoint(("q", "k", "v"))) + (not roles.isdisjoint(("gate", "up"))))
        kept += f / t if "down" in roles else 0.0  # o's input is the attention output, kept above
    return kept + layout.lora_rank * len(linears)  # A x, which B keeps


def t5_block_elements(model: ModelConfig, layout: Layout, *, decoder: bool, encoder_len: int, decoder_len: int,
                      recompute: str = "") -> float:
    """Elements saved per token of its own stack by one T5 encoder or decoder block, its sequences
    encoder_len and decoder_len tokens long (see the module docstring for each term)."""
    h, t, heads = model.dim, layout.tp, model.n_heads
    norm_share = t if layout.sp else 1
    q, kv = q_width(model) / t, kv_width(model) / t
    source_per_token = encoder_len / decoder_len  # encoder tokens a decoder token's cross-attention reads
    recompute = recompute or layout.recompute
    if recompute == "full":
        return h / norm_share  # the block input; the encoder output and biases are shared by all blocks
    mlp_outputs = (2 if model.gated_mlp else 1) * model.ffn_dim / t
    if recompute == "selective":
        # The input, and the matmul outputs: q, k, v, the attention projection, the MLP's up (and
        # gate) and down; a decoder block adds its cross-attention's q, k and v (over the encoder
        # output) and projection. Norms, softmax and attention are recomputed.
        kept = h / norm_share + q + 2 * kv + h + mlp_outputs + h
        return kept + (q + 2 * kv * source_per_token + h if decoder else 0.0)
    norms = 3 if decoder else 2
    # Each norm keeps its input and normalised x; its output is the next matmul's saved input (see
    # block_activation_elements on sequence parallelism).
    norm_elements = norms * ((norm_saved_tensors(model) - 1) * h / norm_share
                             + h / (1 if SP_SAVES_GATHERED_INPUT else norm_share))
    own_len = decoder_len if decoder else encoder_len
    # q, k, v, the attention output (o's input) and the softmax probabilities the math kernel keeps.
    self_attention = 2 * q + 2 * kv + heads * own_len / t
    # q and the output on the decoder tokens; k and v over the encoder output, projected per block.
    cross_attention = 2 * q + 2 * kv * source_per_token if decoder else 0.0
    # ReLU keeps its output (the down matmul's input, one storage); the gated GELU keeps the gate,
    # gelu(gate), up and their product.
    mlp = (4 if model.gated_mlp else 1) * model.ffn_dim / t
    return norm_elements + self_attention + cross_attention + mlp


def compiled_block_elements(model: ModelConfig, layout: Layout) -> float:
    """A dense block compiled with the rewrite rules (see the module docstring)."""
    h, t = model.dim, layout.tp
    norm_share = t if layout.sp else 1
    norms = 2 * h / norm_share  # inputs; backward rebuilds the normalised outputs from them
    if layout.sp:  # unless an all-gather stands between a norm and its matmul: not recomputed
        norms += 2 * h / (1 if SP_SAVES_GATHERED_INPUT else norm_share)
    return norms + (2 * q_width(model) + 2 * kv_width(model)) / t + 2 * model.ffn_dim / t


def full_block_elements(model: ModelConfig, layout: Layout, layer: int) -> float:
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


def micro_batch_activation_elements(model: ModelConfig, layout: Layout,
                                    params: RankParams) -> tuple[float, float, float]:
    """One micro-batch on this rank: (elements its blocks and embedding output keep, elements of its
    largest block without recomputation, tokens through the output head)."""
    if spec_of(model.family).encoder_decoder:
        return t5_micro_batch_elements(model, layout, params)
    tokens = layout.micro_batch * layout.seq_len / layout.cp
    kept = sum(block_activation_elements(model, layout, i) for i in params.layers) * tokens
    if params.has_first and layout.lora_rank:
        kept -= lora_first_block_unkept(model, layout) * tokens
    elif params.has_first:
        kept += tokens * model.dim / (layout.tp if layout.sp else 1)  # embedding output
    largest = max((full_block_elements(model, layout, i) for i in params.layers), default=0.0) * tokens
    return kept, largest, tokens


def packed_batch_elements(model: ModelConfig, layout: Layout, params: RankParams, device: str) -> float:
    """Per token, what a packed micro-batch (document masks) keeps beyond a causal one: RoPE's cos
    and sin per row (positions restart per document), and where attention runs SDPA with the dense
    document mask (any device but CUDA, models/common/document_mask.py) the mask SDPA makes of it in
    the compute dtype, seq_len per token, kept by every block (see the module docstring)."""
    if not layout.packed:
        return 0.0
    masks = 0 if device == "cuda" or layout.recompute == "full" else layout.seq_len * len(params.layers)
    return 2 * model.head_size + masks


def lora_first_block_unkept(model: ModelConfig, layout: Layout) -> float:
    """With LoRA the embedding table is frozen, so nothing before the first adapter needs a gradient:
    the first block keeps no input of its first norm, nor (without a q, k or v adapter) q, k and v."""
    if layout.recompute == "full":
        return 0.0
    unkept = model.dim / (layout.tp if layout.sp else 1)
    roles = {linear.role for linear in adapted_linears(model, layout.lora_roles, 0)}
    if roles.isdisjoint(("q", "k", "v")) and layout.recompute == "none":
        unkept += (q_width(model) + 2 * kv_width(model)) / layout.tp
    return unkept


def t5_micro_batch_elements(model: ModelConfig, layout: Layout, params: RankParams) -> tuple[float, float, float]:
    """`micro_batch_activation_elements` for T5: encoder blocks over the encoder's tokens, decoder
    blocks over the decoder's. The runtime refuses pipeline parallelism for T5, and the planner's
    stages split the encoder blocks only (`placement.split_layers`), so the rank with the last stage
    holds the decoder blocks and the head; the one with the first, the embedding outputs and the
    encoder's final norm."""
    encoder_len, decoder_len = span_corruption_lengths(layout.seq_len)
    sequences = layout.micro_batch / layout.cp
    encoder_tokens, decoder_tokens = sequences * encoder_len, sequences * decoder_len
    norm_share = layout.tp if layout.sp else 1

    def block(decoder: bool, recompute: str = "") -> float:
        return t5_block_elements(model, layout, decoder=decoder, encoder_len=encoder_len, decoder_len=decoder_len,
                                 recompute=recompute)

    kept = len(params.layers) * block(False) * encoder_tokens
    largest = block(False, "none") * encoder_tokens if params.layers else 0.0
    if params.has_first:
        kept += (encoder_tokens + decoder_tokens) * model.dim / norm_share  # both stacks' embedding outputs
        kept += norm_saved_tensors(model) * model.dim * encoder_tokens / norm_share  # the encoder's final norm
    if params.has_last:
        kept += decoder_layers(model, spec_of(model.family)) * block(True) * decoder_tokens
        largest = max(largest, block(True, "none") * decoder_tokens)
    return kept, largest, decoder_tokens


def loss_is_chunked(model: ModelConfig, layout: Layout) -> bool:
    """Whether the runtime takes this layout's loss chunked (`distributed/parallelize.py`,
    `targets_kwarg`): asked for, no pp (whose schedule takes the last stage's logits), and a family
    whose model takes the targets. Under tp each rank chunks its vocabulary columns."""
    return layout.chunks_loss and spec_of(model.family).chunked_loss


def loss_bytes(model: ModelConfig, layout: Layout, tokens: float, element: int, device: str) -> tuple[float, float]:
    """(kept for backward, transient while the loss runs) on the last stage, beside the final
    norm's saved tensors (kept either way). See the module docstring."""
    # a frozen final norm and head keep the norm's input alone (nothing needs their weights' gradients)
    norm = (1 if layout.lora_rank else norm_saved_tensors(model)) * model.dim * element * tokens
    vocab = model.vocab_size / layout.tp
    if not loss_is_chunked(model, layout):
        held = layout.grad_accum if (layout.pp > 1 and layout.pp_schedule == "gpipe") else 1
        return (vocab * 4 * tokens + norm) * held, vocab * (element + 4) * tokens
    vocab = -(-model.vocab_size // layout.tp)  # the largest rank's rows (torch.chunk's pieces)
    state = PARAM_BYTES[layout.state_dtype]  # the final norm's output and the head weight are in it
    trains_head = not layout.lora_rank  # a frozen (LoRA) head's weight gradient is neither made nor kept
    grad_h, grad_w = tokens * model.dim * state, vocab * model.dim * state * trains_head
    fp32_sum = vocab * model.dim * 4 * trains_head  # the weight gradient is summed over the chunks in fp32
    rows = min(tokens, loss_chunk_tokens(vocab, device))
    if layout.compile and device != "cpu" and layout.tp == 1:  # the compiled chunk (`decoder_output`): logits in,
        # gradient out; under tp the chunks run eagerly, their statistics all-reduced between the steps
        per_logit = 2 * element
    else:  # eager, in place over fp32: with 16-bit logits their fp32 copy and the gradient cast back
        per_logit = element if element == 4 else element + 4 + element
    weight_copy = vocab * model.dim * element if element != state else 0  # the head weight in the compute dtype
    kept_buffer = rows * vocab * element if device == "cpu" else 0  # `logits_buffer`: kept between calls on a CPU
    # sequence parallelism hands the loss 1/tp of the sequence (the final norm's output, in the
    # state dtype): it all-gathers h, which the whole forward holds
    gathered = tokens * model.dim * state if layout.sp and layout.tp > 1 else 0
    peaks = (grad_h + fp32_sum + weight_copy + gathered + rows * vocab * per_logit,  # the last chunk
             grad_h + fp32_sum + (grad_w if state != 4 else 0) + kept_buffer + gathered)  # the sum cast to
    # the weight's dtype
    # backward scales the kept gradients in place: nothing beyond them and the kept buffer
    return grad_h + grad_w + norm, max(max(peaks) - grad_h - grad_w, kept_buffer)


def rank_memory(model: ModelConfig, layout: Layout, pp_rank: int, device: str = "cuda") -> MemoryEstimate:
    params = rank_params(model, layout, pp_rank)
    breakdown = dict.fromkeys(MEMORY_KEYS, 0.0)
    breakdown.update(state_bytes(params, layout))
    breakdown["comm_buffers"] = comm_buffer_bytes(params, layout)
    element = activation_bytes_per_element(layout)
    kept, largest, tokens = micro_batch_activation_elements(model, layout, params)
    kept += packed_batch_elements(model, layout, params, device) * tokens
    breakdown["activations"] = kept * element * in_flight_micro_batches(layout, pp_rank)
    breakdown["backward_workspace"] = largest * element
    if params.has_last:
        breakdown["logits"], breakdown["loss_workspace"] = loss_bytes(model, layout, tokens, element, device)
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


def peak_memory(model: ModelConfig, layout: Layout, device: str = "cuda") -> MemoryEstimate:
    """The rank with the highest peak (pipeline ranks differ; all others are symmetric)."""
    ranks = range(layout.pp) if layout.pp <= 8 else sorted({0, 1, layout.pp - 2, layout.pp - 1})
    return max((rank_memory(model, layout, r, device) for r in ranks), key=lambda m: m.peak)
