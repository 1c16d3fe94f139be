"""`shardwise quantize`: a run directory whose checkpoint holds weight-only quantized linears
(`generation/quantize.py`), which `generate`, `serve` and `predict` load as they load any run.

The new run's config.json is the source's with checkpoint.quantization (and, for int4,
checkpoint.quantization_group_size) set; its tokenizer and chat template are copied; its one
checkpoint (step 0, weights only) holds the codes, scales and zero points. The directory is written
beside --out under a temporary name and renamed into place once whole.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from shardwise.checkpoint.store import MODEL_PREFIX, save_checkpoint, write_json_atomic
from shardwise.generation.quantize import check_scheme, choose_group_size, quantize_model
from shardwise.infer.chat import TEMPLATE_FILES
from shardwise.infer.load import check_quantize_flag, load_run, read_run_config
from shardwise.models.build import build_on_meta
from shardwise.models.families import spec_of


def check_quantize_request(run_dir: Path, scheme: str, group_size: int | None, out: Path) -> int:
    """Every flag of `shardwise quantize`, before any work: the group size to use (0 for int8)."""
    check_scheme(scheme, "--scheme")
    if group_size is not None and scheme != "int4":
        raise ValueError(f"--group-size = {group_size} is invalid with --scheme {scheme}: only int4 groups its "
                         "scales; leave --group-size out")
    cfg = read_run_config(run_dir)
    if cfg.checkpoint.quantization:
        raise ValueError(f"--run {str(run_dir)!r} is invalid: it is already quantized "
                         f"({cfg.checkpoint.quantization}); quantize the float run it came from")
    spec = spec_of(cfg.model.family)
    if not spec.generates_text:
        raise ValueError(f"--run {str(run_dir)!r} is invalid: it is a {spec.name} model, and quantization is for "
                         "text generation (generate, serve); pass a decoder's run")
    if out.exists():
        raise ValueError(f"--out {str(out)!r} is invalid: it exists; choose a new directory")
    return choose_group_size(build_on_meta(cfg.model), scheme, group_size)


def write_quantized_run(run_dir: Path, scheme: str, out: Path, *, group_size: int | None = None,
                        checkpoint: Path | None = None) -> Path:
    run_dir, out = Path(run_dir), Path(out)
    group_size = check_quantize_request(run_dir, scheme, group_size, out)
    cfg, model, _ = load_run(run_dir, device="cpu", checkpoint=checkpoint)  # a LoRA run's adapters merged
    quantize_model(model, scheme, group_size or None)
    cfg.checkpoint.quantization, cfg.checkpoint.quantization_group_size = scheme, group_size
    cfg.run.dir = str(out)
    partial = out.with_name(f".{out.name}.partial-{os.getpid()}")
    try:
        partial.mkdir(parents=True)
        for name in ("tokenizer.json", *TEMPLATE_FILES):
            if (run_dir / name).is_file():
                shutil.copyfile(run_dir / name, partial / name)
        write_json_atomic(partial / "config.json", cfg.to_dict())
        weights = {f"{MODEL_PREFIX}{name}": value for name, value in model.state_dict().items()}
        save_checkpoint(partial, 0, tensors=weights, state={"loader": None}, keep=1)
        os.rename(partial, out)
    finally:
        shutil.rmtree(partial, ignore_errors=True)
    return out


def check_quantize_at_load(args) -> None:
    """`generate`/`serve --quantize`, before any rank starts: the scheme, a float run, and an int4 group
    size that divides every linear's whole width (each rank checks its share again)."""
    if not args.quantize and args.group_size is None:
        return
    cfg = read_run_config(Path(args.run))
    check_quantize_flag(args.quantize, args.group_size, cfg, args.run)
    choose_group_size(build_on_meta(cfg.model), args.quantize, args.group_size)
