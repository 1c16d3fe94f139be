"""`shardwise export`: a trained run as a directory that runs without shardwise.

    DIR/model.pt2        AOTInductor package of two programs, prefill and decode (export_programs.py)
    DIR/tokenizer.json   the run's tokenizer
    DIR/manifest.json    what a runner needs: shapes, dtype, end-of-text id, vocabulary, max_seq_len
    DIR/<chat template>  tokenizer_config.json / chat_template.jinja, where the run has one

`examples/run_exported.py` (torch and tokenizers only) generates from DIR. A LoRA run is exported
with its adapters folded in (`load_run` merges them). The directory is built beside DIR under a
temporary name and renamed into place once whole: a failed export leaves nothing.

Decoders export (llama, mistral, qwen, mixtral-style MoE, gpt2). Refused, by their family's traits:
encoder-decoders (T5: the decoder's cross-attention reads the encoder's output, which these two
programs do not carry), encoders (BERT: masked-LM, no next token to generate) and image models (ViT).
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

import torch

from shardwise.core.family import FamilySpec
from shardwise.data.chat_template import TEMPLATE_FILES
from shardwise.data.tokenizer import eos_id
from shardwise.infer.export_programs import PROGRAM_NAMES, compile_package, export_programs, signature
from shardwise.infer.load import load_run, read_run_config
from shardwise.models.families import spec_of

PACKAGE_FILE = "model.pt2"
MANIFEST_FILE = "manifest.json"
TOKENIZER_FILE = "tokenizer.json"
FORMAT_VERSION = 1


def unexportable_reason(spec: FamilySpec) -> str | None:
    """Why a family's models cannot be exported as prefill and decode programs (None: they can)."""
    if spec.image_input:
        return "it classifies images and generates no tokens (run it with `shardwise predict`)"
    if spec.encoder_decoder:
        return ("its decoder also attends to the encoder's output (cross-attention), which the package's "
                "decoder-only prefill and decode programs do not carry")
    if spec.objective != "causal_lm":
        return f"it is an encoder ({spec.objective}) and generates no next token (run it with `shardwise predict`)"
    return None


def check_export(run_dir: Path, out: Path) -> None:
    """Everything that can be refused before any work: --out, the run, its family."""
    if out.exists():
        raise ValueError(f"--out {str(out)!r} already exists; choose a new directory (export never overwrites)")
    spec = spec_of(read_run_config(run_dir).model.family)
    reason = unexportable_reason(spec)
    if reason:
        raise ValueError(f"--run {str(run_dir)!r} is a {spec.name} model, which cannot be exported: {reason}; "
                         "export a decoder run (llama, mistral, qwen, mixtral, gpt2)")


def export_run(run_dir: Path, out: Path, *, checkpoint: Path | None = None) -> dict:
    """Write DIR (see the module docstring); returns its manifest."""
    run_dir, out = Path(run_dir), Path(out)
    check_export(run_dir, out)
    cfg, model, tokenizer = load_run(run_dir, device="cpu", checkpoint=checkpoint)  # refuses a run with no checkpoint
    manifest = manifest_of(cfg, model, eos_id(tokenizer))
    created = missing_parents(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".tmp", dir=out.parent))
    try:
        compile_package(export_programs(model), staging / PACKAGE_FILE)
        shutil.copyfile(run_dir / TOKENIZER_FILE, staging / TOKENIZER_FILE)
        manifest["chat_template_files"] = [name for name in TEMPLATE_FILES if (run_dir / name).is_file()]
        for name in manifest["chat_template_files"]:
            shutil.copyfile(run_dir / name, staging / name)
        (staging / MANIFEST_FILE).write_text(json.dumps(manifest, indent=2) + "\n")
        staging.chmod(0o755)  # mkdtemp makes it private; an export is meant to be shipped and read
        os.rename(staging, out)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        for parent in created:  # deepest first; only those this export made, and only while empty
            if parent.is_dir() and not any(parent.iterdir()):
                parent.rmdir()
        raise
    return manifest


def missing_parents(out: Path) -> list[Path]:
    """The parent directories of `out` that do not exist yet, deepest first."""
    return [parent for parent in out.absolute().parents if not parent.exists()]


def manifest_of(cfg, model, end_of_text: int) -> dict:
    weight = next(model.parameters())
    return {
        "format_version": FORMAT_VERSION,
        "model_name": cfg.run.name,
        "family": cfg.model.family,
        "package": PACKAGE_FILE,
        "programs": list(PROGRAM_NAMES),
        "signature": signature(),
        "dtype": str(weight.dtype).removeprefix("torch."),
        "device": weight.device.type,
        "vocab_size": cfg.model.vocab_size,
        "max_seq_len": cfg.model.max_seq_len,
        "num_layers": cfg.model.n_layers,
        "num_kv_heads": cfg.model.n_kv_heads,
        "head_dim": cfg.model.head_size,
        "sliding_window": cfg.model.sliding_window,
        "eos_id": end_of_text,
        "tokenizer": TOKENIZER_FILE,
        "encode_special_tokens": True,  # as shardwise loads its tokenizers (tokenizer.json does not store it)
        "padding": "left",
        "torch_version": torch.__version__,
    }
