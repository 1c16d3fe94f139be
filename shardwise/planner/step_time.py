"""Time of one optimizer step of a layout, with its breakdown, from first principles.

Per micro-batch on the busiest pipeline rank (tokens = micro_batch x seq_len / cp):

- compute: matmul FLOPs / (peak x MATMUL_EFFICIENCY) + element-wise traffic / memory bandwidth;
  attention at ATTENTION_EFFICIENCY of the matmul rate.
  FLOPs per token of a block = 6 x its matmul weights (routed experts: the k a token visits)
  + 6 x a*d x seq_len for causal attention (half of the MFU convention's 12, flash attention
  skips the masked half); divided by tp. Element-wise traffic (norms, SwiGLU, residuals,
  RoPE, softmax of the loss): the saved activations are written in forward, read in backward,
  and their gradients written and read: 4 x activation bytes, plus the logits' 3 passes.
  Weights and gradients of the rank also cross memory once per micro-batch (weight_traffic_bytes:
  16 bytes per parameter with bf16 weights and an fp32 accumulation buffer), which is why many
  small micro-batches cost more than few large ones at equal tokens, beyond the collectives.
  Recomputation adds a block's forward (full: 2N + attention) or its attention and element-
  wise forward (selective).
- tensor parallel (Megatron, Korthikanti et al. 2022 section 4.2.2): per block, forward and
  backward, 2 all-reduces of the b*s*h activation, or with sequence parallelism 2 all-gathers
  and 2 reduce-scatters of the same bytes; on the critical path (not overlapped). Under a
  pipeline across nodes the tp ranks reach each collective out of step: (tp - 1) x
  PIPELINE_SKEW_S more each.
- context parallel: ring attention passes K/V chunks (cp - 1 steps, forward; K/V and their
  gradients backward) overlapped with the attention of the chunk in hand; all-to-all (Ulysses)
  re-shards q, k, v and the output: 4 all-to-alls forward, 4 backward, not overlapped.
- expert parallel: dispatch and combine all-to-all of k x h per token, forward and backward.

Per step:

- pipeline (Ultra-Scale Playbook, "pipeline parallelism"): m = grad_accum micro-batches
  through p stages; 1F1B and GPipe idle (p-1) x (t_f + t_b), interleaved (p-1)/v x (t_f + t_b)
  (Narayanan et al. 2021); zero-bubble schedules split the weight gradient off and fill most
  of it: ZB-H1 a third of 1F1B's (Qi et al. 2023), ZB-V about a sixth. Activations cross
  each stage boundary forward and backward (point-to-point, inter-node when a stage's ranks
  fill a node).
- data parallel (ZeRO paper section 7): ZeRO-0 all-reduces the gradients (2 (n-1)/n x Ψ
  bytes), ZeRO-1 reduce-scatters them and all-gathers the updated parameters (one blocking
  all-gather per 25 MiB bucket, as distributed/zero.py issues them), ZeRO-2
  reduce-scatters after every micro-batch, ZeRO-3 also all-gathers the parameters in forward
  and backward of every micro-batch. Bucketed gradient reduction overlaps the backward of the
  last micro-batch (COMM_OVERLAP of it); ZeRO-3 prefetch overlaps each micro-batch's compute.
- optimizer: AdamW is memory bound: ~ 16 bytes read and written per fp32 state element.

Other runtimes overlap more than shardwise's (`Layout.comm_overlap`, for estimating their published
runs: benchmarks/weak_scaling.py). "tp" (Megatron-Core's --tp-comm-overlap, torch's async TP): the
tensor-parallel collectives are asynchronous and pipelined with the matmuls beside them, so a
micro-batch pays only the wire time (latency and bytes, no host-side issue cost) beyond
COMM_OVERLAP of its blocks' matmul time. "p2p" (Megatron-Core's interleaved schedule, Llama 3's
asynchronous point-to-point): stage transfers are posted ahead and waited for on the device, so
the tp ranks stay in step (no PIPELINE_SKEW_S) and a transfer pays only its wire time beyond
COMM_OVERLAP of the stage's forward. "dp" (--overlap-grad-reduce, --overlap-param-gather): ZeRO-0-2's
gradient reduction pays only its wire time beyond COMM_OVERLAP of the last micro-batch's backward,
and the parameter all-gather beyond COMM_OVERLAP of the next step's first forward (ZeRO-3's
prefetching is modelled as it is).

LoRA (`Layout.lora_rank`): a frozen weight costs 4 FLOPs per token (forward and the input
gradient; no weight gradient), an adapter's 6; the frozen base is read twice per micro-batch and
accumulates nothing; gradients are reduced, and optimizer states updated, for the adapters alone,
while ZeRO-3 still gathers the whole base. Packed sequences (`Layout.packed`): every token counts
(no padding); document-masked attention costs what causal attention does on a GPU (FlexAttention
skips the blocks outside every document, at most causal's work) and twice that on a CPU, whose SDPA
computes every score of the dense mask.

tokens/s per device = tokens per step / step time / world size; MFU = model FLOPs per token
(6N + 12 L a d s, the PaLM convention, as the trainer reports it) x tokens/s / peak.

Calibrated constants (global, one value each, fitted once on the Ultra-Scale Playbook sweep;
see benchmarks/playbook.py): MATMUL_EFFICIENCY, COMM_EFFICIENCY, COMM_OVERLAP,
COLLECTIVE_OVERHEAD_S, PIPELINE_SKEW_S; ATTENTION_EFFICIENCY comes from the FlashAttention-2
paper and is checked against MPT's published MFU (benchmarks/published.py).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from shardwise.core.model import ModelConfig
from shardwise.core.model_counts import head_flops_per_token, kv_width, matmul_params, moe_mlp_params, q_width
from shardwise.core.units import GRADIENT_BUCKET_BYTES
from shardwise.models.families import spec_of
from shardwise.planner.adapters import adapted_linears
from shardwise.planner.hardware import Hardware
from shardwise.planner.layout import Layout
from shardwise.planner.memory import (PARAM_BYTES, activation_bytes_per_element, block_activation_elements,
                                      full_block_elements)
from shardwise.planner.placement import rank_params

MATMUL_EFFICIENCY = 0.5
"""Fraction of the datasheet peak that a training step's matmuls and attention kernels reach
(large bf16 GEMMs alone reach ~0.7-0.8 on H100; attention, smaller shapes and kernel gaps
less). Calibrated: the median over the playbook sweep's (model, GPU count) groups of best
measured / best predicted throughput was 0.83 at 0.6."""
ATTENTION_EFFICIENCY = 0.5
"""Rate of the attention kernels relative to the matmuls': FlashAttention-2 forward + backward
reaches ~35% of an H100's bf16 peak (Dao 2023, causal, head dim 128) where large GEMMs reach
~70%, so a causal attention's real work (half of the MFU convention's 12 L a d s: masked blocks
are skipped) costs as much time as the full 12 at the matmul rate. Evidence beside the paper:
MPT's published MFU on H100 falls from 40% to 34% as the sequence grows from 512 to 16K tokens
(benchmarks/published.py); with attention at the matmul rate the predicted MFU rose instead."""
COMM_EFFICIENCY = 0.5
"""Fraction of the benchmarked bus bandwidth a training collective gets (it shares the GPU
with compute kernels and runs smaller messages than the benchmark). Calibrated with
PIPELINE_SKEW_S on the playbook sweep's rankings (docs/benchmarks.md): 0.5 and 0.8 are within
0.01 on the rank correlations; 0.5 picks better layouts (mean pick ratio 0.89 vs 0.80)."""
COMM_OVERLAP = 0.8
"""Fraction of the last micro-batch's backward that bucketed gradient reduction can hide behind."""
COLLECTIVE_OVERHEAD_S = 3e-4
"""Calibrated on the playbook sweep, where tensor-parallel layouts slow down 2-4x from 16 to 1
sequence per micro-batch at equal tokens per step (0.3 ms per collective explains it; 0.1 ms
and 1 ms rank the sweep's layouts worse). Host-side cost of issuing one blocking collective or point-to-point transfer from the training
loop (kernel launch, stream synchronisation, Python), on top of the wire latency."""
PIPELINE_SKEW_S = 1.5e-4
"""Wait per ring hand-off of a tensor-parallel collective when the layout's pipeline spans nodes:
a collective over n ranks costs (n - 1) x this on top of its wire time. Without a pipeline the
tp ranks issue each collective in lock-step; with one whose stages sit on different nodes, the
host of each rank blocks in the schedule's inter-node point-to-point transfers at different
moments, so the ranks reach every collective out of step and each of the ring's n - 1
neighbour hand-offs waits for the later of two ranks. Evidence (playbook sweep, measured step
time against the number of micro-batches at fixed dp/tp/pp): with the pipeline across nodes
each extra micro-batch costs per block ~6, 15, 26, 60 ms at tp 2, 4, 8, 16 (8 collectives:
0.4-0.5 ms x (tp - 1) each), alike for hidden 2048 and 4096 and for pp 2, 4, 8; with tp = 1
nothing measurable; on one node (8 GPUs, tp 2-4, pp 2) 1.5-2 ms per block, and without a
pipeline 0.3 ms per collective, both as COLLECTIVE_OVERHEAD_S alone explains. Those slopes
suggest 0.4-0.5 ms; 0.15 ms is the best of 0.15 / 0.3 / 0.45 ms for the sweep's rankings once
multi-rail bandwidth and ATTENTION_EFFICIENCY were added, so the model under-predicts them.
Not with `Layout.comm_overlap` "p2p": where the transfers are posted ahead and waited for on the
device, no host blocks at its own moment: on Megatron-Core's published 70B layout (tp 8 x pp 2 x
dp 48) this term alone would add 2.8 s to a step measured at 2.2 s."""
"""DDP's default bucket (bucket_cap_mb = 25); nanotron and shardwise's ZeRO-1/2 bucket alike."""
OPTIMIZER_BYTES_PER_PARAM = 32
"""AdamW reads and writes master weight, m, v (3 x 8 bytes), reads the gradient (4), writes the
bf16 copy (2-4)."""
TIME_KEYS = ("compute", "recompute", "tp_comm", "cp_comm", "ep_comm", "pp_comm", "pipeline_bubble",
             "dp_comm", "dp_comm_overlapped", "optimizer")


@dataclass(frozen=True)
class TimeEstimate:
    breakdown: dict
    """Seconds per step by part; dp_comm_overlapped is hidden behind compute and not in `step`."""

    @property
    def step(self) -> float:
        return sum(v for k, v in self.breakdown.items() if k != "dp_comm_overlapped")


def ranks_per_node(group_size: int, stride: int, hardware: Hardware) -> int:
    """How many of a group's ranks share a node: a group of `group_size` ranks, `stride` apart in
    rank order (tp innermost), holds min(group_size, gpus_per_node / stride) ranks of each node it
    touches; fewer than group_size means the group spans nodes."""
    return max(1, min(group_size, hardware.gpus_per_node // max(1, stride)))


def collective_time(kind: str, size_bytes: float, ranks: int, per_node: int, hardware: Hardware,
                    calls: int = 1) -> float:
    """alpha-beta model (Thakur et al. 2005, ring algorithms) in nccl-tests' bus-bandwidth terms:
    per call, alpha x steps (log2 n, twice for all-reduce: NCCL's tree and hierarchical algorithms
    at scale, where a ring's 2(n-1) steps would not be used; 1 for point-to-point) + the
    host-side issue cost; plus (n-1)/n x S / busbw
    (x2 for all-reduce) for the S bytes, however many calls carry them.

    A group within one node (per_node == ranks) runs at the NVLink bus bandwidth. A group that
    spans nodes with `per_node` of its ranks in each node crosses the network through per_node
    NICs at once (NCCL gives each of a node's ranks its own channel and NIC), so its bus bandwidth
    is per_node x the per-GPU inter-node figure, at most the NVLink one: dp over all 8 GPUs of
    each node gets the node's 8 NICs, dp beside tp = 8 gets one."""
    if ranks <= 1 or size_bytes <= 0:
        return 0.0
    spans_nodes = per_node < ranks
    bandwidth = hardware.bandwidth(kind, spans_nodes=False)
    if spans_nodes:
        bandwidth = min(bandwidth, per_node * hardware.bandwidth(kind, spans_nodes=True))
    bandwidth *= COMM_EFFICIENCY
    factor = 1.0 if kind == "p2p" else (ranks - 1) / ranks * (2 if kind == "all_reduce" else 1)
    steps = 1 if kind == "p2p" else math.ceil(math.log2(ranks)) * (2 if kind == "all_reduce" else 1)  # tree
    latency = hardware.latency(spans_nodes=spans_nodes) * steps + COLLECTIVE_OVERHEAD_S
    return calls * latency + factor * size_bytes / bandwidth


def bucket_calls(size_bytes: float) -> int:
    """Gradient reduction is issued in buckets as backward produces them (DDP's bucket_cap_mb)."""
    return max(1, math.ceil(size_bytes / GRADIENT_BUCKET_BYTES))


def matmul_rate(layout: Layout, hardware: Hardware) -> float:
    efficiency = hardware.matmul_efficiency or MATMUL_EFFICIENCY
    return hardware.peak_flops(layout.matmul_dtype) * efficiency


def micro_batch_compute(model: ModelConfig, layout: Layout, hardware: Hardware, layers, has_last: bool) -> tuple:
    """(forward+backward seconds, recompute seconds, forward seconds) of one micro-batch on these blocks."""
    tokens = layout.micro_batch * layout.seq_len / layout.cp
    element = activation_bytes_per_element(layout)
    rate = matmul_rate(layout, hardware)
    spec = spec_of(model.family)
    matmul_flops = attention_flops = traffic = recompute_flops = recompute_traffic = 0.0
    # causal attention's real work per forward (2 x q_width x seq_len per token: half the
    # MFU convention's 4), in matmul-rate FLOPs
    attention_forward = 2.0 * q_width(model) * layout.seq_len / layout.tp * tokens / ATTENTION_EFFICIENCY
    if layout.packed and hardware.device == "cpu":  # SDPA with a dense document mask computes every score
        attention_forward *= 2
    for i in layers:
        matmul_flops += block_matmul_flops(model, layout, i) * tokens
        if model.is_moe_layer(i):  # replicated over tp: each tp rank computes its tokens' whole MoE layer
            matmul_flops += 6.0 * moe_mlp_params(model, active=True) * (1 - 1 / layout.tp) * tokens
        attention_flops += 3 * attention_forward  # forward and backward
        full = full_block_elements(model, layout, i) * tokens * element
        traffic += 4 * full
        if layout.recompute == "full":
            recompute_flops += 2.0 * matmul_params(model, spec, i) / layout.tp * tokens
            recompute_flops += attention_forward
            recompute_traffic += full
        elif layout.recompute == "selective":
            recompute_flops += attention_forward
            recompute_traffic += full - block_activation_elements(model, layout, i) * tokens * element
    if has_last:
        matmul_flops += head_flops_per_token(model) / layout.tp * tokens
        traffic += 3 * model.vocab_size / layout.tp * tokens * (element + 8)
    bandwidth = hardware.memory_bandwidth
    compute = (matmul_flops + attention_flops) / rate + traffic / bandwidth
    recompute = recompute_flops / rate + recompute_traffic / bandwidth
    return compute, recompute, compute / 3 + recompute


def block_matmul_flops(model: ModelConfig, layout: Layout, layer: int) -> float:
    """Matmul FLOPs per token of block `layer` on one tp rank, forward and backward: 6 per weight, or
    with LoRA 4 per frozen weight (no weight gradient) and 6 per adapter weight."""
    weights = matmul_params(model, spec_of(model.family), layer) / layout.tp
    if not layout.lora_rank:
        return 6.0 * weights
    adapters = sum(linear.adapter_params_per_tp_rank(layout.lora_rank, layout.tp)
                   for linear in adapted_linears(model, layout.lora_roles, layer))
    return 4.0 * weights + 6.0 * adapters


def trainable_params_of(params, layout: Layout) -> float:
    """The parameters of a rank that have gradients and optimizer states (LoRA: the adapters only)."""
    return params.lora.adapters if layout.lora_rank else params.total


def weight_traffic_bytes(params, layout: Layout) -> float:
    """Memory traffic of this rank's weights and gradients per micro-batch: forward and the input
    gradient read each weight (2 x its bytes); the weight gradient is written and read back to be
    added into the accumulation buffer, which is read and written (or, without a separate
    buffer, the gradient is read and written in place)."""
    weight = 2 if layout.state_dtype == "bf16" else 4
    if layout.accum_dtype != layout.state_dtype:
        accumulate = 2 * weight + 2 * (4 if layout.accum_dtype == "fp32" else 2)
    else:
        accumulate = 2 * weight
    if layout.lora_rank:  # the frozen base is read in forward and for the input gradient; nothing accumulates
        base = params.lora.adapted_base
        frozen = (params.total - base) * weight + base * PARAM_BYTES[layout.base_dtype]
        return 2 * frozen + params.lora.adapters * (2 * weight + accumulate)
    return params.total * (2 * weight + accumulate)


def tp_time(model: ModelConfig, layout: Layout, hardware: Hardware, num_layers: int, has_last: bool,
            matmul_s: float = 0.0) -> float:
    """Tensor-parallel communication of one micro-batch on these blocks, on the critical path; with
    `comm_overlap` "tp", only what its wire time exceeds COMM_OVERLAP of the blocks' matmuls
    (`matmul_s`) by: asynchronous collectives cost the host nothing to issue."""
    if layout.tp == 1:
        return 0.0
    tokens = layout.micro_batch * layout.seq_len / layout.cp
    size = tokens * model.dim * activation_bytes_per_element(layout)
    per_node = ranks_per_node(layout.tp, 1, hardware)
    if layout.sp:
        per_layer = 4 * (collective_time("all_gather", size, layout.tp, per_node, hardware)
                         + collective_time("reduce_scatter", size, layout.tp, per_node, hardware))
    else:
        per_layer = 4 * collective_time("all_reduce", size, layout.tp, per_node, hardware)
    collectives = 8 if layout.sp else 4  # per block, forward and backward
    skew = collectives * (layout.tp - 1) * PIPELINE_SKEW_S if tp_ranks_out_of_step(layout, hardware) else 0.0
    per_layer += skew
    recompute_layers = num_layers if layout.recompute == "full" else 0
    # the loss's softmax statistics (max, sum of exp, target logit): loss_parallel's all-reduces, or
    # the chunked loss's two a chunk over the same bytes (their per-chunk latency is not counted)
    head = 2 * collective_time("all_reduce", tokens * 4 * 3, layout.tp, per_node, hardware) if has_last else 0.0
    layers = num_layers + recompute_layers / 2
    total = per_layer * layers + head
    if "tp" not in layout.overlaps:
        return total
    comm = total - skew * layers
    return comm - overlapped_part(comm, collectives * layers + (2 if has_last else 0), matmul_s) + skew * layers


def tp_ranks_out_of_step(layout: Layout, hardware: Hardware) -> bool:
    """PIPELINE_SKEW_S applies: a pipeline whose stages sit on different nodes, its transfers waited
    for on the host (not with `comm_overlap` "p2p")."""
    spans_nodes = ranks_per_node(layout.pp, layout.dp * layout.cp * layout.tp, hardware) < layout.pp
    return spans_nodes and "p2p" not in layout.overlaps


def blocks_matmul_seconds(model: ModelConfig, layout: Layout, hardware: Hardware, layers) -> float:
    """Forward and backward matmul seconds of one micro-batch on these blocks (what asynchronous
    tensor-parallel collectives hide behind; a MoE layer's replicated experts left out)."""
    tokens = layout.micro_batch * layout.seq_len / layout.cp
    return sum(block_matmul_flops(model, layout, i) for i in layers) * tokens / matmul_rate(layout, hardware)


def cp_time(model: ModelConfig, layout: Layout, hardware: Hardware, num_layers: int) -> float:
    if layout.cp == 1:
        return 0.0
    element = activation_bytes_per_element(layout)
    tokens = layout.micro_batch * layout.seq_len / layout.cp
    per_node = ranks_per_node(layout.cp, layout.tp, hardware)
    if layout.cp_mode == "alltoall":
        qkv = tokens * (q_width(model) + 2 * kv_width(model)) / layout.tp * element
        out = tokens * q_width(model) / layout.tp * element
        one = collective_time("all_to_all", qkv, layout.cp, per_node, hardware) + \
            collective_time("all_to_all", out, layout.cp, per_node, hardware)
        return 2 * one * num_layers
    chunk = tokens * 2 * kv_width(model) / layout.tp * element
    hop = 2 if per_node == layout.cp else 1  # a ring that spans nodes has hops between nodes
    step = collective_time("p2p", chunk, 2, hop, hardware) - COLLECTIVE_OVERHEAD_S  # on the wire
    rate = matmul_rate(layout, hardware)
    attention_chunk = 4.0 * q_width(model) / layout.tp * tokens * tokens / (rate * ATTENTION_EFFICIENCY)  # one K/V chunk's attention, forward
    # The transfer hides behind the chunk's attention; issuing it (host-side overhead) does not.
    forward = (layout.cp - 1) * (max(0.0, step - attention_chunk) + COLLECTIVE_OVERHEAD_S)
    backward = (layout.cp - 1) * (max(0.0, 2 * step - 2 * attention_chunk) + 2 * COLLECTIVE_OVERHEAD_S)
    return (forward + backward) * num_layers


def ep_time(model: ModelConfig, layout: Layout, hardware: Hardware, layers) -> float:
    if layout.ep == 1:
        return 0.0
    tokens = layout.micro_batch * layout.seq_len / layout.cp
    size = tokens * model.experts_per_token * model.dim * activation_bytes_per_element(layout)
    per_node = ranks_per_node(layout.ep, layout.tp, hardware)
    moe_layers = sum(1 for i in layers if model.is_moe_layer(i))
    return 4 * collective_time("all_to_all", size, layout.ep, per_node, hardware) * moe_layers


def bubble_fraction(layout: Layout) -> float:
    """Idle time of a pipeline in units of one micro-batch's forward+backward on one stage-set."""
    pp, v = layout.pp, layout.virtual_stages
    if pp == 1:
        return 0.0
    if layout.pp_schedule in ("1f1b", "gpipe"):
        return float(pp - 1)
    if layout.pp_schedule == "interleaved-1f1b":
        return (pp - 1) / v
    if layout.pp_schedule == "zero-bubble":
        return (pp - 1) / v / 3
    return (pp - 1) / 6  # zbv


def pp_transfer_time(model: ModelConfig, layout: Layout, hardware: Hardware, mb_compute: float) -> float:
    """One stage boundary's activation (or its gradient) transfer for one micro-batch and virtual
    stage; with `comm_overlap` "p2p" issued ahead, only what its wire time exceeds COMM_OVERLAP of
    that stage's forward by."""
    tokens = layout.micro_batch * layout.seq_len / layout.cp
    size = tokens * model.dim / (layout.tp if layout.sp else 1) * activation_bytes_per_element(layout)
    per_node = ranks_per_node(2, layout.dp * layout.cp * layout.tp, hardware)
    transfer = collective_time("p2p", size, 2, per_node, hardware)
    if "p2p" not in layout.overlaps:
        return transfer
    return transfer - overlapped_part(transfer, 1, mb_compute / 3 / layout.virtual_stages)


def dp_time(params, layout: Layout, hardware: Hardware, mb_compute: float) -> tuple[float, float]:
    """(total data-parallel communication per step, the part overlapped with compute)."""
    ranks = layout.dp * layout.cp
    if ranks == 1:
        return 0.0, 0.0
    per_node = ranks_per_node(ranks, layout.tp, hardware)
    p_bytes = 2 if layout.state_dtype == "bf16" else 4
    g_bytes = 4 if layout.accum_dtype == "fp32" else p_bytes
    psi = trainable_params_of(params, layout)  # what has gradients (and, but for ZeRO-3's gathers, moves)
    m = layout.grad_accum
    if layout.zero == 0:
        total = collective_time("all_reduce", psi * g_bytes, ranks, per_node, hardware, bucket_calls(psi * g_bytes))
        hidden = min(total, COMM_OVERLAP * mb_compute * 2 / 3)
        if "dp" in layout.overlaps:
            hidden = overlapped_part(total, bucket_calls(psi * g_bytes), mb_compute * 2 / 3)
    elif layout.zero in (1, 2):  # ZeRO-2 reduce-scatters after every micro-batch, ZeRO-1 after the last
        reduce = collective_time("reduce_scatter", psi * g_bytes, ranks, per_node, hardware, bucket_calls(psi * g_bytes))
        gather = collective_time("all_gather", psi * p_bytes, ranks, per_node, hardware, bucket_calls(psi * p_bytes))
        reductions = 1 if layout.zero == 1 else m
        total = reductions * reduce + gather
        hidden = min(reductions * reduce, reductions * COMM_OVERLAP * mb_compute * 2 / 3)
        if "dp" in layout.overlaps:  # the gather behind the next step's first forward
            hidden = (reductions * overlapped_part(reduce, bucket_calls(psi * g_bytes), mb_compute * 2 / 3)
                      + overlapped_part(gather, bucket_calls(psi * p_bytes), mb_compute / 3))
    else:
        # FSDP: per block, an all-gather in forward and backward and a reduce-scatter; the transfers
        # are prefetched behind compute, issuing each of them is not.
        shard_ranks = ranks // layout.dp_replicate
        shard_per_node = ranks_per_node(shard_ranks, layout.tp, hardware)
        gather = collective_time("all_gather", gathered_bytes(params, layout), shard_ranks, shard_per_node, hardware)
        reduce = collective_time("reduce_scatter", psi * g_bytes, shard_ranks, shard_per_node, hardware)
        calls = 3 * max(1, len(params.layers))
        wire = 2 * gather + reduce - 3 * COLLECTIVE_OVERHEAD_S
        per_micro_batch = wire + calls * COLLECTIVE_OVERHEAD_S
        replica_per_node = ranks_per_node(layout.dp_replicate, layout.tp * shard_ranks, hardware)
        replicas = collective_time("all_reduce", psi * g_bytes / shard_ranks, layout.dp_replicate, replica_per_node, hardware)
        total = m * per_micro_batch + replicas
        hidden = m * min(wire, COMM_OVERLAP * mb_compute)
    return total, hidden


def overlapped_part(seconds: float, calls: float, window: float) -> float:
    """The part of `seconds` of asynchronous communication (`calls` collectives) that `comm_overlap`
    hides behind `window` seconds of compute: the host's cost of issuing them (it runs ahead of the
    device) and their wire time up to COMM_OVERLAP of the window."""
    wire = seconds - calls * COLLECTIVE_OVERHEAD_S
    return seconds - max(0.0, wire - COMM_OVERLAP * window)


def gathered_bytes(params, layout: Layout) -> float:
    """The bytes ZeRO-3 all-gathers per pass: every parameter of the rank (a LoRA base in its dtype)."""
    p_bytes = PARAM_BYTES[layout.state_dtype]
    if not layout.lora_rank:
        return params.total * p_bytes
    base = params.lora.adapted_base
    return (params.total - base + params.lora.adapters) * p_bytes + base * PARAM_BYTES[layout.base_dtype]


def step_time(model: ModelConfig, layout: Layout, hardware: Hardware) -> TimeEstimate:
    breakdown = dict.fromkeys(TIME_KEYS, 0.0)
    m = layout.grad_accum
    worst = None
    for pp_rank in sorted({0, layout.pp - 1} | ({layout.pp // 2} if layout.pp > 2 else set())):
        params = rank_params(model, layout, pp_rank)
        compute, recompute, _ = micro_batch_compute(model, layout, hardware, params.layers, params.has_last)
        compute += weight_traffic_bytes(params, layout) / hardware.memory_bandwidth
        matmul_s = blocks_matmul_seconds(model, layout, hardware, params.layers) if "tp" in layout.overlaps else 0.0
        tp = tp_time(model, layout, hardware, len(params.layers), params.has_last, matmul_s)
        cp = cp_time(model, layout, hardware, len(params.layers))
        ep = ep_time(model, layout, hardware, params.layers)
        per_mb = compute + recompute + tp + cp + ep
        if worst is None or per_mb > worst[0]:
            worst = (per_mb, params, compute, recompute, tp, cp, ep)
    per_mb, params, compute, recompute, tp, cp, ep = worst
    breakdown.update(compute=m * compute, recompute=m * recompute, tp_comm=m * tp, cp_comm=m * cp, ep_comm=m * ep)
    breakdown["pipeline_bubble"] = bubble_fraction(layout) * per_mb
    if layout.pp > 1:
        transfer = pp_transfer_time(model, layout, hardware, compute + recompute)
        breakdown["pp_comm"] = 2 * m * layout.virtual_stages * transfer
    total, hidden = dp_time(params, layout, hardware, compute + recompute)
    breakdown["dp_comm"] = total - hidden
    breakdown["dp_comm_overlapped"] = hidden
    dense_shards = layout.dp // layout.dp_replicate * layout.cp if layout.zero >= 1 else 1
    optimizer_bytes = trainable_params_of(params, layout) / dense_shards * OPTIMIZER_BYTES_PER_PARAM
    breakdown["optimizer"] = optimizer_bytes / hardware.memory_bandwidth
    return TimeEstimate(breakdown=breakdown)
