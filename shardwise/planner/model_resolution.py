"""The model the planner estimates: a validated `ModelConfig` (core/model.py), resolved from any of
the forms `shardwise estimate`/`plan` accept: a preset name, a shardwise `model` section (a preset
and overrides, or every shape field), a Hugging Face config.json, each as a dict, JSON text or a
.json/.toml file (a run config's [model] section).

There is no planner copy of the model's fields: the planner reads the config and counts with
`core/model_counts.py` (llama3-8b: 8,030,261,248 parameters). The one thing a config does not
hold, the name `shardwise plan` prints (the preset, a config.json's `_name_or_path` or
model_type, else "custom"), `resolve_model_and_name` returns beside it.

A config.json is read by the family that converts its model_type (`models/<family>/hf_config.py`),
except a decoder's: the family whose spec has `estimates_any_decoder` reads its own types and
those no family converts with `estimate_config_from_hf`, which takes the shape and leaves out the
converter's refusals (Qwen3-MoE, dense `mlp_only_layers`, other activations or biases, windows on
some layers): none of those changes a count the planner makes. No torch.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
from pathlib import Path

from shardwise.config.loader import flatten, unknown_key_error
from shardwise.config.schema import SECTIONS
from shardwise.config.presets import PRESETS
from shardwise.core.errors import invalid
from shardwise.core.model import ModelConfig
from shardwise.models.families import SPECS, family_of_hf_type, hf_config_of, validate_model

SHAPE_KEYS = ("dim", "n_layers", "n_heads", "n_kv_heads", "ffn_dim", "vocab_size")
"""What a shardwise model section without a preset must give."""
HF_KEYS = {"hidden_size", "num_hidden_layers", "num_attention_heads"}
DECODER_ESTIMATOR = next(spec for spec in SPECS.values() if spec.estimates_any_decoder)
"""The family that reads any decoder's config.json for the planner (models/<family>/spec.py)."""
CUSTOM = "custom"
MODEL_FIELDS = [field.name for field in dataclasses.fields(ModelConfig)]


def config_from_shardwise(values: dict) -> ModelConfig:
    """A shardwise `model` section: a preset and overrides, or every shape field; keys and types
    are checked as a TOML config's are."""
    preset = values.get("preset")
    if preset is not None and preset not in PRESETS:
        raise invalid("model.preset", preset, f"use one of {', '.join(PRESETS)}")
    # Keys first: a misspelled shape key is named as such, not as the one it was meant to be missing.
    fields = {key.split(".", 1)[1]: value for key, value in flatten({"model": values}).items()}
    missing = sorted(key for key in SHAPE_KEYS if key not in values) if preset is None else []
    if missing:
        raise ValueError(f"model.{missing[0]} is missing: give it, or a preset to start from")
    return validate_model(ModelConfig(**{**PRESETS.get(preset, {}), **fields}))


def config_from_hf(hf: dict) -> ModelConfig:
    """A Hugging Face config.json, read by the family that converts its model_type, or as a decoder
    (see the module docstring)."""
    family = family_of_hf_type(str(hf.get("model_type") or ""))
    if family is None or family.estimates_any_decoder:
        return hf_config_of(DECODER_ESTIMATOR.name).estimate_config_from_hf(hf)
    cfg = hf_config_of(family.name).config_from_hf(hf)
    return validate_model(ModelConfig(**cfg)) if isinstance(cfg, dict) else cfg


def hf_name(hf: dict) -> str:
    return hf.get("_name_or_path") or hf.get("model_type") or CUSTOM


def is_hf_config(values: dict) -> bool:
    return bool(HF_KEYS & set(values)) or family_of_hf_type(str(values.get("model_type") or "")) is not None


def resolve_dict(spec: dict) -> tuple[ModelConfig, str]:
    nested = isinstance(spec.get("model"), dict)
    values = spec["model"] if nested else spec
    if nested:  # a run config (TOML or a run directory's config.json): its other keys are its sections
        for key in spec:
            if key not in SECTIONS:
                raise unknown_key_error(key, list(SECTIONS))
    if is_hf_config(values):
        return config_from_hf(values), hf_name(values)
    if "preset" in values or set(SHAPE_KEYS) & set(values):
        return config_from_shardwise(values), values.get("preset") or CUSTOM
    known = [*MODEL_FIELDS, *HF_KEYS]
    for key in values:  # neither form: name the key nearest to one of either
        if difflib.get_close_matches(key, known, n=1):
            raise unknown_key_error(f"model.{key}", [f"model.{name}" for name in known])
    raise ValueError(f"model = {json.dumps(spec)[:60]} is invalid: give a preset name, a shardwise model "
                     f"config (dim, n_layers, ...) or a Hugging Face config (hidden_size, ...)")


def resolve_model_and_name(spec) -> tuple[ModelConfig, str]:
    """(the validated config, the name `plan` prints) of a preset name, a dict (a shardwise model
    section or a HF config.json), JSON text, or a .json/.toml path (a directory: its config.json)."""
    if isinstance(spec, ModelConfig):
        return spec, CUSTOM
    if isinstance(spec, dict):
        return resolve_dict(spec)
    if not isinstance(spec, str) or not spec.strip():
        raise ValueError(f"model = {spec!r} is invalid: use a preset ({', '.join(PRESETS)}), a JSON object or a file")
    text = spec.strip()
    if text in PRESETS:
        return config_from_shardwise({"preset": text}), text
    if text.startswith("{"):
        try:
            return resolve_model_and_name(json.loads(text))
        except json.JSONDecodeError as err:
            raise ValueError(f"model = {text[:40]!r} is invalid JSON: {err}") from None
    path = Path(text)
    if path.suffix in (".json", ".toml") or path.is_dir():
        return resolve_model_and_name(read_model_file(path, text))
    raise ValueError(f"model = {text!r} is invalid: use a preset ({', '.join(PRESETS)}), a JSON object or a file")


def read_model_file(path: Path, text: str) -> dict:
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"model = {text!r} is invalid: no such file")
    if path.suffix == ".toml":
        import tomllib

        return tomllib.loads(path.read_text())
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise ValueError(f"model file {path} is invalid JSON: {err}") from None


def resolve_model(spec) -> ModelConfig:
    """The validated ModelConfig of any form `resolve_model_and_name` takes."""
    return resolve_model_and_name(spec)[0]
