"""The estimator against published training throughput that is not in this repository.

    python benchmarks/published.py [--json]

Each run below is a published measurement: a model shape, a layout, the hardware and the MFU
the authors report. The estimator gets the shape, the layout and the hardware preset (nothing
measured) and predicts MFU; the script prints predicted vs published for each run and, per
source, the median |predicted - published| / published and the Spearman rank correlation.

Sources, copied as figures (a paper's table), not as code:

- MosaicML llm-foundry, scripts/train/benchmarking/README.md, "H100 80GB BF16" table: MPT
  models (GPT blocks: GELU MLP of 4 x d, learned positions or ALiBi, tied embeddings, vocab
  50,368) trained with FSDP FULL_SHARD (ZeRO-3 over all GPUs), bf16 autocast, with or without
  activation checkpointing, on 8-64 H100s. MFU there is (6N + 12 L d s) x tokens/s / peak, the
  convention of `Estimate.mfu`. A 2-matrix GELU MLP of width 4d has the FLOPs and parameters of
  a SwiGLU MLP of width 8d/3, which is how the shape is given to the estimator.
- The Llama 3 paper (Dubey et al. 2024, table 4; Balaji, SC'24): Llama 3 405B on 8,192 and
  16,384 H100s, TP 8 x PP 16 x DP 64/128 at 8K tokens, and TP 8 x CP 16 x PP 16 x DP 8 at 128K;
  16M tokens per batch; 430, 400 and 380 TFLOP/s per GPU (43%, 41%, 38% of 989). The paper's
  schedule is an interleaved 1F1B tuned by hand; the estimator is given interleaved-1f1b with
  2 virtual stages, micro-batch 1 and ZeRO-1 (its FSDP keeps parameters gathered between
  forward and backward, which ZeRO-1 models) - assumptions, stated here and in the output.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.playbook import spearman  # noqa: E402
from shardwise.planner.estimate import estimate  # noqa: E402
from shardwise.planner.hardware import preset  # noqa: E402
from shardwise.planner.layout import Layout  # noqa: E402
from shardwise.config.presets import model_config  # noqa: E402
from shardwise.core.model import ModelConfig  # noqa: E402
from shardwise.models.families import validate_model  # noqa: E402

MPT_SHAPES = {  # name: (d_model, n_layers, n_heads)
    "760m": (1536, 24, 12), "1b": (2048, 24, 16), "3b": (2560, 32, 20), "7b": (4096, 32, 32),
    "13b": (5120, 40, 40), "30b": (7168, 48, 64), "70b": (8192, 80, 64),
}

MPT_H100_BF16 = [  # model, seq_len, GPUs, micro-batch, grad accum, activation checkpointing, MFU %
    ("70b", 2048, 64, 8, 4, True, 42.57), ("70b", 2048, 32, 2, 16, True, 36.15),
    ("30b", 8192, 8, 1, 21, True, 29.92), ("30b", 4096, 8, 1, 21, True, 35.86),
    ("30b", 2048, 32, 14, 3, True, 43.92), ("30b", 2048, 16, 10, 3, True, 43.07),
    ("30b", 2048, 8, 3, 21, True, 38.11), ("30b", 1024, 8, 6, 21, True, 38.76),
    ("13b", 16384, 8, 3, 3, True, 35.55), ("13b", 4096, 8, 10, 3, True, 41.6),
    ("13b", 2048, 64, 2, 1, False, 39.86), ("13b", 2048, 32, 2, 1, False, 39.95),
    ("13b", 2048, 16, 2, 1, False, 39.58), ("13b", 2048, 8, 2, 1, False, 39.79),
    ("13b", 1024, 8, 40, 3, True, 44.27),
    ("7b", 8192, 8, 8, 2, True, 37.14), ("7b", 4096, 8, 16, 2, True, 40.42),
    ("7b", 2048, 8, 6, 1, False, 46.44), ("7b", 1024, 8, 64, 2, True, 42.83),
    ("3b", 16384, 8, 1, 6, False, 36.34), ("3b", 8192, 8, 3, 6, False, 40.31),
    ("3b", 4096, 8, 5, 6, False, 42.31), ("3b", 2048, 64, 6, 3, False, 40.8),
    ("3b", 2048, 32, 6, 3, False, 41.7), ("3b", 2048, 16, 10, 3, False, 43.73),
    ("3b", 1024, 8, 20, 6, False, 46.2), ("3b", 512, 8, 40, 6, False, 46.32),
    ("1b", 16384, 8, 2, 4, False, 35.22), ("1b", 8192, 8, 3, 4, False, 37.73),
    ("1b", 4096, 8, 7, 4, False, 40.26), ("1b", 2048, 64, 20, 1, False, 40.85),
    ("1b", 2048, 32, 20, 1, False, 41.52), ("1b", 2048, 16, 20, 1, False, 42.36),
    ("1b", 2048, 8, 14, 1, False, 41.82), ("1b", 1024, 8, 18, 4, False, 41.95),
    ("1b", 512, 8, 56, 4, False, 43.21),
    ("760m", 16384, 8, 3, 2, False, 33.57), ("760m", 8192, 8, 6, 2, False, 34.84),
    ("760m", 4096, 8, 12, 2, False, 35.83), ("760m", 2048, 32, 24, 1, False, 37.57),
    ("760m", 2048, 16, 24, 1, False, 37.89), ("760m", 2048, 8, 24, 2, False, 34.9),
    ("760m", 1024, 8, 48, 2, False, 39.76), ("760m", 512, 8, 96, 2, False, 40.42),
]

LLAMA3_405B = model_config("llama3-405b")
LLAMA3_RUNS = [  # label, layout, published MFU % (TFLOP/s per GPU / 989)
    ("8,192 GPUs, TP8 PP16 DP64, 8K", dict(tp=8, pp=16, dp=64, cp=1, seq_len=8192, grad_accum=32), 43.0),
    ("16,384 GPUs, TP8 PP16 DP128, 8K", dict(tp=8, pp=16, dp=128, cp=1, seq_len=8192, grad_accum=16), 41.0),
    ("16,384 GPUs, TP8 CP16 PP16 DP8, 128K", dict(tp=8, pp=16, dp=8, cp=16, seq_len=131072, grad_accum=16), 38.0),
]


VARIANTS = {"chunked": "chunked loss", "compiled": "compiled blocks, chunked loss"}
"""The memory models reported beside the first (eager blocks, loss on full logits), by key."""


def mpt_shape(name: str) -> ModelConfig:
    dim, layers, heads = MPT_SHAPES[name]
    return validate_model(ModelConfig(dim=dim, n_layers=layers, n_heads=heads, n_kv_heads=heads, ffn_dim=8 * dim // 3,
                                      vocab_size=50368, tie_embeddings=True))


def mpt_runs(hardware):
    for name, seq, gpus, mbs, accum, checkpointing, mfu in MPT_H100_BF16:
        layout = Layout(dp=gpus, zero=3, micro_batch=mbs, grad_accum=accum, seq_len=seq, dtype="bf16",
                        grad_accum_dtype="fp32", recompute="full" if checkpointing else "none").validate()
        result = estimate(mpt_shape(name), layout, hardware)
        # MPT runs fused kernels (flash attention, fused cross-entropy): its blocks are closer to
        # shardwise's compiled blocks than to eager ones. Three memory models are reported: eager
        # blocks with the loss on full logits; shardwise's trainer by default (eager blocks, the
        # chunked loss: `train.chunked_loss`); and with `train.compile` too.
        variants = {"chunked": dict(chunked_loss=True), "compiled": dict(compile=True, chunked_loss=True)}
        others = {key: estimate(mpt_shape(name), dataclasses.replace(layout, **change), hardware)
                  for key, change in variants.items()}
        label = f"MPT-{name} seq {seq} x{gpus} mbs {mbs} ga {accum}{' ckpt' if checkpointing else ''}"
        yield label, result, mfu, others


def llama3_runs(hardware):
    for label, fields, mfu in LLAMA3_RUNS:
        layout = Layout(**fields, micro_batch=1, zero=1, sp=True, pp_schedule="interleaved-1f1b", virtual_stages=2,
                        dtype="bf16", grad_accum_dtype="fp32", recompute="none").validate()
        yield f"Llama 3 405B, {label}", estimate(LLAMA3_405B, layout, hardware), mfu, {}


def summarise(rows: list[dict]) -> dict:
    errors = [abs(r["predicted_mfu"] - r["published_mfu"]) / r["published_mfu"] for r in rows]
    summary = {"runs": len(rows), "median_abs_error": statistics.median(errors), "max_abs_error": max(errors),
               "mean_predicted_over_published": statistics.fmean(r["predicted_mfu"] / r["published_mfu"] for r in rows)}
    if len(rows) >= 3:
        summary["spearman"] = spearman([r["predicted_mfu"] for r in rows], [r["published_mfu"] for r in rows])
    return summary


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    args = parser.parse_args()
    hardware = preset("h100-80gb")
    report = {}
    for source, runs in (("mpt_h100_bf16", mpt_runs(hardware)), ("llama3_405b", llama3_runs(hardware))):
        rows = [{"run": label, "published_mfu": mfu / 100, "predicted_mfu": result.mfu, "fits": result.fits,
                 "peak_memory_gib": result.memory.peak / 2**30,
                 **{f"{field}_{key}": value for key, other in others.items()
                    for field, value in (("fits", other.fits), ("peak_memory_gib", other.memory.peak / 2**30))}}
                for label, result, mfu, others in runs]
        summary = summarise(rows)
        summary["predicted_to_fit"] = sum(r["fits"] for r in rows)
        for key in VARIANTS:
            if all(f"fits_{key}" in r for r in rows):
                summary[f"predicted_to_fit_{key}"] = sum(r[f"fits_{key}"] for r in rows)
        report[source] = {"summary": summary, "runs": rows}
    if args.json:
        print(json.dumps(report, indent=2))
        return
    for source, part in report.items():
        print(f"## {source}")
        shown = [key for key in VARIANTS if f"predicted_to_fit_{key}" in part["summary"]]
        print("| run | published MFU | predicted MFU | predicted / published | fits (peak GiB) |"
              + "".join(f" fits, {VARIANTS[key]} (peak GiB) |" for key in shown))
        print("|---|---|---|---|---|" + "---|" * len(shown))
        for r in part["runs"]:
            print(f"| {r['run']} | {r['published_mfu']:.1%} | {r['predicted_mfu']:.1%} | "
                  f"{r['predicted_mfu'] / r['published_mfu']:.2f} | {r['fits']} ({r['peak_memory_gib']:.1f}) |"
                  + "".join(f" {r[f'fits_{key}']} ({r[f'peak_memory_gib_{key}']:.1f}) |" for key in shown))
        print(json.dumps(part["summary"]))
        print()


if __name__ == "__main__":
    main()
