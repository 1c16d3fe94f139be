"""The exported package's decode speed vs the engine's, eager and compiled (issue 40, item 4).

    python benchmarks/export.py [--preset demo] [--new-tokens 128] [--repeats 3] [--machine NAME]

One model (the preset's shape, random weights with a large init so greedy answers vary), batch 1,
greedy, the same prompts one at a time: the engine as `shardwise generate` runs it (linear weights
transposed for CPU), eager and with `--compile`'s decode step, and the AOTInductor package that
`shardwise export` writes (export_programs + compile_package), driven by examples/run_exported.py's
own loop. Figures: new tokens / wall time (prefill included, the same prompts for all), the median
of --repeats passes timed alternately after a warm-up pass (which compiles). Whether the three give
the same tokens is printed too. Prints one JSON object.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import platform
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import torch

from shardwise.config.presets import model_config
from shardwise.generation.engine import engine_for_model, generate_all
from shardwise.generation.sampling import SamplingParams
from shardwise.infer.export_programs import compile_package, export_programs
from shardwise.models.build import build_on_meta

ROOT = Path(__file__).resolve().parents[1]
PROMPT_LENGTHS = (16, 40, 24, 64)


class TokenIds:
    """The engine's tokenizer, for ids that are never shown."""

    def decode(self, ids):
        return " ".join(map(str, ids))


def example_module():
    spec = importlib.util.spec_from_file_location("run_exported", ROOT / "examples" / "run_exported.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def exported_generator(model, work_dir: Path, new_tokens: int):
    """The package's greedy generation of one prompt, as examples/run_exported.py runs it."""
    from torch._inductor.package import load_package

    started = time.perf_counter()
    compile_package(export_programs(model), work_dir / "model.pt2")
    compile_s = time.perf_counter() - started
    prefill, decode = (load_package(str(work_dir / "model.pt2"), name) for name in ("prefill", "decode"))
    manifest = {"eos_id": -1, "max_seq_len": model.cfg.max_seq_len}  # no end-of-text: every answer is full
    generate = example_module().generate
    return (lambda ids: generate(manifest, prefill, decode, [ids], new_tokens)[0]), compile_s


def engine_generator(model, new_tokens: int, compile: bool):
    engine = engine_for_model(model, TokenIds(), eos_id=None, max_batch=1, compile=compile, owns_model=True)
    params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    return lambda ids: generate_all(engine, [ids], params)[0].output_ids


def timed_pass(generate, prompts) -> tuple[float, list[list[int]]]:
    started = time.perf_counter()
    outputs = [generate(ids) for ids in prompts]
    return time.perf_counter() - started, outputs


def git_commit() -> str:
    return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT).stdout.strip()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="demo")
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--machine", default=platform.node(), help="the machine's name in the figures")
    args = parser.parse_args()
    cfg = model_config(args.preset, init_std=0.2)
    model = build_on_meta(cfg)
    model.to_empty(device="cpu")
    model.init_weights(seed=1)
    model.eval()
    generator = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, cfg.vocab_size, (n,), generator=generator).tolist() for n in PROMPT_LENGTHS]
    with tempfile.TemporaryDirectory() as work_dir:
        exported, compile_s = exported_generator(model, Path(work_dir), args.new_tokens)  # before the engine
        # transposes the weights in place
        generators = {"engine_eager": engine_generator(model, args.new_tokens, compile=False),
                      "engine_compiled": engine_generator(model, args.new_tokens, compile=True),
                      "exported": exported}
        outputs = {name: timed_pass(generate, prompts)[1] for name, generate in generators.items()}  # warm-up
        seconds = {name: [] for name in generators}
        for _ in range(args.repeats):
            for name, generate in generators.items():
                seconds[name].append(timed_pass(generate, prompts)[0])
    total_tokens = args.new_tokens * len(prompts)
    tokens_per_s = {name: round(total_tokens / statistics.median(times), 1) for name, times in seconds.items()}
    print(json.dumps({
        "bench": "exported package vs engine, batch 1, greedy", "date": datetime.date.today().isoformat(),
        "commit": git_commit(), "machine": args.machine, "torch": torch.__version__,
        "threads": torch.get_num_threads(), "preset": args.preset, "prompt_lengths": PROMPT_LENGTHS,
        "new_tokens": args.new_tokens, "repeats": args.repeats, "aoti_compile_s": round(compile_s, 1),
        "tokens_per_s": tokens_per_s,
        "exported_vs_eager": round(tokens_per_s["exported"] / tokens_per_s["engine_eager"], 2),
        "exported_vs_compiled": round(tokens_per_s["exported"] / tokens_per_s["engine_compiled"], 2),
        "same_tokens": {name: outputs[name] == outputs["engine_eager"] for name in ("engine_compiled", "exported")},
    }, indent=2))


if __name__ == "__main__":
    main()
