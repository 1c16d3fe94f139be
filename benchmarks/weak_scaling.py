"""The planner's weak scaling against published runs: per-GPU throughput as the GPU count grows.

    python benchmarks/weak_scaling.py [--markdown]

Each point is a published measurement: a model shape, a layout, a GPU count, the hardware and the
global batch, with the per-GPU throughput (tokens/s or TFLOP/s) its authors report. The estimator
gets the shape, the layout and the hardware preset (nothing measured) and predicts tokens/s per
GPU and MFU; the script prints, per series, each point's predicted and published figure and the
fraction of the smallest point's per-GPU throughput that each point keeps. Prints JSON (or, with
--markdown, the tables of docs/planning.md).

Published figures, copied as data (a table or a chart's values), with their sources:

- torchtitan_llama3_8b_fsdp: pytorch/torchtitan, benchmarks/llama3_h100_202412_torchtitan.md,
  tables 1 and 3 (December 2024). Llama 3.1 8B, FSDP (1D), local batch 2 of 8,192 tokens,
  selective activation checkpointing, on 8 and 128 H100s (96 GB HBM2e, 2.4 TB/s, 500 W; 400 Gb/s
  RDMA per GPU): 5,762 -> 5,605 tokens/s/GPU eager (97.3% kept), 6,667 -> 6,514 compiled (97.7%),
  8,532 -> 8,380 with Float8 (98.2%). The eager figures are the points; the others are given too.
- llama3_405b: the Llama 3 paper (Dubey et al. 2024, "The Llama 3 Herd of Models", table 4): 405B
  on 8,192 GPUs (TP 8, PP 16, DP 64) and 16,384 GPUs (DP 128) at 8K tokens, 16M tokens per batch
  both times, 430 and 400 TFLOP/s per GPU (93%). The layouts are benchmarks/published.py's.
- playbook_dp_1p34b: the Ultra-Scale Playbook (nanotron, 2025), "Data parallelism", the chart
  dp_scaling.html: the 1.34B model (hidden 2048, 16 layers, vocabulary 131,072, tied) with data
  parallelism only (ZeRO-0) on 8 to 256 H100s, 1M tokens per step: 40,150 -> 15,700 tokens/s/GPU
  (77.5% kept at 64 GPUs, 39.1% at 256). Each bar is a run of ../shared/data/playbook_runs.csv (the
  fastest ZeRO-0 run of that GPU count); its micro-batch and accumulation are that run's.
- megatron_gpt: NVIDIA/Megatron-LM README, "Performance Benchmarking", images/model_table.png:
  GPT models of 1.7B to 462B parameters on 48 to 6,144 H100s, DP 48 throughout, vocabulary 131,072,
  sequence 4,096, with TP/DP/PP communication overlap (--tp-comm-overlap, --overlap-grad-reduce,
  --overlap-param-gather); per-GPU TFLOP/s and MFU (41-49%). Megatron's FLOP count (72 b s l h^2
  (1 + s/6h + V/12hl)) is the estimator's MFU convention (6N + 12 L d s, the head included).

Assumptions the sources leave open, stated here and in each point's `assumed`: Megatron's GPT
blocks are GPT-2's (LayerNorm, GELU MLP of 4h, learned positions, untied embeddings: the
parameter counts of the table), micro-batch 1, the distributed optimizer (ZeRO-1), sequence
parallelism with tp, gradients reduced in fp32 (Megatron's default with bf16), and the interleaved
1F1B schedule with 2 stages per rank where pp > 1 (the schedule whose p2p overlap Megatron enables
by default); selective recomputation where the layout does not fit without it.

Each framework's overlaps are the layout's `comm_overlap` (planner/layout.py): Megatron-Core's rows
"tp,p2p,dp", Llama 3's "p2p,dp" (no tensor-parallel overlap is claimed), torchtitan's FSDP and the
playbook's DDP none (ZeRO-3's prefetch and DDP's overlapped all-reduce are modelled as they are).
A row also gives the planner's compute-only ceiling for the layout and, where it overlaps, the
prediction without the overlap (as shardwise's runtime would run it).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.published import llama3_runs  # noqa: E402
from shardwise.config.presets import model_config  # noqa: E402
from shardwise.core.model import ModelConfig  # noqa: E402
from shardwise.models.families import validate_model  # noqa: E402
from shardwise.planner.estimate import Estimate, estimate  # noqa: E402
from shardwise.planner.hardware import Hardware, hardware_from_dict, preset  # noqa: E402
from shardwise.planner.layout import Layout  # noqa: E402
from shardwise.planner.search import fits_with_headroom  # noqa: E402

GRAND_TETON_H100 = {"base": "h100-80gb", "name": "h100-96gb-hbm2e", "memory_bytes": 96e9, "memory_bandwidth": 2.4e12}
"""torchtitan's machines: H100 with 96 GB of HBM2e at 2.4 TB/s (the preset's peak and links)."""

TORCHTITAN_8B = [  # GPUs, tokens/s/GPU eager, compiled, compiled + Float8
    (8, 5762, 6667, 8532), (128, 5605, 6514, 8380)]
LLAMA3_405B_TFLOPS = {8192: 430.0, 16384: 400.0}
PLAYBOOK_DP = [  # GPUs, micro-batch, accumulation (the fastest ZeRO-0 run), tokens/s/GPU
    (8, 2, 16, 40149.94), (16, 1, 16, 37609.69), (32, 1, 8, 35367.61), (64, 1, 4, 31112.23),
    (128, 2, 1, 26446.44), (256, 1, 1, 15700.38)]
MEGATRON_OVERLAP = "tp,p2p,dp"
"""--tp-comm-overlap, the interleaved schedule's p2p overlap, --overlap-grad-reduce and --overlap-param-gather
(`Layout.comm_overlap`)."""
LLAMA3_OVERLAP = "p2p,dp"
"""The Llama 3 paper's asynchronous point-to-point transfers in the pipeline (section 3.3.2) and its FSDP's
prefetched parameter gathers; no tensor-parallel overlap is claimed there, so none is assumed."""
MEGATRON_GPT = [  # name, heads, hidden, layers, tp, pp, dp, batch (sequences), TFLOP/s per GPU, MFU %
    ("1.7B", 16, 2048, 24, 1, 1, 48, 192, 408.8, 41), ("7.1B", 32, 4096, 30, 2, 1, 48, 192, 465.9, 47),
    ("16B", 48, 6144, 32, 4, 1, 48, 192, 489.1, 49), ("32B", 56, 7168, 48, 8, 1, 48, 192, 459.6, 46),
    ("70B", 64, 8192, 84, 8, 2, 48, 384, 419.7, 42), ("119B", 80, 10240, 92, 8, 4, 48, 768, 420.5, 43),
    ("177B", 96, 12288, 96, 8, 6, 48, 1152, 432.8, 44), ("314B", 128, 16384, 96, 8, 8, 48, 1536, 474.4, 48),
    ("462B", 144, 18432, 112, 8, 16, 48, 3072, 459.9, 47)]
SOURCES = {
    "torchtitan_llama3_8b_fsdp": "pytorch/torchtitan benchmarks/llama3_h100_202412_torchtitan.md, tables 1 and 3",
    "llama3_405b": "Dubey et al. 2024, The Llama 3 Herd of Models, table 4",
    "playbook_dp_1p34b": "Ultra-Scale Playbook (nanotron 2025), Data parallelism, dp_scaling.html",
    "megatron_gpt": "NVIDIA/Megatron-LM README, Performance Benchmarking, images/model_table.png",
}


@dataclass
class Point:
    label: str
    gpus: int
    model: ModelConfig
    layout: Layout
    hardware: Hardware
    published: dict
    """The published figures: tokens_per_s_per_gpu and/or tflops_per_gpu, mfu."""
    assumed: str = ""
    extra: dict = field(default_factory=dict)


def torchtitan_points() -> list[Point]:
    hardware = hardware_from_dict(GRAND_TETON_H100)
    points = []
    for gpus, eager, compiled, float8 in TORCHTITAN_8B:
        layout = Layout(dp=gpus, zero=3, micro_batch=2, grad_accum=1, seq_len=8192, recompute="selective",
                        dtype="bf16", grad_accum_dtype="fp32").validate()
        points.append(Point(f"Llama 3.1 8B FSDP x{gpus}", gpus, model_config("llama3-8b"), layout, hardware,
                            {"tokens_per_s_per_gpu": eager},
                            assumed="bf16 all-gathers, fp32 reduce-scatters (torchtitan's mixed precision)",
                            extra={"published_compiled": compiled, "published_float8": float8}))
    return points


def llama3_points() -> list[Point]:
    """benchmarks/published.py's Llama 3 runs at 8K tokens (the 128K one changes the sequence, not the scale)."""
    hardware = preset("h100-80gb")
    points = []
    for label, result, _, _ in llama3_runs(hardware):
        layout = result.layout
        tflops = LLAMA3_405B_TFLOPS.get(layout.world_size)
        if tflops is None or layout.cp > 1:
            continue
        layout = dataclasses.replace(layout, comm_overlap=LLAMA3_OVERLAP).validate()
        points.append(Point(f"Llama 3 405B x{layout.world_size}", layout.world_size, result.model, layout, hardware,
                            {"tflops_per_gpu": tflops, "mfu": tflops * 1e12 / hardware.peak_flops_bf16},
                            assumed="interleaved 1F1B, 2 stages per rank, micro-batch 1, ZeRO-1 (published.py); "
                                    f"comm_overlap {LLAMA3_OVERLAP}"))
    return points


def playbook_model() -> ModelConfig:
    return validate_model(ModelConfig(dim=2048, n_layers=16, n_heads=32, n_kv_heads=32, ffn_dim=8192,
                                      vocab_size=131072, tie_embeddings=True))


def playbook_points() -> list[Point]:
    hardware = preset("h100-80gb")
    points = []
    for gpus, micro_batch, accum, tokens in PLAYBOOK_DP:
        layout = Layout(dp=gpus, zero=0, micro_batch=micro_batch, grad_accum=accum, seq_len=4096, dtype="bf16",
                        grad_accum_dtype="fp32").validate()
        points.append(Point(f"1.34B DP x{gpus}", gpus, playbook_model(), layout, hardware,
                            {"tokens_per_s_per_gpu": tokens}))
    return points


def megatron_model(heads: int, hidden: int, layers: int) -> ModelConfig:
    return validate_model(ModelConfig(family="gpt2", dim=hidden, n_layers=layers, n_heads=heads, n_kv_heads=heads,
                                      ffn_dim=4 * hidden, vocab_size=131072, max_seq_len=4096, tie_embeddings=False))


def megatron_layout(tp: int, pp: int, dp: int, batch: int, recompute: str) -> Layout:
    schedule = dict(pp_schedule="interleaved-1f1b", virtual_stages=2) if pp > 1 else {}
    return Layout(dp=dp, tp=tp, pp=pp, zero=1, sp=tp > 1, micro_batch=1, grad_accum=batch // dp, seq_len=4096,
                  dtype="bf16", grad_accum_dtype="fp32", recompute=recompute, comm_overlap=MEGATRON_OVERLAP,
                  **schedule).validate()


def megatron_points() -> list[Point]:
    hardware = preset("h100-80gb")
    points = []
    for name, heads, hidden, layers, tp, pp, dp, batch, tflops, mfu in MEGATRON_GPT:
        model = megatron_model(heads, hidden, layers)
        layout = megatron_layout(tp, pp, dp, batch, "none")
        if not fits_with_headroom(estimate(model, layout, hardware)):
            layout = megatron_layout(tp, pp, dp, batch, "selective")
        points.append(Point(f"GPT {name} tp{tp} pp{pp} dp{dp}", tp * pp * dp, model, layout, hardware,
                            {"tflops_per_gpu": tflops, "mfu": mfu / 100},
                            assumed=f"GPT-2 blocks, micro-batch 1, ZeRO-1, {layout.describe()}"))
    return points


SERIES = {"torchtitan_llama3_8b_fsdp": torchtitan_points, "llama3_405b": llama3_points,
          "playbook_dp_1p34b": playbook_points, "megatron_gpt": megatron_points}


def published_per_gpu(figures: dict) -> float:
    """The published per-GPU throughput: tokens/s, or model TFLOP/s."""
    if "tokens_per_s_per_gpu" in figures:
        return figures["tokens_per_s_per_gpu"]
    return figures["tflops_per_gpu"]


def predicted_per_gpu(point: Point, result: Estimate) -> float:
    """The predicted per-GPU throughput in the published figure's unit."""
    if "tokens_per_s_per_gpu" in point.published:
        return result.tokens_per_s_per_device
    return result.mfu * point.hardware.peak_flops(point.layout.matmul_dtype) / 1e12


def point_row(point: Point, first: tuple[float, float] | None) -> dict:
    result = estimate(point.model, point.layout, point.hardware)
    published, predicted = published_per_gpu(point.published), predicted_per_gpu(point, result)
    row = {"point": point.label, "gpus": point.gpus, "layout": point.layout.describe(),
           "unit": "tokens/s/GPU" if "tokens_per_s_per_gpu" in point.published else "TFLOP/s/GPU",
           "published": published, "predicted": predicted, "predicted_over_published": predicted / published,
           "predicted_mfu": result.mfu, "published_mfu": point.published.get("mfu"), "fits": result.fits,
           "step_time_s": result.step_time_s, "time_s": {k: round(v, 4) for k, v in result.time.breakdown.items()},
           **point.extra}
    # the planner's ceiling for the layout: its compute alone, every transfer and the bubble hidden
    compute_only = sum(result.time.breakdown[key] for key in ("compute", "recompute", "optimizer"))
    row["predicted_compute_only"] = predicted * result.step_time_s / compute_only
    if point.layout.overlaps:  # what the same layout would do without the other runtime's overlap
        alone = estimate(point.model, dataclasses.replace(point.layout, comm_overlap=""), point.hardware)
        row["predicted_without_overlap"] = predicted_per_gpu(point, alone)
    if point.assumed:
        row["assumed"] = point.assumed
    if first is not None:
        row["published_kept"] = published / first[0]
        row["predicted_kept"] = predicted / first[1]
    return row


def series_rows(points: list[Point], weak: bool) -> list[dict]:
    rows = []
    for point in points:
        first = (rows[0]["published"], rows[0]["predicted"]) if weak and rows else None
        row = point_row(point, first)
        if weak and not rows:
            row["published_kept"] = row["predicted_kept"] = 1.0
        rows.append(row)
    return rows


def report() -> dict:
    return {name: {"source": SOURCES[name], "points": series_rows(build(), weak=name != "megatron_gpt")}
            for name, build in SERIES.items()}


def markdown(result: dict) -> str:
    """The docs' tables: per point, published and predicted per-GPU throughput; a weak-scaling series
    adds the fraction of the smallest point's kept, a model series the planner's compute-only ceiling
    and the prediction without the other runtime's overlap."""
    lines = []
    for name, part in result.items():
        weak = "published_kept" in part["points"][0]
        tail = ("kept, published | kept, predicted | gap in kept |" if weak
                else "MFU published / predicted | compute-only ceiling | without overlap |")
        lines += [f"{name} ({part['source']}):", "", "| point | layout | unit | published | predicted | gap | " + tail,
                  "|---|---|---|---|---|---|---|---|---|"]
        for r in part["points"]:
            cells = [r["point"], r["layout"], r["unit"], f"{r['published']:,.1f}", f"{r['predicted']:,.1f}",
                     f"{r['predicted_over_published'] - 1:+.0%}"]
            if weak:
                cells += [f"{r['published_kept']:.1%}", f"{r['predicted_kept']:.1%}",
                          f"{r['predicted_kept'] / r['published_kept'] - 1:+.1%}"]
            else:
                cells += [f"{r['published_mfu']:.0%} / {r['predicted_mfu']:.1%}", f"{r['predicted_compute_only']:,.1f}",
                          f"{r.get('predicted_without_overlap', r['predicted']):,.1f}"]
            lines.append("| " + " | ".join(cells) + " |")
        lines.append("")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--markdown", action="store_true", help="print the docs' tables instead of JSON")
    args = parser.parse_args()
    result = report()
    print(markdown(result) if args.markdown else json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
