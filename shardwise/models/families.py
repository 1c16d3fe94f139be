"""The model families: the registry, one entry per family.

A family is its folder `models/<name>/`: `spec.py` (its traits as a `core.family.FamilySpec`,
torch-free), `hf_config.py` (its Hugging Face config.json mapping, torch-free), `family.py` (the
torch side: model, plan, HF weight adapter) and the modules those use. Adding a family is adding a
folder and its name to FAMILY_NAMES. This module imports no torch: config validation and the
planner read the specs; the torch side is imported when a model is built.
"""

from __future__ import annotations

import dataclasses
import importlib
from types import ModuleType

from shardwise.core.errors import invalid
from shardwise.core.family import FamilySpec
from shardwise.core.model import ModelConfig
from shardwise.core.model_counts import ModelCounts

FAMILY_NAMES = ("llama", "gpt2", "bert", "vit", "t5")
"""The registry: each name is a folder of shardwise/models/."""


def family_module(name: str, part: str) -> ModuleType:
    """`models/<name>/<part>.py` of a registered family."""
    return importlib.import_module(f"shardwise.models.{name}.{part}")


SPECS: dict[str, FamilySpec] = {name: family_module(name, "spec").SPEC for name in FAMILY_NAMES}
assert all(spec.name == name for name, spec in SPECS.items()), "a family's SPEC.name is its folder's name"


def spec_of(family: str) -> FamilySpec:
    """The spec of `model.family` (refused in one line when no family has that name)."""
    if family not in SPECS:
        raise invalid("model.family", family, f"use one of {', '.join(SPECS)}")
    return SPECS[family]


def counts_of(cfg: ModelConfig) -> ModelCounts:
    """The model's parameter and FLOP counts, as its family's traits make them."""
    return ModelCounts(cfg, spec_of(cfg.family))


def hf_config_of(family: str) -> ModuleType:
    """The family's config.json mapping (`config_from_hf`, `config_to_hf`), torch-free."""
    return family_module(spec_of(family).name, "hf_config")


def family_of_hf_type(model_type: str) -> FamilySpec | None:
    """The family whose config.json mapping reads a HF `model_type` (None: no family does)."""
    return next((spec for spec in SPECS.values() if model_type in spec.hf_model_types), None)


def default_of(name: str):
    model_field = ModelConfig.__dataclass_fields__[name]
    if model_field.default_factory is not dataclasses.MISSING:
        return model_field.default_factory()
    return model_field.default


def validate_model(cfg: ModelConfig) -> ModelConfig:
    """All of a model config's checks: its family's name, the fields only other families compute
    (any other family would silently ignore them, so each must keep its default), then the family's
    own checks and those every family shares (`ModelConfig.validate`)."""
    spec = spec_of(cfg.family)
    for other in SPECS.values():
        for name, what in other.own_fields.items():
            default = default_of(name)
            if other is not spec and name not in spec.own_fields and getattr(cfg, name) != default:
                raise invalid(f"model.{name}", getattr(cfg, name),
                              f"only model.family {other.name} has {what}: leave it at {default!r} for {cfg.family}")
    cfg.validate(spec)
    return cfg
