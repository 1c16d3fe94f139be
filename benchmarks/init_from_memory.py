"""Peak memory per rank while a laid-out model loads train.init_from, against the model's size.

    python benchmarks/init_from_memory.py [--dim 768] [--layers 8] [--vocab 32000] [--out FILE]

Writes a random Llama of a few hundred MB (fp32) with `transformers`' save_pretrained, then on fresh
gloo ranks (one pool per world size) lays it out (one process, dp2 ZeRO-3, tp2, pp2), and around
`load_pretrained` alone measures each rank's resident set: the rise of its peak (VmHWM, reset through
/proc/self/clear_refs just before) over what it held before, file pages mapped by safetensors
included, and of its anonymous memory alone (sampled), besides the bytes it read and its share of the
parameters (allocated by `parallelize`, before the load). The baseline is a rank that materialises the
whole checkpoint: the family adapter's `model_from_hf` (as `convert --from-hf` reads), measured the same
way in a fresh process. (A safetensors slice is a view of the file's mapping until it is copied into
the rank's parameter: the load's anonymous memory hardly rises, the pages it reads show as the file's.)
Prints one JSON object (Linux only: /proc).
"""

from __future__ import annotations

import argparse
import ctypes
import datetime
import gc
import json
import platform
import subprocess
import tempfile
import threading
import time
from pathlib import Path

import torch

from shardwise.config.loader import load_config
from shardwise.runtime.worker_pool import WorkerPool

LAYOUTS = {"one process": (1, {}), "dp2-zero3": (2, {"zero": 3}), "tp2": (2, {"tp": 2}), "pp2": (2, {"pp": 2})}
MIB = 2**20


def status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1])
    raise KeyError(field)


class PeakMemory:
    """Around a block: the rise of the resident set's peak over its level at entry (`rss_rise`, bytes: VmHWM,
    reset through /proc/self/clear_refs, so file pages safetensors maps count too) and of anonymous memory
    alone (`anon_rise`: RssAnon sampled every `interval_s` by a thread; tensors, not the page cache)."""

    def __init__(self, interval_s: float = 0.0005):
        self.interval_s, self.done = interval_s, threading.Event()

    def __enter__(self) -> PeakMemory:
        gc.collect()
        # Freed memory glibc still holds would be reused unseen: hand it back, so what the block allocates shows.
        ctypes.CDLL("libc.so.6").malloc_trim(0)
        Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS
        self.rss_before, self.anon_before = status_kib("VmRSS"), status_kib("RssAnon")
        self.anon_peak = self.anon_before
        self.sampler = threading.Thread(target=self.sample, daemon=True)
        self.sampler.start()
        return self

    def sample(self) -> None:
        while not self.done.wait(self.interval_s):
            self.anon_peak = max(self.anon_peak, status_kib("RssAnon"))

    def __exit__(self, *exc) -> None:
        self.done.set()
        self.sampler.join()
        self.anon_peak = max(self.anon_peak, status_kib("RssAnon"))
        self.rss_rise = (status_kib("VmHWM") - self.rss_before) * 1024
        self.anon_rise = (self.anon_peak - self.anon_before) * 1024

    def figures(self) -> dict:
        return {"peak_rss_rise_mib": round(self.rss_rise / MIB, 1), "peak_anon_rise_mib": round(self.anon_rise / MIB, 1)}


def write_model(directory: Path, args) -> int:
    """A random Llama saved by transformers (fp32) and a small tokenizer; returns the weights' bytes."""
    import transformers

    from shardwise.data.tokenizer import save_tokenizer, train_tokenizer

    config = transformers.LlamaConfig(vocab_size=args.vocab, hidden_size=args.dim, intermediate_size=args.dim * 8 // 3,
                                      num_hidden_layers=args.layers, num_attention_heads=args.dim // 64,
                                      num_key_value_heads=args.dim // 64 // 2, max_position_embeddings=256,
                                      tie_word_embeddings=False)
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).save_pretrained(directory)
    save_tokenizer(train_tokenizer(["def f(x):\n    return x\n"] * 8, 300), directory / "tokenizer.json")
    return sum(path.stat().st_size for path in directory.glob("*.safetensors"))


def overrides_of(hf_dir: Path, parallel: dict) -> dict:
    return {"train.init_from": str(hf_dir), "train.seq_len": 32, "train.device": "cpu",
            "train.global_batch_size": 4, "train.micro_batch_size": 2,
            **{f"parallel.{key}": value for key, value in parallel.items()}}


def load_job(overrides: dict) -> dict:
    """On each rank: lay the model out, then load the source, measured."""
    import torch.distributed as dist

    from shardwise.checkpoint.init_from import base_tensors, load_pretrained, local_of
    from shardwise.distributed.dims import ParallelDims
    from shardwise.distributed.parallelize import parallelize_config

    cfg = load_config(overrides=overrides)
    world = dist.get_world_size() if dist.is_initialized() else 1
    pm = parallelize_config(cfg, ParallelDims.from_config(cfg.parallel, world), device=torch.device("cpu"))
    started = time.perf_counter()
    with PeakMemory() as peak:
        read = load_pretrained(pm, cfg)
    return {**peak.figures(), "read_mib": round(read / MIB, 1),
            "share_mib": round(sum(local_of(t).nbytes for t in base_tensors(pm.model).values()) / MIB, 1),
            "load_s": round(time.perf_counter() - started, 2)}


def whole_checkpoint_job(hf_dir: str) -> dict:
    """What a rank that materialises the whole checkpoint pays: the family adapter's `model_from_hf` (the
    whole-checkpoint import `convert --from-hf` does, into a model of its own)."""
    from shardwise.models.llama.hf_adapter import model_from_hf

    with PeakMemory() as peak:
        model = model_from_hf(hf_dir)
    return {**peak.figures(), "held_mib": round(sum(p.nbytes for p in model.parameters()) / MIB, 1)}


def machine() -> str:
    names = [line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
             if line.startswith("model name")]
    return f"{len(names)}-core {names[0] if names else platform.machine()}, torch {torch.__version__}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dim", type=int, default=768)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--out", help="also write the JSON here")
    args = parser.parse_args()

    with tempfile.TemporaryDirectory(prefix="init-from-memory-") as folder:
        hf_dir = Path(folder) / "hf"
        model_bytes = write_model(hf_dir, args)
        results = {}
        with WorkerPool(1) as pool:
            results["whole checkpoint, one process"] = pool.run(whole_checkpoint_job, str(hf_dir))
            results["one process"] = pool.run(load_job, overrides_of(hf_dir, {}))
        with WorkerPool(2) as pool:
            for name, (_, parallel) in LAYOUTS.items():
                if name != "one process":
                    results[name] = pool.run(load_job, overrides_of(hf_dir, parallel))
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    report = {"model_mib": round(model_bytes / MIB, 1), "shape": vars(args) | {"out": None}, "per_rank": results,
              "date": datetime.date.today().isoformat(), "commit": commit, "machine": machine()}
    text = json.dumps(report, indent=2)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")


if __name__ == "__main__":
    main()
