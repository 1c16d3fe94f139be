"""DPO (train/dpo.py, train/dpo_reference.py): the loss and its gradients against the formula computed
independently and against TRL's DPOTrainer loss on the same tiny model and batch; then whole runs: the
rewards in metrics.jsonl, the stored reference log-probabilities, resume."""

from __future__ import annotations

import copy
import dataclasses
import math
from collections import defaultdict
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from preference_rows import dpo_overrides, write_preference_rows
from shardwise.config.loader import load_config
from shardwise.data.chat_masks import Encoded
from shardwise.data.example_store import store_of
from shardwise.data.preference_loader import PairBatch, PreferenceLoader
from shardwise.distributed.dims import ParallelDims
from shardwise.distributed.parallelize import parallelize_config
from shardwise.train.dpo import REWARD_METRICS, RewardSums, dpo_forward_backward
from shardwise.train import dpo_reference
from shardwise.train.dpo_reference import REFERENCE_FILE, compute_reference
from shardwise.train.metrics import read_metrics_log
from shardwise.train.trainer import train

BETA = 0.5
SEQ_LEN = 12


def dpo_config(tmp_path, **overrides):
    values = {"model.preset": "debug", "data.source": str(tmp_path / "pairs.jsonl"), "data.format": "preference",
              "data.vocab_size": 512, "train.objective": "dpo", "train.dpo_beta": BETA, "train.seq_len": SEQ_LEN,
              "train.global_batch_size": 4, "train.micro_batch_size": 2, "run.dir": str(tmp_path / "run"),
              "train.device": "cpu", **overrides}
    return load_config(overrides=values)


def hand_built_loader(num_pairs: int = 4, seed: int = 0, **layout) -> PreferenceLoader:
    """Random prompts of 3..5 tokens, completions of 2..6 (their end token included), padded with 0:
    every row differs. 4 pairs a step, 2 a micro-batch."""
    rng = np.random.default_rng(seed)
    sides = ([], [])
    for _ in range(num_pairs):
        prompt = rng.integers(3, 500, size=int(rng.integers(3, 6)))
        for examples in sides:
            completion = rng.integers(3, 500, size=int(rng.integers(2, 7)))
            examples.append(Encoded(np.concatenate([prompt, completion]),
                                    np.arange(len(prompt) + len(completion)) >= len(prompt)))
    stores = [store_of(examples, [(0, k + 1) for k in range(num_pairs)], ["hand-built"], 512) for examples in sides]
    return PreferenceLoader(*stores, seq_len=SEQ_LEN, global_batch_size=4, micro_batch_size=2, seed=0, pad_id=0,
                            **layout)


def independent_logps(model, batch: PairBatch) -> torch.Tensor:
    """Sum of log p(completion token | everything before it) of each row, by log_softmax and gather."""
    log_probs = torch.log_softmax(model(batch.inputs_BS).float(), dim=-1)
    completion = batch.targets_BS != -100
    picked = log_probs.gather(-1, batch.targets_BS.clamp(min=0)[..., None])[..., 0]
    return (picked * completion).sum(dim=-1)


def independent_loss(policy, reference, batches: list[PairBatch]) -> torch.Tensor:
    """The DPO formula, pair by pair, averaged over every pair of the step."""
    losses = []
    for batch in batches:
        with torch.no_grad():
            ref_chosen, ref_rejected = independent_logps(reference, batch).chunk(2)
        chosen, rejected = independent_logps(policy, batch).chunk(2)
        losses.append(-F.logsigmoid(BETA * ((chosen - ref_chosen) - (rejected - ref_rejected))))
    return torch.cat(losses).mean()


@pytest.fixture
def dpo_setup(tmp_path):
    """A tiny llama laid out for one process, its initial copy, and a loader of hand-built pairs whose
    reference log-probabilities come from the initial weights; the policy then moved off them."""
    cfg = dpo_config(tmp_path)
    pm = parallelize_config(cfg, ParallelDims(world_size=1), device=torch.device("cpu"))
    initial = copy.deepcopy(pm.module)
    loader = hand_built_loader()
    loader.reference = compute_reference(pm, loader, cfg, torch.device("cpu"))
    with torch.no_grad():
        generator = torch.Generator().manual_seed(1)
        for param in pm.module.parameters():
            param.add_(0.05 * torch.randn(param.shape, generator=generator))
    return cfg, pm, initial, loader


def gradients(model) -> dict[str, torch.Tensor]:
    return {name: param.grad.clone() for name, param in model.named_parameters()}


def test_reference_logps_are_the_initial_models(dpo_setup):
    cfg, pm, initial, loader = dpo_setup
    batch = loader.pair_batch(np.arange(4))
    expected = torch.stack(independent_logps(initial, batch).detach().chunk(2), dim=1)
    torch.testing.assert_close(batch.reference_P2, expected, rtol=1e-6, atol=1e-5)


def compare_step(setup, expected_loss_of) -> RewardSums:
    """Our DPO forward and backward over a step's micro-batches, then `expected_loss_of(policy, batches)`
    on the same policy and batches: equal losses and gradients. Returns our reward sums."""
    cfg, pm, initial, loader = setup
    batches = loader.next_step()
    loss, rewards = dpo_forward_backward(pm, batches, cfg, torch.device("cpu"))
    ours = gradients(pm.module)
    pm.module.zero_grad()
    expected = expected_loss_of(pm.module, batches)
    expected.backward()
    assert loss == pytest.approx(expected.item(), rel=1e-6)
    assert loss > 0.1  # the policy moved: not the log 2 of policy = reference
    for name, grad in gradients(pm.module).items():
        torch.testing.assert_close(ours[name], grad, rtol=1e-5, atol=1e-7, msg=lambda m: f"{name}: {m}")
    return rewards


def test_loss_and_gradients_equal_the_dpo_formula(dpo_setup):
    initial = dpo_setup[2]
    rewards = compare_step(dpo_setup, lambda policy, batches: independent_loss(policy, initial, batches))
    assert rewards.pairs == 4


def trl_loss(policy, batches: list[PairBatch]) -> tuple[torch.Tensor, dict]:
    """TRL's DPOTrainer._compute_loss (sigmoid loss, precomputed reference log-probabilities) on our
    batches, its model call answered with per-token log-probabilities of the labels it passes; (the
    mean loss over the batches, the metrics it logged)."""
    from trl import DPOTrainer

    def model(input_ids, attention_mask, labels, **_):
        log_probs = torch.log_softmax(policy(input_ids).float(), dim=-1)[:, :-1]
        shifted = labels[:, 1:]
        picked = log_probs.gather(-1, shifted.clamp(min=0)[..., None])[..., 0] * (shifted != -100)
        zeros = torch.zeros_like(picked)
        return SimpleNamespace(log_probs=picked, entropy=zeros, mean_logits=zeros, is_top1=zeros.bool())

    accelerator = SimpleNamespace(device=torch.device("cpu"), gather=lambda t: t, gather_for_metrics=lambda t: t)
    trainer = SimpleNamespace(model=SimpleNamespace(training=True), accelerator=accelerator, aux_loss_enabled=False,
                              ld_alpha=None, precompute_ref_logps=True, f_divergence_type="reverse_kl",
                              loss_types=["sigmoid"], loss_weights=[1.0], beta=BETA, use_weighting=False,
                              _tp_size=1, _total_train_tokens=0, _metrics={"train": defaultdict(list)})
    losses = []
    for batch in batches:
        # TRL's rows are whole sequences with a completion mask: token t + 1 is our target t where it
        # carries the loss (a completion's last token is not among the padded inputs), else input t + 1
        completion = batch.targets_BS != -100
        following = torch.cat([batch.inputs_BS[:, 1:], torch.zeros_like(batch.inputs_BS[:, :1])], dim=1)
        input_ids = torch.cat([batch.inputs_BS[:, :1], torch.where(completion, batch.targets_BS, following)], dim=1)
        completion = torch.cat([torch.zeros_like(completion[:, :1]), completion], dim=1).long()
        inputs = {"input_ids": input_ids, "attention_mask": torch.ones_like(input_ids), "completion_mask": completion,
                  "ref_chosen_logps": batch.reference_P2[:, 0], "ref_rejected_logps": batch.reference_P2[:, 1]}
        losses.append(DPOTrainer._compute_loss(trainer, model, inputs, return_outputs=False))
    return torch.stack(losses).mean(), trainer._metrics["train"]


def test_loss_gradients_and_rewards_equal_trls(dpo_setup):
    trl_metrics = {}

    def trl_loss_keeping_metrics(policy, batches):
        loss, metrics = trl_loss(policy, batches)
        trl_metrics.update(metrics)
        return loss

    metrics = compare_step(dpo_setup, trl_loss_keeping_metrics).metrics(ParallelDims(world_size=1))
    for ours_name, trl_name in zip(REWARD_METRICS, ("rewards/chosen", "rewards/rejected", "rewards/margins",
                                                    "rewards/accuracies")):
        assert metrics[ours_name] == pytest.approx(float(np.mean(trl_metrics[trl_name])), rel=1e-5, abs=1e-7)


def test_with_lora_the_reference_is_the_base_with_the_adapters_off(tmp_path):
    """Adapters that moved away from zero change the model, not its reference log-probabilities: those
    are the base's, the same model built without adapters (no second copy: the adapters are switched off)."""
    cfg = dpo_config(tmp_path, **{"train.lora_rank": 4})
    adapted = parallelize_config(cfg, ParallelDims(world_size=1), device=torch.device("cpu"))
    with torch.no_grad():
        for name, param in adapted.module.named_parameters():
            if name.endswith("lora_B.weight"):
                param.normal_(0, 0.5)
    base = parallelize_config(dpo_config(tmp_path), ParallelDims(world_size=1), device=torch.device("cpu"))
    loader = hand_built_loader()
    reference = compute_reference(adapted, loader, cfg, torch.device("cpu"))
    np.testing.assert_array_equal(reference, compute_reference(base, loader, cfg, torch.device("cpu")))
    batch = loader.pair_batch(np.arange(4))
    with_adapters = independent_logps(adapted.module, batch).detach().double().numpy()
    assert np.abs(with_adapters - np.concatenate([reference[:, 0], reference[:, 1]])).max() > 0.1


def test_first_step_loss_is_log_2(tmp_path):
    """Before any update the policy is the reference: every pair's loss is -log sigmoid(0)."""
    cfg = dpo_config(tmp_path)
    pm = parallelize_config(cfg, ParallelDims(world_size=1), device=torch.device("cpu"))
    loader = hand_built_loader()
    loader.reference = compute_reference(pm, loader, cfg, torch.device("cpu"))
    loss, rewards = dpo_forward_backward(pm, loader.next_step(), cfg, torch.device("cpu"))
    assert loss == pytest.approx(math.log(2), abs=1e-6)
    assert rewards.metrics(ParallelDims(world_size=1))["reward_margin"] == pytest.approx(0.0, abs=1e-6)


# ---- the trainer: metrics, the stored reference, resume (a row without `chosen`: tests/test_bad_input.py) ----

def dpo_run(tmp_path, data_cache, **overrides) -> dict:
    data_file = tmp_path / "data" / "pairs.jsonl"
    if not data_file.exists():
        write_preference_rows(data_file)
    return {"model.preset": "debug", **dpo_overrides(data_file), "data.cache_dir": data_cache,
            "train.seq_len": 32, "train.global_batch_size": 4, "train.micro_batch_size": 2, "train.steps": 6,
            "train.lr": 1e-3, "train.warmup_steps": 1, "train.sample_tokens": 0, "train.device": "cpu",
            "run.dir": str(tmp_path / "run"), "run.progress": False, **overrides}


def test_a_dpo_run_logs_its_rewards_and_learns_the_preference(tmp_path, data_cache):
    result = train(load_config(overrides=dpo_run(tmp_path, data_cache)))
    records = [record for _, record in read_metrics_log(result.run_dir / "metrics.jsonl")]
    assert [record["step"] for record in records] == [1, 2, 3, 4, 5, 6]
    first, last = records[0], records[-1]
    # step 1: the policy is the reference, every pair's loss -log sigmoid(0)
    assert first["loss"] == pytest.approx(math.log(2), abs=1e-6)
    assert first["reward_margin"] == pytest.approx(0.0, abs=1e-6)
    assert last["loss"] < first["loss"] - 0.05
    assert last["reward_margin"] > 0.1 and last["reward_accuracy"] >= 0.75
    for record in records:
        assert record["reward_margin"] == pytest.approx(record["reward_chosen"] - record["reward_rejected"], abs=1e-9)
    assert (result.run_dir / REFERENCE_FILE).is_file()


def test_a_resumed_dpo_run_reads_its_reference_and_equals_an_uninterrupted_one(tmp_path, data_cache, monkeypatch):
    whole = train(load_config(overrides=dpo_run(tmp_path, data_cache, **{"run.dir": str(tmp_path / "whole")})))
    stopped = dpo_run(tmp_path, data_cache, **{"checkpoint.every": 1})
    first = train(load_config(overrides={**stopped, "train.stop_at_step": 3})).losses
    monkeypatch.setattr(dpo_reference, "compute_reference", lambda *args: pytest.fail("the reference was recomputed"))
    second = train(load_config(overrides=stopped)).losses
    assert first + second == whole.losses  # the same computations in the same order: bit for bit



@pytest.mark.parametrize("field, value, message", [
    ("parallel.pp", 2, "parallel.pp = 2 is invalid: DPO's loss needs both sequences of a pair whole"),
    ("parallel.cp", 2, "parallel.cp = 2 is invalid: DPO's loss sums each sequence's log-probabilities"),
    ("data.val_fraction", 0.1, "data.val_fraction = 0.1 is invalid: DPO runs evaluate no held-out pairs"),
])
def test_what_dpo_refuses_is_one_line_naming_the_field(field, value, message, tmp_path):
    with pytest.raises(ValueError) as refused:
        dpo_config(tmp_path, **{field: value})
    assert str(refused.value).startswith(message) and "\n" not in str(refused.value)


def test_the_automatic_layout_passes_over_what_dpo_refuses(tmp_path):
    from shardwise.train.auto_layout import runtime_accepts

    cfg = dpo_config(tmp_path)
    assert runtime_accepts(cfg, 2)
    assert not runtime_accepts(dataclasses.replace(cfg, parallel=dataclasses.replace(cfg.parallel, pp=2)), 2)


def test_a_lora_dpo_run_starts_at_log_2_and_trains_only_its_adapters(tmp_path, data_cache):
    result = train(load_config(overrides=dpo_run(tmp_path, data_cache, **{"train.lora_rank": 4, "train.lr": 1e-2})))
    assert result.losses[0] == pytest.approx(math.log(2), abs=1e-6)
    assert result.losses[-1] < result.losses[0]


def test_a_resumed_run_from_init_from_computes_a_lost_reference_from_the_source(tmp_path, data_cache):
    """A full fine-tune resuming its own checkpoints is built without train.init_from's weights (the
    checkpoint replaces them): a reference file gone by then is computed from the source again."""
    source = dpo_run(tmp_path, data_cache, **{"run.dir": str(tmp_path / "source"), "train.steps": 2})
    train(load_config(overrides=source))
    fine_tune = {key: value for key, value in dpo_run(tmp_path, data_cache).items() if not key.startswith("model.")}
    fine_tune.update({"train.init_from": str(tmp_path / "source"), "checkpoint.every": 1})
    whole = train(load_config(overrides={**fine_tune, "run.dir": str(tmp_path / "whole")})).losses
    first = train(load_config(overrides={**fine_tune, "train.stop_at_step": 3})).losses
    (tmp_path / "run" / REFERENCE_FILE).unlink()
    second = train(load_config(overrides=fine_tune)).losses
    assert first + second == whole
    assert (tmp_path / "run" / REFERENCE_FILE).read_text() == (tmp_path / "whole" / REFERENCE_FILE).read_text()
