"""Layout validation: one line naming the field, the value and the fix."""

import pytest

from shardwise.planner.layout import Layout, layout_from_dict
from shardwise.planner.model_resolution import resolve_model

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
    ({"cp": 2, "seq_len": 6}, r"layout.seq_len = 6 is invalid: context parallelism \(ring, cp = 2\) cuts .* multiple of 4"),
    ({"dp": 2, "ep": 4}, r"layout.ep = 4 is invalid: ep is carved from the dp x cp = 2 data ranks"),
    ({"bogus": 1}, r"layout.bogus is invalid: not a layout field"),
    ({"comm_overlap": "tp,grads"}, r"layout.comm_overlap = 'tp,grads' is invalid: use a comma-separated subset of "
                                   r"tp, p2p, dp"),
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
    with pytest.raises(ValueError, match=r"layout.tp = 3 is invalid: model.n_heads = 32 does not divide by it"):
        Layout(tp=3).validate().check_against(model)
    with pytest.raises(ValueError, match=r"layout.pp = 64 is invalid: .* exceeds model.n_layers \(32\)"):
        Layout(pp=64, grad_accum=64).validate().check_against(model)
    with pytest.raises(ValueError, match=r"layout.ep = 2 is invalid: the model is dense"):
        Layout(dp=2, ep=2).validate().check_against(model)


def test_layout_choices_are_the_runtimes():
    """The planner and the config take their choices from one pure module (config/layout_rules.py)."""
    from shardwise.config import schema
    from shardwise.core import layout_rules
    from shardwise.planner import layout

    for name in ("PP_SCHEDULES", "CP_MODES"):
        assert getattr(layout, name) is getattr(layout_rules, name) is getattr(schema, name)
    assert schema.RECOMPUTE_MODES is layout_rules.RECOMPUTE_MODES
    assert set(layout.RECOMPUTE_MODES) == set(schema.RECOMPUTE_MODES)


def test_planner_runs_what_the_config_accepts():
    """Over a grid of degrees, the planner's layouts that the runtime would run (valid, and not
    refused by `runtime_refuses`) are exactly those `ParallelConfig.validate` accepts: one set of
    rules (config/layout_rules.py), not two that could drift."""
    import itertools

    from shardwise.core.layout_rules import PP_SCHEDULES
    from shardwise.config.schema import ParallelConfig
    from shardwise.planner.search import runtime_refuses

    model = resolve_model("llama3-8b")
    disagreements = []
    grid = itertools.product((1, 2, 4), (1, 2), (1, 2), (1, 2), (0, 1, 2, 3), (False, True), PP_SCHEDULES, (1, 2))
    for dp, dp_replicate, tp, pp, zero, sp, schedule, virtual in grid:
        try:
            Layout(dp=dp, dp_replicate=dp_replicate, tp=tp, pp=pp, zero=zero, sp=sp, pp_schedule=schedule,
                   virtual_stages=virtual, grad_accum=8).validate()
            planner_runs = runtime_refuses(Layout(dp=dp, dp_replicate=dp_replicate, tp=tp, pp=pp, zero=zero, sp=sp,
                                                  pp_schedule=schedule, virtual_stages=virtual,
                                                  grad_accum=8), model) is None
        except ValueError:
            planner_runs = False
        try:
            ParallelConfig(dp=dp, dp_replicate=dp_replicate, tp=tp, pp=pp, zero=zero, sp=sp, pp_schedule=schedule,
                           pp_virtual_stages=virtual).validate()
            config_runs = True
        except ValueError:
            config_runs = False
        if planner_runs != config_runs:
            disagreements.append((dp, dp_replicate, tp, pp, zero, sp, schedule, virtual, planner_runs))
    assert not disagreements, f"{len(disagreements)} layouts disagree, e.g. {disagreements[:3]}"


def test_planner_skips_moe_layouts_the_runtime_refuses():
    """Sequence parallelism with MoE blocks is a runtime limit at any ep (the experts take whole
    sequences); the planner used to refuse it only with ep > 1 and counted such layouts as fitting."""
    from shardwise.planner.search import runtime_refuses

    moe, dense = resolve_model("mixtral-8x7b"), resolve_model("llama3-8b")
    assert "MoE layers take whole sequences" in runtime_refuses(Layout(dp=2, tp=2, sp=True), moe)
    assert runtime_refuses(Layout(dp=2, tp=2, sp=True), dense) is None
    assert "HSDP with ep > 1" in runtime_refuses(Layout(dp=4, dp_replicate=2, zero=3, ep=2), moe)


def test_the_runtime_refuses_another_runtimes_overlap():
    """`comm_overlap` estimates other frameworks' runs; the search never proposes it."""
    from shardwise.planner.search import runtime_refuses

    refusal = runtime_refuses(Layout(dp=2, tp=2, sp=True, comm_overlap="tp"), resolve_model("llama3-8b"))
    assert refusal.startswith("comm_overlap = 'tp' is another runtime's overlap")
    assert refusal.endswith("leave comm_overlap empty")
