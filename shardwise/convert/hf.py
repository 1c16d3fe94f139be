"""`shardwise convert`: a run directory <-> a Hugging Face `transformers` checkpoint.

An imported checkpoint becomes a run directory (config.json, tokenizer.json and a step-0
checkpoint), so `shardwise generate --run` serves it and `shardwise train --run.dir` fine-tunes
it, with no other conversion.

Each model family has its own HF adapter (its `family.py`'s `hf_adapter`): import picks the family
whose spec lists config.json's `model_type`, export the run's family, and the adapter checks `--arch`.

A LoRA run's checkpoints hold adapters beside the base its train.init_from names: `--merge` exports
the base with each adapter folded into its linear (W + (lora_alpha / lora_rank) B A, in fp32, as
`infer/load.py` loads the run to serve it); `--to-peft` (`peft.py`) exports the adapters alone.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

from shardwise.core.errors import invalid
from shardwise.config.schema import IMAGE_SOURCES, Config, DataConfig, RunConfig
from shardwise.infer.chat import TEMPLATE_FILES
from shardwise.infer.load import load_run, read_run_config
from shardwise.core.family import FamilySpec
from shardwise.core.model import ModelConfig
from shardwise.models.build import build_on_meta, torch_family, torch_family_of
from shardwise.models.families import SPECS, family_of_hf_type, spec_of
from shardwise.checkpoint.store import MODEL_PREFIX, save_checkpoint, write_json_atomic

def family_of_hf(hf_dir: Path) -> FamilySpec:
    """The model family whose adapter reads this checkpoint, by config.json's model_type."""
    try:
        model_type = json.loads((hf_dir / "config.json").read_text()).get("model_type")
    except (json.JSONDecodeError, AttributeError):
        return spec_of(ModelConfig().family)  # its adapter reports the unreadable config.json, with the reason
    spec = family_of_hf_type(model_type)
    if spec is None:
        known = ", ".join(name for spec in SPECS.values() for name in spec.hf_model_types)
        raise invalid("config.json model_type", model_type, f"use one of {known}")
    return spec


def copy_atomic(src: Path, dst: Path) -> None:
    tmp = dst.with_name(f".{dst.name}.tmp")
    shutil.copyfile(src, tmp)
    os.replace(tmp, dst)


def check_out_dir(out: Path, source: Path, *, importing: bool) -> None:
    """--out is a new directory (or an earlier export): never the input, a run directory, or, when importing,
    a directory with a config.json; writing there would replace a config and checkpoints."""
    if not out.exists():
        return
    clash = ("is the input directory" if out.resolve() == source.resolve() else
             "holds a run (checkpoints/)" if (out / "checkpoints").exists() else
             "holds a config.json" if importing and (out / "config.json").exists() else None)
    if clash:
        raise ValueError(f"--out {str(out)!r} is invalid: it {clash}, which this would overwrite; "
                         "choose a new directory")


def import_hf_to_run(hf_dir: Path, out: Path, *, tokenizer: Path | None = None) -> Path:
    if not hf_dir.is_dir():
        raise FileNotFoundError(f"--from-hf {str(hf_dir)!r} is not a directory; pass a Hugging Face checkpoint "
                                "directory (config.json, model.safetensors, tokenizer.json)")
    if not (hf_dir / "config.json").is_file():
        raise FileNotFoundError(f"--from-hf {str(hf_dir)!r} has no config.json; pass a directory written by "
                                "transformers' save_pretrained")
    check_out_dir(out, hf_dir, importing=True)
    spec = family_of_hf(hf_dir)
    is_image_model = spec.image_input  # reads images: no tokenizer
    tokenizer = tokenizer or hf_dir / "tokenizer.json"
    if not is_image_model and not tokenizer.is_file():
        raise ValueError(f"--tokenizer {str(tokenizer)!r} does not exist; pass the model's tokenizer.json with --tokenizer")
    model_cfg, state_dict = torch_family(spec.name).hf_adapter.load_hf_checkpoint(hf_dir)
    data = (DataConfig(source=IMAGE_SOURCES[0]) if is_image_model else DataConfig(tokenizer=str(out / "tokenizer.json")))
    cfg = Config(model=model_cfg, data=data, run=RunConfig(dir=str(out), name=hf_dir.name))
    cfg.train.seq_len = model_cfg.max_seq_len if is_image_model else min(cfg.train.seq_len, model_cfg.max_seq_len)
    cfg.validate()
    model = build_on_meta(model_cfg)
    model.to_empty(device="cpu")
    model.load_state_dict({k: v.float() for k, v in state_dict.items()}, strict=True)
    out.mkdir(parents=True, exist_ok=True)
    if not is_image_model:
        copy_atomic(tokenizer, out / "tokenizer.json")
    copy_chat_template(hf_dir, out)
    write_json_atomic(out / "config.json", cfg.to_dict())
    # Weights only: the trainer starts fresh optimizer state when a checkpoint has no "optim/" keys.
    weights = {f"{MODEL_PREFIX}{name}": value for name, value in model.state_dict().items()}
    save_checkpoint(out, 0, tensors=weights, state={"loader": None}, keep=1)
    return out


def export_run_to_hf(run_dir: Path, out: Path, *, arch: str | None = None, checkpoint: Path | None = None,
                     merge: bool = False) -> Path:
    """`arch` None: the run's family's own (llama, gpt2, bert, vit). A LoRA run needs `merge`."""
    check_run_dir(run_dir, "--to-hf")
    if read_run_config(run_dir).train.lora_rank and not merge:
        raise ValueError(f"--to-hf {str(run_dir)!r} is a LoRA run (train.lora_rank > 0): its checkpoints hold "
                         "adapters, not the model; add --merge to fold them into the base, or use --to-peft")
    check_out_dir(out, run_dir, importing=False)
    _, model, _ = load_run(run_dir, device="cpu", checkpoint=checkpoint)  # a LoRA run's adapters merged
    torch_family_of(model.cfg).hf_adapter.model_to_hf(model, out, arch=arch or model.cfg.family)
    if (run_dir / "tokenizer.json").is_file():  # an image model has none
        copy_atomic(run_dir / "tokenizer.json", out / "tokenizer.json")
    copy_chat_template(run_dir, out)
    return out


def check_run_dir(run_dir: Path, flag: str) -> None:
    if not (run_dir / "config.json").is_file():
        raise FileNotFoundError(f"{flag} {str(run_dir)!r} is not a run directory (no config.json); give the "
                                "run.dir of a `shardwise train` run")


def copy_chat_template(src: Path, dst: Path) -> None:
    """The model's chat template travels with its tokenizer (`shardwise serve` renders it)."""
    for name in TEMPLATE_FILES:
        if (src / name).is_file():
            copy_atomic(src / name, dst / name)
