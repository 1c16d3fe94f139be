"""Layout validation: one line naming the field, the value and the fix."""

import pytest

from shardwise.planner.layout import Layout, layout_from_dict
from shardwise.planner.model_shape import resolve_model

CASES = [
    ({"tp": 0}, r"layout.tp = 0 is invalid: use a positive integer"),
    ({"zero": 4}, r"layout.zero = 4 is invalid: use 0, 1, 2 or 3"),
    ({"recompute": "some"}, r"layout.recompute = 'some' is invalid: use one of none, selective, full"),
    ({"pp_schedule": "2f2b"}, r"layout.pp_schedule = '2f2b' is invalid"),
    ({"dtype": "fp16"}, r"layout.dtype = 'fp16' is invalid: use bf16 or fp32"),
    ({"sp": True}, r"layout.sp = True is invalid: sequence parallelism needs tp > 1"),
    ({"dp": 4, "dp_replicate": 2}, r"layout.dp_replicate = 2 is invalid: HSDP .* set zero = 3"),
    ({"pp": 2, "virtual_stages": 2, "grad_accum": 2}, r"layout.virtual_stages = 2 is invalid: 1f1b runs one stage"),
    ({"pp": 2, "zero": 2, "grad_accum": 2}, r"layout.zero = 2 is invalid: ZeRO-2 frees gradients"),
    ({"cp": 2, "seq_len": 6}, r"layout.seq_len = 6 is invalid: context parallelism cuts .* multiple of 4"),
    ({"dp": 2, "ep": 4}, r"layout.ep = 4 is invalid: .* divisor of dp\*cp = 2"),
    ({"bogus": 1}, r"layout.bogus is invalid: not a layout field"),
]


@pytest.mark.parametrize("values, message", CASES)
def test_bad_layouts_are_refused_with_one_line(values, message):
    with pytest.raises(ValueError, match=message) as err:
        layout_from_dict(values)
    assert "\n" not in str(err.value)


def test_missing_fields_take_defaults_and_aliases_work():
    layout = layout_from_dict({"dp": 2, "mbs": 4, "grad_acc": 8, "dtype": "bfloat16"})
    assert (layout.micro_batch, layout.grad_accum, layout.dtype, layout.tp, layout.recompute) == (4, 8, "bf16", 1, "none")
    assert layout.tokens_per_step == 2 * 4 * 8 * 4096


def test_layout_against_the_model_shape():
    model = resolve_model("llama3-8b")
    with pytest.raises(ValueError, match=r"layout.tp = 3 is invalid: use a divisor of model.n_heads \(32\)"):
        Layout(tp=3).validate().check_against(model)
    with pytest.raises(ValueError, match=r"layout.pp = 64 is invalid: .* exceeds model.n_layers \(32\)"):
        Layout(pp=64, grad_accum=64).validate().check_against(model)
    with pytest.raises(ValueError, match=r"layout.ep = 2 is invalid: the model is dense"):
        Layout(dp=2, ep=2).validate().check_against(model)


def test_layout_choices_are_the_runtimes():
    """The planner and the config take their choices from one pure module (config/layout_rules.py)."""
    from shardwise.config import layout_rules, schema
    from shardwise.planner import layout

    for name in ("PP_SCHEDULES", "CP_MODES"):
        assert getattr(layout, name) is getattr(layout_rules, name) is getattr(schema, name)
    assert layout.INTERLEAVED_SCHEDULES is layout_rules.INTERLEAVED_SCHEDULES
    assert schema.RECOMPUTE_MODES is layout_rules.RECOMPUTE_MODES
    assert set(layout.RECOMPUTE_MODES) == set(schema.RECOMPUTE_MODES)
