"""The torch side of a model family, as each `models/<family>/family.py` states it."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType

from torch import nn

from shardwise.core.model import ModelConfig
from shardwise.models.common.plan import ModelPlan


@dataclass(frozen=True)
class TorchFamily:
    build: Callable[[ModelConfig], nn.Module]
    """The model of a config (called on the meta device by `models.build.build_on_meta`)."""
    plan: Callable[[ModelConfig], ModelPlan]
    """Its parallelization plan, as data (models/common/plan.py)."""
    hf_adapter: ModuleType
    """Its HF weights: `load_hf_checkpoint(dir) -> (ModelConfig, state_dict)` and
    `model_to_hf(model, dir, arch=...)`."""
