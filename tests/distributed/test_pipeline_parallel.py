"""Pipeline parallelism: parity of every schedule with one process, composition with data and
tensor parallelism, the measured order of computations against each schedule's definition, the
in-flight micro-batch bound of 1F1B, and the `shardwise report` timeline."""

import json

import pytest

from harness import assert_resumed_run_equals, check_parity, layout, run_reference, train_job
from shardwise.cli.main import main
from shardwise.config.loader import load_config
from shardwise.distributed.dims import ParallelDims
from shardwise.distributed.pipeline_parallel import schedule_available
from shardwise.distributed.pipeline_schedule import textbook_order
from shardwise.runtime.worker_pool import WorkerPool
from shardwise.observe.activations import pipeline_peak_activation_bytes
from shardwise.observe.pipeline_timeline import load_timelines
from shardwise.train.trainer import train

SCHEDULES = [
    ("gpipe", 1), ("1f1b", 1), ("interleaved-1f1b", 2), ("zero-bubble", 2),
    pytest.param("zbv", 2, marks=pytest.mark.skipif(not schedule_available("zbv"), reason="ZBV needs torch >= 2.13")),
]


def pp_layout(tmp_path, data_cache, name, n_layers, tied=False, **parallel):
    """The harness's tiny run (8 sequences, micro-batch 2) with enough blocks for every stage."""
    overrides = layout(tmp_path, data_cache, name, **parallel)
    overrides.update({"model.tie_embeddings": tied, "model.n_layers": n_layers})
    return overrides


@pytest.fixture(scope="module")
def references(tmp_path_factory, data_cache):
    """One single-process reference per model depth, shared by every layout of that depth."""
    cache = {}

    def get(n_layers, tied=False):
        if (n_layers, tied) not in cache:
            tmp = tmp_path_factory.mktemp(f"reference{n_layers}")
            cache[n_layers, tied] = run_reference(pp_layout(tmp, data_cache, "run", n_layers, tied))
        return cache[n_layers, tied]

    return get


def assert_order_follows_schedule(run_dir):
    """Each rank ran its computations in exactly the order its schedule defines, every step."""
    headers, steps = load_timelines(run_dir)
    for step, by_rank in steps.items():
        for rank, events in by_rank.items():
            ran = [(kind, stage, mb) for kind, stage, mb, _, _ in events]
            defined = [tuple(a) for a in headers[rank]["defined_order"]]
            assert ran == defined, f"step {step}, rank {rank}: ran {ran}, schedule defines {defined}"
    return headers, steps


@pytest.mark.parametrize("schedule, virtual", SCHEDULES)
def test_pp2_each_schedule_equals_one_process(pool2, tmp_path, data_cache, references, schedule, virtual):
    overrides = pp_layout(tmp_path, data_cache, schedule, 4, pp=2, pp_schedule=schedule, pp_virtual_stages=virtual)
    check_parity(pool2, overrides, references(4))
    headers, steps = assert_order_follows_schedule(overrides["run.dir"])
    assert len(steps) == 4 and sorted(headers) == [0, 1]


@pytest.mark.parametrize("schedule, virtual", SCHEDULES)
def test_pp4_each_schedule_equals_one_process(pool4, tmp_path, data_cache, references, schedule, virtual):
    overrides = pp_layout(tmp_path, data_cache, schedule, 8, pp=4, pp_schedule=schedule, pp_virtual_stages=virtual)
    check_parity(pool4, overrides, references(8))
    assert_order_follows_schedule(overrides["run.dir"])


@pytest.mark.parametrize("parallel", [
    {"pp": 2, "dp": 2, "zero": 0},
    {"pp": 2, "dp": 2, "zero": 1},
    {"pp": 2, "dp": 2, "zero": 3},
    {"pp": 2, "tp": 2},
], ids=["pp2xdp2", "pp2xdp2-zero1", "pp2xdp2-zero3", "pp2xtp2"])
def test_pp2_composes_with_data_and_tensor_parallel(pool4, tmp_path, data_cache, references, parallel):
    overrides = pp_layout(tmp_path, data_cache, "run", 4, **parallel)
    check_parity(pool4, overrides, references(4))
    if parallel.get("zero") == 1:  # really ZeRO-1: gradients reduce-scattered, optimizer states halved
        first = json.loads((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()[0])
        reduced = first["comm"]["reduce_scatter"]["bytes"]
        assert reduced > 0 and first["comm"]["all_reduce"]["bytes"] < reduced / 1000  # only norm scalars


@pytest.mark.parametrize("parallel", [
    {"pp": 2, "pp_schedule": "1f1b"},
    {"pp": 2, "pp_schedule": "interleaved-1f1b", "pp_virtual_stages": 2},
], ids=["pp2-1f1b", "pp2-interleaved"])
def test_tied_embeddings_across_two_stages_equal_one_process(pool2, tmp_path, data_cache, references, parallel):
    """The first and last stages each hold the table; their gradients are summed every step."""
    check_parity(pool2, pp_layout(tmp_path, data_cache, "run", 4, tied=True, **parallel), references(4, tied=True))


@pytest.mark.parametrize("n_layers, parallel", [
    (8, {"pp": 4}),
    (4, {"pp": 2, "dp": 2, "zero": 1}),
    (4, {"pp": 2, "dp": 2, "zero": 3}),
    (4, {"pp": 2, "tp": 2}),
], ids=["pp4", "pp2xdp2-zero1", "pp2xdp2-zero3", "pp2xtp2"])
def test_tied_embeddings_compose(pool4, tmp_path, data_cache, references, n_layers, parallel):
    overrides = pp_layout(tmp_path, data_cache, "run", n_layers, tied=True, **parallel)
    check_parity(pool4, overrides, references(n_layers, tied=True))


def test_pipeline_checkpoint_reshards_and_training_continues(pool2, pool4, tmp_path, data_cache):
    """Tied model: pp2 x dp2 zero1 (steps 1-2) -> pp2 interleaved (3-4) -> one process (5-6)
    equals one uninterrupted run: per-stage keys (and the table both end stages hold) reload
    under any layout."""
    base = pp_layout(tmp_path, data_cache, "resharded", 4, tied=True)
    base["train.steps"] = 6
    reference = train(load_config(overrides={**base, "run.dir": str(tmp_path / "uninterrupted")}))
    first = pool4.run(train_job, {**base, "parallel.pp": 2, "parallel.dp": 2, "parallel.zero": 1,
                                  "train.stop_at_step": 2})[0]["losses"]
    second = pool2.run(train_job, {**base, "parallel.pp": 2, "parallel.pp_schedule": "interleaved-1f1b",
                                   "parallel.pp_virtual_stages": 2, "train.stop_at_step": 4})[0]["losses"]
    third = train(load_config(overrides=base))
    assert third.first_step == 5
    assert_resumed_run_equals(first + second + third.losses, tmp_path / "resharded", reference)


@pytest.fixture(scope="module")
def pool8():
    with WorkerPool(8) as pool:
        yield pool


@pytest.mark.slow
@pytest.mark.parametrize("zero", [0, 3])
def test_3d_pp2_tp2_dp2_equals_one_process(pool8, tmp_path, data_cache, references, zero):
    check_parity(pool8, pp_layout(tmp_path, data_cache, "run", 4, pp=2, tp=2, dp=2, zero=zero), references(4))


@pytest.mark.parametrize("pp, m", [(2, 4), (4, 4), (4, 6)])
def test_textbook_1f1b_keeps_at_most_p_minus_r_in_flight(pp, m):
    for rank in range(pp):
        in_flight, most = 0, 0
        order = textbook_order("1f1b", rank=rank, pp=pp, micro_batches=m)
        for kind, _, _ in order:
            in_flight += 1 if kind == "F" else -1
            most = max(most, in_flight)
        assert most == min(pp - rank, m)
        assert sorted(order) == sorted(textbook_order("gpipe", rank=rank, pp=pp, micro_batches=m))


def test_1f1b_holds_fewer_activations_than_gpipe(pool2, tmp_path, data_cache):
    """Same model, 8 micro-batches: GPipe keeps all 8 micro-batches' activations on the first
    stage, 1F1B at most p = 2 of them (the peak is sampled after every forward)."""
    peaks = {}
    for schedule in ("gpipe", "1f1b"):
        overrides = pp_layout(tmp_path, data_cache, schedule, 4, pp=2, pp_schedule=schedule)
        overrides.update({"train.global_batch_size": 8, "train.micro_batch_size": 1})
        peaks[schedule] = pool2.run(pipeline_peak_activation_bytes, load_config(overrides=overrides))
    for rank in range(2):
        gpipe, one_f_one_b = peaks["gpipe"][rank]["peak_bytes"], peaks["1f1b"][rank]["peak_bytes"]
        # Equal micro-batches save equal bytes: the ratio is micro-batches in flight, 8 vs 2 - rank.
        assert gpipe / one_f_one_b == pytest.approx(8 / (2 - rank), rel=0.05)


def test_report_draws_the_timeline_and_prints_the_bubble(pool2, tmp_path, data_cache, capsys):
    overrides = pp_layout(tmp_path, data_cache, "run", 4, pp=2, pp_schedule="1f1b")
    pool2.run(train_job, overrides)
    assert main(["report", overrides["run.dir"]]) == 0
    out = capsys.readouterr().out
    assert "theory (p-1)/(v*m) = 0.250" in out  # p = 2, v = 1, m = 4
    assert "measured" in out and "rank 1" in out
    picture = tmp_path / "run" / "pipeline.png"
    assert picture.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert json.loads((tmp_path / "run" / "pipeline" / "rank0.jsonl").read_text().splitlines()[0])["header"]["pp"] == 2


@pytest.mark.parametrize("overrides, message", [
    ({"parallel.pp": 2, "model.tie_embeddings": True, "parallel.pp_schedule": "zbv",
      "parallel.pp_virtual_stages": 2},
     "model.tie_embeddings = True is invalid: zbv puts the first and last stages on one rank"),
    ({"parallel.pp": 2, "train.global_batch_size": 2},
     "train.global_batch_size = 2 is invalid: the 1f1b schedule needs at least parallel.pp = 2 micro-batches"),
    ({"parallel.pp": 4, "parallel.pp_virtual_stages": 2, "parallel.pp_schedule": "interleaved-1f1b"},
     r"parallel.pp x parallel.pp_virtual_stages = 8 stages is invalid for model.n_layers = 4"),
    ({"parallel.pp": 2, "parallel.pp_schedule": "interleaved-1f1b", "parallel.pp_virtual_stages": 2,
      "train.global_batch_size": 10},
     "5 micro-batches per rank and step must be a multiple of 2"),
])
def test_bad_pipeline_layouts_stop_before_any_work(tmp_path, data_cache, overrides, message):
    values = pp_layout(tmp_path, data_cache, "run", 4)
    values.update(overrides)
    cfg = load_config(overrides=values)
    dims = ParallelDims.from_config(cfg.parallel, cfg.parallel.pp)
    with pytest.raises(ValueError, match=message):
        dims.check(cfg)
    assert not (tmp_path / "run").exists()
