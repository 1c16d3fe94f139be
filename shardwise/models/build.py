"""Building a config's model and reading its plan, through its family's torch side
(`models/<family>/family.py`, found by the registry in families.py)."""

from __future__ import annotations

import torch
from torch import nn

from shardwise.core.model import ModelConfig
from shardwise.models.common.plan import ModelPlan
from shardwise.models.common.torch_family import TorchFamily
from shardwise.models.families import family_module, spec_of


def torch_family(family: str) -> TorchFamily:
    """The torch side of `model.family` (its `models/<family>/family.py`)."""
    return family_module(spec_of(family).name, "family").FAMILY


def torch_family_of(cfg: ModelConfig) -> TorchFamily:
    return torch_family(cfg.family)


def build_on_meta(cfg: ModelConfig) -> nn.Module:
    """The model of `cfg` with no storage yet: a layout decides where each parameter lives."""
    with torch.device("meta"):
        return torch_family_of(cfg).build(cfg)


def plan_of(cfg: ModelConfig) -> ModelPlan:
    return torch_family_of(cfg).plan(cfg)
