"""The runtime's checks of a layout against the model and the batch, before any work starts.

Each raises the one-line error the runtime has always raised (field, value, fix) from the rules
in `layout_rules.py`, which the planner applies too. `distributed/`'s check functions call
these; they need no torch, so they also run where no process group exists. Arguments are plain
degrees and the (duck-typed) `Config` / `ModelConfig`.
"""

from __future__ import annotations

from shardwise.core.errors import invalid
from shardwise.core.family import FamilySpec
from shardwise.core.layout_rules import (
    CONFIG_NAMES,
    cp_family_violations,
    cp_head_violations,
    cp_window_violations,
    expert_violations,
    pipeline_family_violations,
    sp_family_violations,
    pipeline_violations,
    sequence_violations,
    tp_shape_violations,
)
from shardwise.core.stage_split import check_stage_count


def check_tensor_parallel(model, spec: FamilySpec, *, tp: int, sp: bool, seq_len: int, length_multiple: int = 1) -> None:
    """Stop when a size of `model` (a ModelConfig of `spec`'s family) does not split over `tp` ranks
    (`length_multiple`: data.length_multiple, which makes an encoder-decoder's sequences split)."""
    if tp == 1:
        return
    if model.n_kv_heads < tp:
        raise ValueError(
            f"parallel.tp = {tp} is invalid: model.n_kv_heads = {model.n_kv_heads} key/value heads cannot be split "
            f"over {tp} ranks; use a tp that divides {model.n_kv_heads} (each rank needs whole kv heads)"
        )
    for violation in sp_family_violations(sp=sp, spec=spec, tp=tp, length_multiple=length_multiple):
        raise invalid(CONFIG_NAMES[violation.field], violation.value, violation.fix_for(CONFIG_NAMES))
    for violation in tp_shape_violations(tp, model, spec):
        raise invalid("parallel.tp", tp, violation.fix)
    for violation in sequence_violations(seq_len=seq_len, tp=tp, sp=sp, cp=1, cp_mode="ring"):
        raise invalid(CONFIG_NAMES["seq_len"], seq_len, violation.fix_for(CONFIG_NAMES))


def check_context_parallel(cfg, spec: FamilySpec, *, cp: int, tp: int) -> None:
    """Stop when the sequence or the heads do not split over `cp` ranks, or the attention core
    cannot apply the model's sliding window (cfg: a Config; spec: its model's family)."""
    if cp == 1:
        return
    par, model = cfg.parallel, cfg.model
    for violation in cp_family_violations(cp=cp, spec=spec):
        raise invalid(CONFIG_NAMES[violation.field], violation.value, violation.fix_for(CONFIG_NAMES))
    for violation in sequence_violations(seq_len=cfg.train.seq_len, tp=tp, sp=par.sp, cp=cp, cp_mode=par.cp_mode,
                                         load_balance=par.cp_load_balance):
        raise invalid(CONFIG_NAMES["seq_len"], cfg.train.seq_len, violation.fix_for(CONFIG_NAMES))
    for violation in cp_head_violations(cp=cp, tp=tp, cp_mode=par.cp_mode, model=model):
        raise invalid("parallel.cp", cp, violation.fix_for(CONFIG_NAMES))
    for violation in cp_window_violations(cp=cp, cp_mode=par.cp_mode, sliding_window=model.sliding_window):
        raise invalid(CONFIG_NAMES[violation.field], violation.value, violation.fix_for(CONFIG_NAMES))


def check_expert_parallel(cfg, *, ep: int, dp_shard: int, cp: int, dp_replicate: int) -> None:
    """Stop when the model or the other degrees cannot form this expert-parallel layout: ep
    ranks are carved from the dp_shard x cp ranks of each replicate group."""
    for violation in expert_violations(ep=ep, n_experts=cfg.model.n_experts, sp=cfg.parallel.sp,
                                       dp_replicate=dp_replicate, data_ranks=dp_shard * cp):
        raise invalid(CONFIG_NAMES[violation.field], violation.value, violation.fix_for(CONFIG_NAMES))


def check_pipeline(cfg, spec: FamilySpec, *, pp: int, num_micro_batches: int, schedule_unavailable: str = "") -> None:
    """Stop when the model (of `spec`'s family), the batch or the schedule cannot form this pipeline.
    `schedule_unavailable`: why this torch cannot run parallel.pp_schedule ("" = it can)."""
    if pp == 1:
        return
    for violation in pipeline_family_violations(pp=pp, spec=spec):
        raise invalid(CONFIG_NAMES[violation.field], violation.value, violation.fix_for(CONFIG_NAMES))
    check_stage_count(pp * cfg.parallel.pp_virtual_stages, cfg.model.n_layers)
    schedule = cfg.parallel.pp_schedule
    violations = list(pipeline_violations(pp=pp, pp_schedule=schedule, num_micro_batches=num_micro_batches,
                                          tie_embeddings=cfg.model.tie_embeddings))
    if violations and violations[0].rule == "zbv_tied":
        raise invalid(CONFIG_NAMES["tie_embeddings"], True, violations[0].fix)
    if schedule_unavailable:
        raise invalid("parallel.pp_schedule", schedule, schedule_unavailable)
    for violation in violations:
        raise invalid(CONFIG_NAMES[violation.field], cfg.train.global_batch_size, violation.fix)
