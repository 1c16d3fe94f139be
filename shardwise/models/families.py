"""Model families: how to build a config's model (on the meta device) and its parallelization
plan, by `model.family`: llama (Llama, Mistral, Qwen2/3, and the mixture-of-experts Mixtral and
Qwen2-MoE), gpt2, bert (a masked-LM encoder), vit (an image classifier) and t5 (an encoder-decoder). A new family
registers here with its own plan; `config.model.FAMILY_NAMES` lists the names the config accepts."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn

from shardwise.core.model import FAMILY_NAMES, ModelConfig
from shardwise.models.common.plan import ModelPlan
from shardwise.models.bert.model import Bert
from shardwise.models.bert.plan import bert_plan
from shardwise.models.gpt2.model import GPT2
from shardwise.models.gpt2.plan import gpt2_plan
from shardwise.models.llama.model import Llama
from shardwise.models.llama.plan import llama_plan
from shardwise.models.t5.model import T5
from shardwise.models.t5.plan import t5_plan
from shardwise.models.vit.model import ViT
from shardwise.models.vit.plan import vit_plan


@dataclass(frozen=True)
class Family:
    build: Callable[[ModelConfig], nn.Module]
    plan: Callable[[ModelConfig], ModelPlan]


FAMILIES = {
    "llama": Family(build=Llama, plan=llama_plan),
    "gpt2": Family(build=GPT2, plan=gpt2_plan),
    "bert": Family(build=Bert, plan=bert_plan),
    "vit": Family(build=ViT, plan=vit_plan),
    "t5": Family(build=T5, plan=t5_plan),
}
assert tuple(FAMILIES) == FAMILY_NAMES, "config/model.py's FAMILY_NAMES must list the families built here"


def family_of(cfg: ModelConfig) -> Family:
    if cfg.family not in FAMILIES:
        raise ValueError(f"model.family = {cfg.family!r} is invalid: use one of {', '.join(FAMILIES)}")
    return FAMILIES[cfg.family]


def build_on_meta(cfg: ModelConfig) -> nn.Module:
    """The model of `cfg` with no storage yet: a layout decides where each parameter lives."""
    with torch.device("meta"):
        return family_of(cfg).build(cfg)


def plan_of(cfg: ModelConfig) -> ModelPlan:
    return family_of(cfg).plan(cfg)
