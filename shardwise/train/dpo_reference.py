"""DPO's reference log-probabilities: every training pair's, computed once from the initial weights
before the first update, and kept in the run directory (RUN/dpo_reference.json).

Why precomputed (TRL's `precompute_ref_logps`) rather than a frozen second copy of the model: a
copy costs one more model's weights on every rank (sharded like the policy, but still a second
set), a second layout to build and a forward per micro-batch in every step of every epoch. The
pairs' log-probabilities are two numbers each: one forward pass over the data at the start (the
cost of one epoch's reference forwards, less from the second epoch on) and no memory at all during
training. With LoRA the same pass runs on the base with the adapters off (at step 0 the adapters'
B is zero, so the model is its base anyway): no second copy either.

It runs after the model is built and before a checkpoint is loaded, so the weights are the initial
ones (the seeded initialisation or train.init_from's; a full fine-tune resuming its own checkpoints
loads train.init_from's first, which `build` leaves to the checkpoint): a resumed run reads the file,
and recomputes it if it is missing or was made for other data, another model or other initial
weights (`reference_key`). It is written atomically by rank 0 once every rank has its values.

Under data parallelism each data-parallel rank computes a contiguous share of the pairs, the
tensor-parallel ranks of one data-parallel rank together (their forward is collective), and one
all-reduce over every rank assembles the table: each pair's values come from exactly one rank
(the first tensor-parallel rank of the data-parallel rank that owns it), the others add zeros.
"""

from __future__ import annotations

import hashlib
import json
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from shardwise.checkpoint.init_from import load_pretrained
from shardwise.checkpoint.store import write_json_atomic
from shardwise.data.preference_loader import PreferenceLoader
from shardwise.distributed.parallelize import ParallelModel
from shardwise.models.common.lora import adapters_disabled
from shardwise.models.common.loss import autocast_context
from shardwise.runtime.process_group import barrier
from shardwise.train.dpo import completion_logps
from shardwise.train.setup import resumes_own_weights

REFERENCE_FILE = "dpo_reference.json"
WEIGHT_FIELDS = ("seed", "init_from", "autocast_dtype", "lora_base_dtype", "seq_len")
"""train.* fields that change the initial weights or how their log-probabilities are computed."""


def reference_key(cfg, loader: PreferenceLoader) -> str:
    """What the reference log-probabilities depend on: the pairs, the model and its initial weights."""
    described = {"data_sha256": loader.data_sha256, "num_pairs": loader.num_pairs, "model": cfg.to_dict()["model"],
                 "train": {name: getattr(cfg.train, name) for name in WEIGHT_FIELDS}}
    return hashlib.sha256(json.dumps(described, sort_keys=True).encode()).hexdigest()


def read_reference(path: Path, key: str) -> np.ndarray | None:
    """The stored table [num_pairs, 2] when `path` holds one made for `key`, else None."""
    try:
        stored = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(stored, dict) or stored.get("key") != key:
        return None
    return np.array([stored["chosen"], stored["rejected"]], dtype=np.float64).T


def attach_reference(run, pm: ParallelModel) -> None:
    """Give the run's DPO loader its reference log-probabilities: read, or computed and stored."""
    loader, path = run.loader, run.dir / REFERENCE_FILE
    key = reference_key(run.cfg, loader)
    table = read_reference(path, key)
    if table is None or len(table) != loader.num_pairs:
        if run.cfg.train.init_from and resumes_own_weights(run.cfg):
            load_pretrained(pm, run.cfg)  # `build` left them out: the checkpoint replaces them next
        started = time.perf_counter()
        table = compute_reference(pm, loader, run.cfg, run.device)
        if run.is_main:
            write_json_atomic(path, {"key": key, "chosen": table[:, 0].tolist(), "rejected": table[:, 1].tolist()})
            print(f"dpo: reference log-probabilities of {loader.num_pairs} pairs from the initial weights in "
                  f"{time.perf_counter() - started:.1f} s -> {path}", flush=True)
    barrier(run.dims.world_size)
    loader.reference = table


@torch.no_grad()
def compute_reference(pm: ParallelModel, loader: PreferenceLoader, cfg, device) -> np.ndarray:
    """Every pair's (chosen, rejected) log-probabilities under the model's current weights, float64
    [num_pairs, 2], the same on every rank."""
    table = torch.zeros(loader.num_pairs, 2, dtype=torch.float64)
    contributes = not pm.dims.is_distributed or dist.get_rank() % pm.dims.tp == 0  # tp: the innermost axis
    was_training = pm.module.training
    pm.module.eval()
    with adapters_disabled(pm.model):  # LoRA: the base alone; else nothing to switch off
        for batch in loader.all_pairs_of_rank():
            with pm.loss_context():
                with autocast_context(device, cfg.train.autocast_dtype):
                    logits = pm.module(batch.inputs_BS.to(device))
                logps = completion_logps(logits, batch.targets_BS.to(device)).double().cpu()
            owned = batch.pair_ids_P >= 0
            if contributes:
                table[batch.pair_ids_P[owned]] = torch.stack(logps.chunk(2), dim=1)[owned]
    pm.module.train(was_training)
    if pm.dims.is_distributed:
        dist.all_reduce(table)
    return table.numpy()
