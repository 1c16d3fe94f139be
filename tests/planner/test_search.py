"""Plan search: the runtime accepts every layout it proposes; the planner needs no torch."""

import subprocess
import sys

from shardwise.planner.hardware import resolve_hardware
from shardwise.planner.model_resolution import resolve_model
from shardwise.planner.search import PlanRequest, plan, why_it_wins


def request(**overrides):
    values = dict(model=resolve_model("llama3-8b"), hardware=resolve_hardware("h100-80gb"), devices=16,
                  global_batch_tokens=2**20, seq_len=4096)
    return PlanRequest(**{**values, **overrides})


def test_every_proposed_layout_passes_the_runtime_config_validation():
    from shardwise.config.schema import ParallelConfig

    results, considered = plan(request(devices=8, model=resolve_model("llama3-1b")))
    assert considered >= len(results) > 0
    for result in results:
        layout = result.layout
        ParallelConfig(dp=layout.dp, tp=layout.tp, pp=layout.pp, zero=layout.zero, sp=layout.sp,
                       dp_replicate=layout.dp_replicate, pp_schedule=layout.pp_schedule,
                       pp_virtual_stages=layout.virtual_stages).validate()


def test_layouts_that_do_not_fit_are_dropped_and_recompute_is_used_when_needed():
    # 70B with mixed-precision Adam needs 16 bytes x 70.6e9 = 1.1 TB of states: 32 x 80 GB, split
    results, _ = plan(request(model=resolve_model("llama3-70b"), devices=32, global_batch_tokens=2**19))
    assert results and all(r.fits for r in results)
    assert all(r.layout.tp * r.layout.pp > 1 or r.layout.zero == 3 for r in results)  # 70B needs its states split
    none_fit, _ = plan(request(model=resolve_model("llama3-405b"), devices=8, global_batch_tokens=2**15))
    assert none_fit == [] and why_it_wins(none_fit).startswith("no layout fits")


def test_why_it_wins_names_the_winner():
    results, _ = plan(request())
    assert why_it_wins(results).startswith(results[0].layout.describe() + " wins at")


def test_planner_imports_and_plans_without_torch():
    code = ("import sys; sys.modules['torch'] = None\n"
            "from shardwise.planner import estimate_from_specs\n"
            "from shardwise.planner.search import PlanRequest, plan\n"
            "from shardwise.planner import resolve_model, resolve_hardware\n"
            "e = estimate_from_specs('llama3-8b', {'dp': 8, 'zero': 3}, 'h100-80gb')\n"
            "r, n = plan(PlanRequest(model=resolve_model('llama3-1b'), hardware=resolve_hardware('a100-40gb'), "
            "devices=4, global_batch_tokens=2**17, seq_len=2048))\n"
            "assert 'torch' not in [m.split('.')[0] for m in sys.modules if sys.modules[m] is not None]\n"
            "print(len(r) > 0, e.fits)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["True", "True"]
