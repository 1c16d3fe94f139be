"""`train.float8`: which linears compute in float8, and that the swapped model is the same model.

The device refusals (a CPU; tensor parallelism; no compile) are bad-input cases in
tests/test_bad_input.py. torchao's float8 matmul also runs on a CPU (emulated), which lets this
test train a step of the swapped model here; its speed is a GPU's question (docs/benchmarks.md).
"""

import pytest
import torch

from shardwise.compile.float8 import apply_float8, float8_eligible
from shardwise.config.loader import load_config
from shardwise.models.build import build_on_meta, plan_of



@pytest.fixture(autouse=True)
def torchao():
    """Imported by these tests alone (3-4 s), not at collection by every test process."""
    return pytest.importorskip("torchao.float8", reason="torchao (shardwise[float8]) is not installed")


def debug_model(**overrides):
    cfg = load_config(overrides={"model.preset": "debug", "data.vocab_size": 512, **overrides})
    return cfg, build_on_meta(cfg.model)


def test_only_the_blocks_linears_with_widths_of_16_are_swapped():
    cfg, model = debug_model()
    eligible = {name for name, module in model.named_modules() if float8_eligible(module, name, "layers")}
    names_before = [name for name, _ in model.named_parameters()]
    swapped = apply_float8([model], plan_of(cfg.model), "rowwise")
    kinds = {name: type(module).__name__ for name, module in model.named_modules()}
    assert swapped == len(eligible) == 2 * 7  # q, k, v, o, gate, up, down in each of 2 blocks (widths 64, 160, 32)
    assert all(kinds[name] == "Float8Linear" for name in eligible)
    assert not any(kind == "Float8Linear" for name, kind in kinds.items() if not name.startswith("layers."))
    assert [name for name, _ in model.named_parameters()] == names_before  # checkpoints and HF keys unchanged


def test_a_width_that_is_no_multiple_of_16_stays_in_high_precision():
    linear = torch.nn.Linear(64, 40)
    assert not float8_eligible(linear, "layers.0.mlp.up_proj", "layers")
    assert float8_eligible(torch.nn.Linear(64, 48), "layers.0.mlp.up_proj", "layers")
    assert not float8_eligible(torch.nn.Linear(64, 48), "lm_head", "layers")


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got - want).norm() / want.norm()).item()


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_the_float8_model_starts_from_the_same_weights_and_computes_within_float8_rounding(recipe):
    """Same initial weights (by name); a swapped linear's output and the model's logits within
    float8's rounding of fp32's. e4m3 keeps 3 mantissa bits: each operand element is off by up to
    1/16 of itself, about 3.6% RMS over a product of two (seen: 3.7-3.8% for one linear, 1.8-1.9% for
    the centred logits); the bounds, 8% and 5%, sit above that, and far below what a wrong or missing
    scale gives (the output off by a factor: 100% or more)."""
    cfg, model = debug_model()
    _, reference = debug_model()
    apply_float8([model], plan_of(cfg.model), recipe)
    for each in (model, reference):
        each.to_empty(device="cpu")
        each.init_weights(0)
    for (name, param), (_, ref) in zip(model.named_parameters(), reference.named_parameters()):
        assert torch.equal(param, ref), name
    linear = dict(model.named_modules())["layers.0.mlp.up_proj"]
    x = torch.randn(16, 64, generator=torch.Generator().manual_seed(0))
    assert relative_error(linear(x), x @ linear.weight.t()) < 0.08
    tokens = torch.randint(0, 512, (2, 33), generator=torch.Generator().manual_seed(0))
    logits, want = model(tokens[:, :-1]), reference(tokens[:, :-1])
    centred = [each - each.mean(-1, keepdim=True) for each in (logits, want)]  # softmax ignores a row's offset
    assert relative_error(*centred) < 0.05
    torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten()).backward()
    assert all(param.grad is not None and torch.isfinite(param.grad).all() for param in model.parameters())
