"""LoRA adapters (models/common/lora.py) on one process: names, initial values, the frozen base (in
fp32 or bf16), dropout, merging, the optimizer and gradient norm over the adapters alone, a LoRA
run's checkpoints (adapters and their optimizer state, no base), exact resume, loading for
generation, and the config error for a target that is no role of the family."""

import json
import math

import pytest
import torch
import torch.nn.functional as F

from shardwise.checkpoint.store import checkpoint_tensor_shapes, latest_checkpoint
from shardwise.cli.main import main
from shardwise.config.loader import load_config
from shardwise.infer.load import load_run
from shardwise.models.build import build_on_meta, plan_of
from shardwise.models.common.lora import (
    LoRALinear,
    LoraOptions,
    adapter_initial_value,
    adapters_disabled,
    add_adapters,
    is_adapter_name,
    merge_adapters,
)
from shardwise.train.trainer import train

ROLES = ("q", "k", "v", "o", "gate", "up", "down")
LORA = {"train.lora_rank": 4, "train.lora_alpha": 8.0}


def seeded_model(preset="debug", seed=0):
    cfg = load_config(overrides={"model.preset": preset, "data.vocab_size": 512})
    model = build_on_meta(cfg.model)
    model.to_empty(device="cpu")
    model.init_weights(seed)
    return cfg, model


def adapted_model(preset="debug", roles=ROLES, seed=0, **options):
    cfg, model = seeded_model(preset, seed)
    options = LoraOptions(**{"rank": 4, "alpha": 8.0, "targets": roles, **options})
    names = add_adapters(model, plan_of(cfg.model), options, seed=seed)
    return model, names


def randomize_b(model, seed=1):
    """Adapters as if trained (B is zero at the start, which would hide the adapter path)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("lora_B.weight"):
                param.copy_(torch.randn(param.shape, generator=gen) * 0.05)


TOKENS = torch.randint(0, 512, (2, 16), generator=torch.Generator().manual_seed(0))


def test_adapters_are_named_as_peft_beside_the_unchanged_base_and_only_they_train():
    _, base = seeded_model()
    model, names = adapted_model()
    assert names == [f"layers.{i}.{path}" for i in range(2) for path in
                     ("attn.q_proj", "attn.k_proj", "attn.v_proj", "attn.o_proj",
                      "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")]
    params = dict(model.named_parameters())
    assert set(base.state_dict()) <= set(model.state_dict())  # the base keeps its names
    for name in names:
        linear = model.get_submodule(name)
        assert params[f"{name}.lora_A.weight"].shape == (4, linear.in_features)
        assert params[f"{name}.lora_B.weight"].shape == (linear.out_features, 4)
    trainable = {name for name, p in params.items() if p.requires_grad}
    assert trainable == {f"{name}.lora_{f}.weight" for name in names for f in "AB"}


def test_the_adapted_model_starts_as_its_base_with_a_kaiming_uniform_from_the_seed_per_name():
    _, base = seeded_model()
    model, _ = adapted_model()
    with torch.no_grad():
        assert torch.equal(model(TOKENS), base(TOKENS))  # B = 0
    for name, param in model.named_parameters():
        if name.endswith("lora_A.weight"):
            bound = 1 / math.sqrt(param.shape[1])  # kaiming_uniform_(a=sqrt(5)) on [r, in]
            assert param.abs().max() <= bound and param.abs().max() > 0.9 * bound
            assert torch.equal(param, adapter_initial_value(name, param.shape, "cpu", 0))
        if name.endswith("lora_B.weight"):
            assert not param.any()
    a = "layers.0.attn.q_proj.lora_A.weight"
    other = adapter_initial_value("layers.1.attn.q_proj.lora_A.weight", (4, 64), "cpu", 0)
    assert not torch.equal(adapter_initial_value(a, (4, 64), "cpu", 0), other)
    assert not torch.equal(adapter_initial_value(a, (4, 64), "cpu", 0), adapter_initial_value(a, (4, 64), "cpu", 1))


def test_an_adapter_adds_scale_b_a_x_and_merging_folds_it_into_the_base():
    model, _ = adapted_model(alpha=8.0)
    randomize_b(model)
    linear = model.get_submodule("layers.0.mlp.up_proj")
    x = torch.randn(3, 64)
    expected = x @ linear.weight.T + 2.0 * (x @ linear.lora_A.weight.T) @ linear.lora_B.weight.T  # alpha 8 / rank 4
    torch.testing.assert_close(linear(x), expected)
    with torch.no_grad():
        adapted = model(TOKENS)
        merge_adapters(model)
        assert not any(isinstance(m, LoRALinear) for m in model.modules())
        assert not any(is_adapter_name(name) for name in model.state_dict())
        torch.testing.assert_close(model(TOKENS), adapted, rtol=1e-5, atol=1e-5)


def test_adapters_disabled_runs_the_base_alone():
    _, base = seeded_model()
    model, _ = adapted_model()
    randomize_b(model)
    with torch.no_grad():
        assert not torch.allclose(model(TOKENS), base(TOKENS))
        with adapters_disabled(model):
            assert torch.equal(model(TOKENS), base(TOKENS))
        assert not torch.allclose(model(TOKENS), base(TOKENS))


def test_dropout_acts_on_the_adapter_input_in_training_only():
    model, _ = adapted_model(dropout=0.5)
    linear = model.get_submodule("layers.0.attn.q_proj")
    x = torch.randn(8, 64)
    base_out = F.linear(x, linear.weight)
    torch.testing.assert_close(linear.train()(x), base_out)  # B = 0: the base path takes no dropout
    randomize_b(model)
    torch.manual_seed(0)
    assert not torch.allclose(linear.train()(x), linear(x))  # two draws of the mask
    no_dropout = base_out + linear.scale * linear.lora_B(linear.lora_A(x))
    torch.testing.assert_close(linear.eval()(x), no_dropout)


def test_a_bf16_base_is_held_and_multiplied_in_bf16_with_fp32_adapters():
    _, base = seeded_model()
    model, names = adapted_model(base_dtype=torch.bfloat16)
    randomize_b(model)
    for name in names:
        linear = model.get_submodule(name)
        assert linear.weight.dtype == torch.bfloat16 and linear.lora_A.weight.dtype == torch.float32
        assert torch.equal(linear.weight, base.get_submodule(name).weight.to(torch.bfloat16))
    linear = model.get_submodule("layers.0.mlp.down_proj")
    x = torch.randn(3, 160, requires_grad=True)
    out = linear(x)
    adapter = linear.scale * linear.lora_B(linear.lora_A(x))
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, F.linear(x.bfloat16(), linear.weight).float() + adapter, rtol=0, atol=0)
    out.sum().backward()
    assert linear.weight.grad is None and linear.lora_A.weight.grad is not None


def test_gpt2_adapters_sit_on_its_biased_linears_and_merge_with_the_biases():
    model, names = adapted_model("gpt2-debug", roles=("q", "k", "v", "o", "up", "down"))
    assert len(names) == 2 * 6
    randomize_b(model)
    assert not any(p.requires_grad for name, p in model.named_parameters() if name.endswith(".bias"))
    with torch.no_grad():
        adapted = model(TOKENS)
        torch.testing.assert_close(merge_adapters(model)(TOKENS), adapted, rtol=1e-5, atol=1e-5)


def lora_overrides(tmp_path, data_cache, name, **extra):
    return {"model.preset": "debug", "data.source": "stdlib", "data.vocab_size": 512,
            "data.max_corpus_bytes": 200_000, "data.cache_dir": data_cache, "train.steps": 4,
            "train.global_batch_size": 4, "train.micro_batch_size": 2, "train.seq_len": 32, "train.warmup_steps": 1,
            "train.lr": 1e-2, "train.sample_tokens": 0, "run.dir": str(tmp_path / name), "run.progress": False,
            "train.device": "cpu", **LORA, **extra}


def test_the_optimizer_and_the_gradient_norm_hold_only_the_adapters(tmp_path, data_cache):
    from shardwise.distributed.dims import ParallelDims
    from shardwise.distributed.parallelize import parallelize_config
    from shardwise.train.optim import build_optimizer
    from shardwise.train.step import train_step

    cfg = load_config(overrides=lora_overrides(tmp_path, data_cache, "run"))
    pm = parallelize_config(cfg, ParallelDims(world_size=1), device=torch.device("cpu"))
    optimizer = build_optimizer([p for _, p, _ in pm.sync.named_optimizer_params()], cfg.train)
    params = dict(pm.model.named_parameters())
    held = {id(p) for group in optimizer.param_groups for p in group["params"]}
    assert held == {id(p) for name, p in params.items() if is_adapter_name(name)}
    before = {name: p.detach().clone() for name, p in params.items()}
    batch = [(TOKENS[:, :-1], TOKENS[:, 1:])]
    _, norm = train_step(pm, optimizer, batch, cfg, torch.device("cpu"))
    grads = [p.grad for p in params.values() if p.grad is not None]
    assert len(grads) == 2 * 14
    assert norm == pytest.approx(float(torch.linalg.vector_norm(torch.stack([g.norm() for g in grads]))), rel=1e-6)
    for name, value in params.items():
        assert torch.equal(value, before[name]) != is_adapter_name(name), name


def test_a_lora_run_checkpoints_its_adapters_and_resumes_with_exact_losses(tmp_path, data_cache):
    whole = train(load_config(overrides=lora_overrides(tmp_path, data_cache, "whole"))).losses
    stopped = lora_overrides(tmp_path, data_cache, "stopped")
    first = train(load_config(overrides={**stopped, "train.stop_at_step": 2})).losses
    rest = train(load_config(overrides=stopped)).losses
    assert first + rest == whole
    saved = checkpoint_tensor_shapes(latest_checkpoint(tmp_path / "stopped"))
    model_keys = {key[len("model/"):] for key in saved if key.startswith("model/")}
    optim_names = {key.split("/")[1] for key in saved if key.startswith("optim/")}
    assert model_keys and all(is_adapter_name(name) for name in model_keys)  # no frozen base
    assert optim_names == model_keys
    assert json.loads((tmp_path / "stopped" / "config.json").read_text())["train"]["init_from"] == ""


def test_load_run_gives_the_seeded_base_with_the_adapters_merged(tmp_path, data_cache):
    overrides = lora_overrides(tmp_path, data_cache, "run", **{"train.steps": 2})
    train(load_config(overrides=overrides))
    _, merged, _ = load_run(tmp_path / "run")
    _, adapted, _ = load_run(tmp_path / "run", merge=False)
    _, base = seeded_model()
    assert not any(isinstance(m, LoRALinear) for m in merged.modules())
    assert set(merged.state_dict()) == set(base.state_dict())
    for name, value in adapted.named_parameters():
        if not is_adapter_name(name):
            assert torch.equal(value, base.get_parameter(name)), name
    with torch.no_grad():
        torch.testing.assert_close(merged(TOKENS), adapted(TOKENS), rtol=1e-5, atol=1e-5)
        assert not torch.allclose(merged(TOKENS), base(TOKENS))  # the adapters trained


@pytest.mark.parametrize("targets, family, fix", [
    ("q,gate,qkv", "debug", "qkv is not a role of model.family llama: use roles among q, k, v, o, gate, up, down"),
    ("q,gate", "gpt2-debug", "gate is not a role of model.family gpt2: use roles among q, k, v, o, up, down"),
])
def test_a_target_that_is_no_role_of_the_family_is_one_config_error(tmp_path, capsys, targets, family, fix):
    argv = ["train", "--model.preset", family, "--train.lora_rank", "4", "--train.lora_targets", targets,
            "--run.dir", str(tmp_path / "run")]
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"shardwise: error: train.lora_targets = {targets!r} is invalid: {fix}"]
    assert not (tmp_path / "run").exists()


def test_a_lora_run_from_init_from_loads_that_base_then_its_adapters(tmp_path, data_cache):
    full = {key: value for key, value in lora_overrides(tmp_path, data_cache, "base").items() if key not in LORA}
    train(load_config(overrides={**full, "train.steps": 2}))
    lora = lora_overrides(tmp_path, data_cache, "lora", **{"train.steps": 2, "train.init_from": str(tmp_path / "base")})
    del lora["model.preset"]  # model.* comes from the source
    train(load_config(overrides=lora))
    _, base, _ = load_run(tmp_path / "base")
    _, adapted, _ = load_run(tmp_path / "lora", merge=False)
    _, merged, _ = load_run(tmp_path / "lora")
    for name, value in adapted.named_parameters():
        if not is_adapter_name(name):
            assert torch.equal(value, base.get_parameter(name)), name
    with torch.no_grad():
        torch.testing.assert_close(merged(TOKENS), adapted(TOKENS), rtol=1e-5, atol=1e-5)
        assert not torch.allclose(merged(TOKENS), base(TOKENS))


def test_the_chunked_loss_of_a_frozen_head_keeps_no_weight_gradient():
    """LoRA freezes the (tied) head: the loss's [vocab, width] gradient sum is neither made nor saved,
    and the hidden state's gradient is the same as with a trainable head."""
    from shardwise.models.common.chunked_loss import linear_cross_entropy

    h = torch.randn(64, 16, requires_grad=True)
    targets = torch.randint(0, 300, (64,))
    table = torch.randn(300, 16)
    grads, saved_bytes = {}, {}
    for trains in (True, False):
        weight = table.clone().requires_grad_(trains)
        saved = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.nbytes) or t, lambda t: t):
            loss = linear_cross_entropy(h, weight, targets)
        (grads[trains],) = torch.autograd.grad(loss, [h])
        saved_bytes[trains] = sum(saved)
    torch.testing.assert_close(grads[False], grads[True], rtol=0, atol=0)
    assert saved_bytes[False] == h.nbytes and saved_bytes[True] == h.nbytes + 300 * 16 * 4
