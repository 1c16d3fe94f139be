"""Weight-only quantization (`generation/quantize.py`): a quantized linear against the float one, within
bounds that follow from the schemes and the kernels' bf16 arithmetic; the checks of its input."""

import copy

import pytest
import torch
from torch import nn

from shardwise.generation.quantize import choose_group_size, quantize_model

BF16_ROUNDING = 2 ** -9
"""bf16 keeps 8 bits of mantissa: rounding to it changes a value by at most 2^-9 of its size."""


def quantized_copy(linear: nn.Linear, scheme: str, group_size: int | None = None) -> nn.Module:
    model = nn.Sequential(copy.deepcopy(linear))
    quantize_model(model, scheme, group_size)
    return model[0]


def float_linear(shift_rows: float) -> nn.Linear:
    """Weights with a per-row offset, so int4's zero points are large against its scales (where their
    bf16 rounding shows)."""
    torch.manual_seed(0)
    linear = nn.Linear(256, 96, bias=True)
    with torch.no_grad():
        linear.weight += shift_rows * torch.randn(96, 1)
    return linear


@pytest.mark.parametrize("scheme", ["int8", "int4"])
@pytest.mark.parametrize("shift_rows", [0.0, 1.0])
@pytest.mark.parametrize("rows", [7, 1])
def test_a_quantized_linear_matches_the_float_linear_within_its_bound(scheme, shift_rows, rows):
    """Two steps, each with its own bound, then the two together against the float linear:
    1. stored weights: each code is the nearest step of its grid, so |W - W_q| <= step / 2, step the
       row's (int8) or group's (int4) scale (times 1 + 2^-16: the fp32 division that picks the code);
       int4's grid is set by a zero point and scale rounded to bf16, which moves its ends (codes 0
       and 15 are clamped) by up to (|zero| + 8 scale) 2^-9.
    2. the kernel: x is rounded to bf16, products summed in fp32, y rounded to bf16 (and int4's
       kernel forms (q - 8) scale + zero in bf16): |y - x W_q^T - b| <= 3 2^-9 |x| |W_q|^T.
    Whence |y - (x W^T + b)| <= |x| bound_1^T + bound_2. One row takes int8's folded product (its
    scales applied after the kernel, in fp32), under the same bound."""
    linear = float_linear(shift_rows)
    quantized = quantized_copy(linear, scheme, 32 if scheme == "int4" else None)
    weight, stored = linear.weight.detach(), quantized.dequantized()
    if scheme == "int8":
        step = quantized.scales.float()[:, None].expand_as(weight)
        grid_shift = torch.zeros_like(weight)
    else:
        step = quantized.scales.float().repeat_interleave(32, dim=1)
        grid_shift = (quantized.zeros.float().repeat_interleave(32, dim=1).abs() + 8 * step) * BF16_ROUNDING
    weight_bound = step / 2 * (1 + 2 ** -16) + grid_shift
    assert ((stored - weight).abs() <= weight_bound).all()

    x = torch.randn(rows, 256)
    with torch.no_grad():
        y = quantized(x)
        exact = x @ stored.t() + linear.bias
        kernel_bound = 3 * BF16_ROUNDING * (x.abs() @ stored.abs().t())
        assert ((y - exact).abs() <= kernel_bound).all()
        assert ((y - linear(x)).abs() <= x.abs() @ weight_bound.t() + kernel_bound).all()
    assert y.dtype == torch.float32 and y.shape == (rows, 96)


def test_int8_stores_a_byte_per_weight_and_int4_half_of_one():
    linear = float_linear(0.0)
    int8, int4 = quantized_copy(linear, "int8"), quantized_copy(linear, "int4", 64)
    assert int8.codes.dtype == torch.int8 and int8.codes.shape == (96, 256) and int8.scales.shape == (96,)
    assert int4.codes.dtype == torch.uint8 and int4.codes.shape == (96, 128) and int4.scales.shape == (96, 4)
    assert set(int4.state_dict()) == {"bias", "codes", "scales", "zeros"}  # the kernel's layout is not saved


def test_without_a_group_size_int4_takes_the_largest_that_divides_every_width():
    model = nn.Sequential(nn.Linear(64, 32), nn.Linear(160, 32))
    assert choose_group_size(model, "int4", None) == 32
    assert choose_group_size(nn.Sequential(nn.Linear(512, 32)), "int4", None) == 128
    assert choose_group_size(model, "int8", None) == 0


@pytest.mark.parametrize("scheme, group_size, message", [
    ("int3", None, "--quantize = 'int3' is invalid: use int8 (per-channel) or int4 (grouped)"),
    ("int4", 96, "--group-size = 96 is invalid: the int4 kernel takes group sizes 32, 64, 128, 256"),
    ("int4", 64, "--group-size = 64 is invalid: it must divide every linear's input width, and 1 has 160"),
])
def test_bad_schemes_and_group_sizes_are_refused_before_any_change(scheme, group_size, message):
    model = nn.Sequential(nn.Linear(64, 160), nn.Linear(160, 32))
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        quantize_model(model, scheme, group_size)
    assert all(type(module) is nn.Linear for module in model)


def test_int4_refuses_a_linear_whose_outputs_the_kernel_cannot_take():
    with pytest.raises(ValueError, match="0 has 24 output features .* multiples of 16; use int8"):
        quantize_model(nn.Sequential(nn.Linear(64, 24)), "int4")
