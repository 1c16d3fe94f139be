"""Model families: how to build a config's model (on the meta device) and its parallelization
plan. Every `ModelConfig` is a Llama-family decoder today (dense or mixture-of-experts); the
families of issue 20 (GPT-2, BERT, T5, ViT, Qwen3, ...) register here with their own plan."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn

from shardwise.config.model import ModelConfig
from shardwise.models.common.plan import ModelPlan
from shardwise.models.llama.model import Llama
from shardwise.models.llama.plan import llama_plan


@dataclass(frozen=True)
class Family:
    build: Callable[[ModelConfig], nn.Module]
    plan: Callable[[ModelConfig], ModelPlan]


FAMILIES = {"llama": Family(build=Llama, plan=llama_plan)}


def family_of(cfg: ModelConfig) -> Family:
    return FAMILIES["llama"]


def build_on_meta(cfg: ModelConfig) -> nn.Module:
    """The model of `cfg` with no storage yet: a layout decides where each parameter lives."""
    with torch.device("meta"):
        return family_of(cfg).build(cfg)


def plan_of(cfg: ModelConfig) -> ModelPlan:
    return family_of(cfg).plan(cfg)
