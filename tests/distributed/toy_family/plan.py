"""The toy family's plan, as data: nothing in `shardwise.distributed` knows the toy's module names."""

from __future__ import annotations

from shardwise.models.common.plan import ModelPlan

from toy_family.model import ToyConfig


def toy_plan(cfg: ToyConfig) -> ModelPlan:
    layer_cost = float(6 * (4 * cfg.width**2 + 2 * cfg.width * cfg.hidden))
    return ModelPlan(
        blocks="trunk",
        first_stage=("wte", "wpe"),
        last_stage=("ln_out", "unembed"),
        tied_table=None,
        stage_costs=lambda seq_len: ([layer_cost] * cfg.depth, 0.0, float(6 * cfg.width * cfg.vocab)),
        tp_top={"wte": "vocab", "unembed": "head"},
        tp_block=lambda layer: {"mixer": "block_input", "mixer.query": "colwise", "mixer.key": "colwise",
                                "mixer.value": "colwise", "mixer.out": "rowwise", "ff": "block_input",
                                "ff.expand": "colwise", "ff.contract": "rowwise"},
        attention="mixer",
        positions_kwarg="where",
    )
