"""Checkpoints: round trip, keep-last-k, atomicity, refusal of hostile files, resharding across ranks.

The multi-process cases share one world of 4 gloo processes, started once for this module.
"""

import contextlib
import json
import os
import pickle
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint import metadata as dcp_metadata

from shardwise.checkpoint import store as ckpt
from shardwise.checkpoint.store import (
    checkpoint_dirs,
    checkpoint_tensor_shapes,
    latest_checkpoint,
    load_checkpoint,
    load_model_weights,
    save_checkpoint,
)
from shardwise.checkpoint.integrity import checkpoint_status

WORLD_SIZE = 4


def sample_tensors() -> dict[str, torch.Tensor]:
    """Keys as the trainer writes them; 5 rows and 1 element do not divide over 4 ranks."""
    gen = torch.Generator().manual_seed(0)
    return {
        "model/layers.0.attn.q_proj.weight": torch.randn(5, 3, generator=gen),
        "model/norm.weight": torch.randn(1, generator=gen),
        "model/wide": torch.randn(4, 6, generator=gen),
        "optim/layers.0.attn.q_proj.weight/exp_avg": torch.randn(5, 3, generator=gen).to(torch.bfloat16),
    }


def replicated_tensors() -> dict[str, torch.Tensor]:
    return {"optim/step": torch.tensor(12.0), "rng/tokens": torch.arange(7, dtype=torch.int64)}


def zeros_like_all(tensors):
    return {key: torch.zeros_like(value) for key, value in tensors.items()}


def assert_equal_tensors(actual, expected):
    assert actual.keys() == expected.keys()
    for key in expected:
        assert actual[key].dtype == expected[key].dtype, key
        torch.testing.assert_close(actual[key], expected[key], rtol=0, atol=0, msg=key)


# ------------------------------------------------------------------------------ single process

def test_round_trip_of_plain_tensors(tmp_path):
    tensors = {**sample_tensors(), **replicated_tensors()}
    path = save_checkpoint(tmp_path, 100, tensors=tensors, state={"loader": {"epoch": 2}}, keep=3)
    assert path == tmp_path / "checkpoints/step_00000100"
    assert latest_checkpoint(tmp_path) == path
    loaded = zeros_like_all(tensors)
    targets = dict(loaded)
    state = load_checkpoint(path, tensors=loaded)
    assert state == {"loader": {"epoch": 2}, "step": 100}
    assert_equal_tensors(loaded, tensors)
    assert all(loaded[key] is targets[key] for key in loaded)  # filled in place
    assert checkpoint_tensor_shapes(path)["model/layers.0.attn.q_proj.weight"] == (5, 3)
    assert checkpoint_tensor_shapes(path)["optim/step"] == ()


def test_loads_only_the_requested_keys(tmp_path):
    tensors = sample_tensors()
    path = save_checkpoint(tmp_path, 1, tensors=tensors, state={}, keep=1)
    model_only = {key: value for key, value in tensors.items() if key.startswith("model/")}
    loaded = zeros_like_all(model_only)
    load_checkpoint(path, tensors=loaded)
    assert_equal_tensors(loaded, model_only)


def test_keeps_the_newest_k(tmp_path):
    for step in (1, 2, 3, 4):
        save_checkpoint(tmp_path, step, tensors={"w": torch.full((2,), float(step))}, state={}, keep=2)
    assert [p.name for p in checkpoint_dirs(tmp_path)] == ["step_00000003", "step_00000004"]
    # Saving a step again replaces it.
    save_checkpoint(tmp_path, 4, tensors={"w": torch.full((2,), 40.0)}, state={}, keep=2)
    loaded = {"w": torch.zeros(2)}
    load_checkpoint(latest_checkpoint(tmp_path), tensors=loaded)
    assert loaded["w"].tolist() == [40.0, 40.0]
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step_00000003", "step_00000004"]


def test_checkpoint_dirs_lists_only_complete_checkpoints(tmp_path):
    assert checkpoint_dirs(tmp_path) == [] and latest_checkpoint(tmp_path) is None
    save_checkpoint(tmp_path, 5, tensors={"w": torch.ones(2)}, state={}, keep=5)
    (tmp_path / "checkpoints/step_00000009").mkdir()  # no metadata, no state.json
    (tmp_path / "checkpoints/.step_00000010.partial").mkdir()
    assert [p.name for p in checkpoint_dirs(tmp_path)] == ["step_00000005"]


def fail_in_dcp_write(monkeypatch):
    def write_data(self, plan, planner):
        raise OSError("disk full")
    monkeypatch.setattr(FileSystemWriter, "write_data", write_data)


def rename_fails(partial, final):
    raise OSError("rename failed")


def fail_in_rename(monkeypatch):
    monkeypatch.setattr(ckpt, "move_into_place", rename_fails)


@pytest.mark.parametrize("fail", [fail_in_dcp_write, fail_in_rename])
def test_a_failed_save_leaves_the_earlier_checkpoint_and_nothing_else(tmp_path, monkeypatch, fail):
    earlier = save_checkpoint(tmp_path, 1, tensors={"w": torch.ones(3)}, state={"a": 1}, keep=1)
    fail(monkeypatch)
    with pytest.raises((RuntimeError, OSError), match="disk full|rename failed"):
        save_checkpoint(tmp_path, 2, tensors={"w": torch.zeros(3)}, state={"a": 2}, keep=1)
    assert checkpoint_dirs(tmp_path) == [earlier]
    assert [p.name for p in (tmp_path / "checkpoints").iterdir()] == [earlier.name]
    loaded = {"w": torch.zeros(3)}
    assert load_checkpoint(earlier, tensors=loaded) == {"a": 1, "step": 1}
    assert loaded["w"].tolist() == [1.0, 1.0, 1.0]


def test_a_crashed_save_is_cleaned_up_by_the_next(tmp_path):
    leftover = tmp_path / "checkpoints/.step_00000007.partial"
    leftover.mkdir(parents=True)
    (leftover / "__0_0.distcp").write_bytes(b"half")
    save_checkpoint(tmp_path, 8, tensors={"w": torch.ones(1)}, state={}, keep=1)
    assert [p.name for p in (tmp_path / "checkpoints").iterdir()] == ["step_00000008"]


def test_missing_key_names_keys_and_the_fix(tmp_path):
    path = save_checkpoint(tmp_path, 1, tensors={"model/a": torch.ones(2)}, state={}, keep=1)
    requested = {"model/a": torch.zeros(2), "model/b": torch.zeros(2), "optim/a/exp_avg": torch.zeros(2)}
    with pytest.raises(ValueError, match=r"lacks 2 requested tensors \(e.g. \['model/b', 'optim/a/exp_avg'\]\); "
                                         r"request only keys it has"):
        load_checkpoint(path, tensors=requested)
    assert requested["model/a"].tolist() == [0.0, 0.0]  # nothing was loaded


def test_shape_mismatch_names_key_and_shapes(tmp_path):
    path = save_checkpoint(tmp_path, 1, tensors={"model/a": torch.ones(2, 3)}, state={}, keep=1)
    with pytest.raises(ValueError, match=r"has 'model/a' of shape \(2, 3\), requested \(3, 2\); build the model"):
        load_checkpoint(path, tensors={"model/a": torch.zeros(3, 2)})


@pytest.mark.parametrize("keep", [0, -1])
def test_keep_below_one_is_refused_before_writing(tmp_path, keep):
    with pytest.raises(ValueError, match=f"keep = {keep} is invalid: keep at least 1"):
        save_checkpoint(tmp_path, 1, tensors={"w": torch.ones(1)}, state={}, keep=keep)
    assert list(tmp_path.iterdir()) == []


def test_a_directory_without_metadata_is_refused(tmp_path):
    with pytest.raises(ValueError, match=r"has no \.metadata; pass a complete checkpoint directory"):
        load_checkpoint(tmp_path, tensors={"w": torch.zeros(1)})


class RunsCodeWhenUnpickled:
    def __init__(self, call, args):
        self.call, self.args = call, args

    def __reduce__(self):
        return self.call, self.args


def hostile_payloads(marker: Path):
    return {
        "os.system": RunsCodeWhenUnpickled(os.system, (f"touch {marker}",)),
        "builtins.open": RunsCodeWhenUnpickled(open, (str(marker), "w")),
        # pathlib.PosixPath is allowed (as a pure path); a method reached through it is not.
        "Path.touch": RunsCodeWhenUnpickled(Path.touch, (Path(marker),)),
    }


@pytest.mark.parametrize("payload", ["os.system", "builtins.open", "Path.touch"])
def test_hostile_metadata_is_refused_without_running_it(tmp_path, payload):
    path = save_checkpoint(tmp_path, 1, tensors={"w": torch.ones(1)}, state={}, keep=1)
    marker = tmp_path / "pwned"
    (path / ".metadata").write_bytes(pickle.dumps(hostile_payloads(marker)[payload]))

    with contextlib.suppress(AttributeError):  # raised after the payload ran
        FileSystemReader(path).read_metadata()  # DCP's own reader runs it: the payload is real
    assert marker.exists()
    marker.unlink()

    with pytest.raises(ValueError, match=r"\.metadata' was refused \(refers to .*which DCP metadata never does\)"):
        load_checkpoint(path, tensors={"w": torch.zeros(1)})
    with pytest.raises(ValueError, match="was refused"):
        checkpoint_tensor_shapes(path)
    assert not marker.exists()


def rewrite_metadata(path: Path, change) -> None:
    metadata = FileSystemReader(path).read_metadata()
    change(metadata)
    (path / ".metadata").write_bytes(pickle.dumps(metadata))


def test_a_tensor_recorded_as_a_pickled_object_is_refused(tmp_path):
    """DCP's planner would torch.load(weights_only=False) such an entry."""
    path = save_checkpoint(tmp_path, 1, tensors={"w": torch.ones(1)}, state={}, keep=1)
    rewrite_metadata(path, lambda md: md.state_dict_metadata.__setitem__("w", dcp_metadata.BytesStorageMetadata()))
    with pytest.raises(ValueError, match="stores 'w' as a pickled object, not a tensor"):
        load_checkpoint(path, tensors={"w": torch.zeros(1)})


def test_a_pickled_entry_is_not_unpickled_even_past_the_key_check(tmp_path, monkeypatch):
    """The planner's own guard: DCP's default planner runs the payload, ours refuses it."""
    path = save_checkpoint(tmp_path, 1, tensors={"w": torch.ones(1)}, state={}, keep=1)
    marker = tmp_path / "pwned"
    payload = pickle.dumps(hostile_payloads(marker)["builtins.open"])
    (path / "evil.bin").write_bytes(payload)

    def store_w_as_pickle(metadata):
        metadata.state_dict_metadata["w"] = dcp_metadata.BytesStorageMetadata()
        metadata.storage_data = {dcp_metadata.MetadataIndex("w"): _StorageInfo("evil.bin", 0, len(payload))}

    rewrite_metadata(path, store_w_as_pickle)
    with contextlib.suppress(BaseException), warnings.catch_warnings():  # fails after the payload ran
        warnings.simplefilter("ignore")
        dcp.load({"w": torch.zeros(1)}, checkpoint_id=path, no_dist=True)
    assert marker.exists()
    marker.unlink()

    monkeypatch.setattr(ckpt, "check_requested_tensors", lambda *args: None)
    with pytest.raises(RuntimeError, match="checkpoint entry 'w' is a pickled object"):
        load_checkpoint(path, tensors={"w": torch.zeros(1)})
    assert not marker.exists()


def test_data_files_outside_the_checkpoint_are_refused(tmp_path):
    path = save_checkpoint(tmp_path, 1, tensors={"w": torch.ones(1)}, state={}, keep=1)

    def point_outside(metadata):
        for info in metadata.storage_data.values():
            info.relative_path = "../../elsewhere.distcp"

    rewrite_metadata(path, point_outside)
    with pytest.raises(ValueError, match=r"names data file '../../elsewhere.distcp' outside itself"):
        load_checkpoint(path, tensors={"w": torch.zeros(1)})


def test_load_model_weights_fills_a_model_built_on_meta(tmp_path):
    torch.manual_seed(0)
    source = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2))
    tensors = {f"model/{name}": value for name, value in source.state_dict().items()}
    path = save_checkpoint(tmp_path, 3, tensors={**tensors, "optim/x": torch.ones(1)}, state={}, keep=1)
    with torch.device("meta"):
        target = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2))
    target.to_empty(device="cpu")
    load_model_weights(path, target)
    assert_equal_tensors(target.state_dict(), source.state_dict())

    smaller = torch.nn.Sequential(torch.nn.Linear(3, 4))
    with pytest.raises(ValueError, match=r"has weights the model lacks \(e.g. \['model/1.bias', 'model/1.weight'\]\)"):
        load_model_weights(path, smaller)


# ------------------------------------------------------------------------------ multi-process

@pytest.fixture(scope="module")
def world(pool4):
    """The session's 4 gloo ranks (tests/conftest.py)."""
    return pool4


def distribute(tensors, mesh, placements):
    from torch.distributed.tensor import distribute_tensor

    return {key: distribute_tensor(value, mesh, placements) for key, value in tensors.items()}


def save_sharded_over_all_ranks(run_dir, step, keep):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard

    mesh = init_device_mesh("cpu", (WORLD_SIZE,))
    tensors = {**distribute(sample_tensors(), mesh, [Shard(0)]), **replicated_tensors()}
    return save_checkpoint(Path(run_dir), step, tensors=tensors, state={"step_from": "world"}, keep=keep)


def load_sharded_over_two_ranks(checkpoint):
    """A (2, 2) mesh: every tensor is split over 2 ranks (of a different axis for 'wide') and replicated over 2."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard

    mesh = init_device_mesh("cpu", (2, 2))
    full = sample_tensors()
    tensors = {**distribute(zeros_like_all({k: v for k, v in full.items() if k != "model/wide"}),
                            mesh, [Shard(0), Replicate()]),
               **distribute(zeros_like_all({"model/wide": full["model/wide"]}), mesh, [Shard(1), Replicate()]),
               **zeros_like_all(replicated_tensors())}
    state = load_checkpoint(Path(checkpoint), tensors=tensors)
    local_rows = tensors["model/layers.0.attn.q_proj.weight"].to_local().shape[0]
    loaded = {key: value.full_tensor() if hasattr(value, "full_tensor") else value for key, value in tensors.items()}
    return state, local_rows, loaded


def load_sharded_over_all_ranks(checkpoint):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard

    mesh = init_device_mesh("cpu", (WORLD_SIZE,))
    tensors = distribute(zeros_like_all(sample_tensors()), mesh, [Shard(0)])
    load_checkpoint(Path(checkpoint), tensors=tensors)
    return {key: value.full_tensor() for key, value in tensors.items()}


def test_saved_over_4_ranks_loads_over_2_and_in_one_process(world, tmp_path):
    run_dir = tmp_path / "run"
    for step in (1, 2, 3):
        paths = world.run(save_sharded_over_all_ranks, str(run_dir), step, 2)
    assert paths == [run_dir / "checkpoints/step_00000003"] * WORLD_SIZE
    assert [p.name for p in checkpoint_dirs(run_dir)] == ["step_00000002", "step_00000003"]
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["step_00000002", "step_00000003"]
    path = paths[0]
    written = sorted([".metadata", "state.json"] + [f"__{rank}_0.distcp" for rank in range(WORLD_SIZE)])
    assert sorted(p.name for p in path.iterdir()) == sorted([*written, "manifest.json"])
    # every rank's file is in the manifest (each rank hashed its own) and checks out
    assert sorted(json.loads((path / "manifest.json").read_text())["files"]) == written
    assert checkpoint_status(path) == ("ok", "")

    expected = {**sample_tensors(), **replicated_tensors()}
    for state, local_rows, loaded in world.run(load_sharded_over_two_ranks, str(path)):
        assert state == {"step_from": "world", "step": 3}
        assert local_rows in (3, 2)  # 5 rows over 2 ranks
        assert_equal_tensors(loaded, expected)

    single = zeros_like_all(expected)
    assert load_checkpoint(path, tensors=single)["step"] == 3
    assert_equal_tensors(single, expected)


def test_replicated_tensors_from_every_rank_are_written_once(world, tmp_path):
    path = world.run(save_sharded_over_all_ranks, str(tmp_path), 1, 1)[0]
    chunks = {key: FileSystemReader(path).read_metadata().state_dict_metadata[key].chunks
              for key in replicated_tensors()}
    assert {key: len(found) for key, found in chunks.items()} == {"optim/step": 1, "rng/tokens": 1}
    loaded = zeros_like_all(replicated_tensors())
    load_checkpoint(path, tensors=loaded)
    assert_equal_tensors(loaded, replicated_tensors())


def save_while_rank_0_fails_to_rename(run_dir):
    """Every rank must raise (none may wait forever for rank 0), and rank 0 must clean up."""
    import torch.distributed as dist

    original = ckpt.move_into_place
    if dist.get_rank() == 0:
        ckpt.move_into_place = rename_fails
    try:
        save_sharded_over_all_ranks(run_dir, 2, 1)
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"
    finally:
        ckpt.move_into_place = original
    return "saved"


def test_a_failed_collective_save_raises_on_every_rank(world, tmp_path):
    earlier = world.run(save_sharded_over_all_ranks, str(tmp_path), 1, 1)[0]
    outcomes = world.run(save_while_rank_0_fails_to_rename, str(tmp_path))
    assert outcomes[0] == "OSError: rename failed"
    assert outcomes[1:] == [f"RuntimeError: rank 0 failed to finish checkpoint "
                            f"{tmp_path / 'checkpoints/step_00000002'}: OSError: rename failed"] * (WORLD_SIZE - 1)
    assert [p.name for p in (tmp_path / "checkpoints").iterdir()] == [earlier.name]


def test_saved_in_one_process_loads_sharded_over_4_ranks(world, tmp_path):
    """`shardwise convert` writes a single-process checkpoint that a distributed run then loads."""
    path = save_checkpoint(tmp_path, 0, tensors=sample_tensors(), state={"loader": None}, keep=1)
    for loaded in world.run(load_sharded_over_all_ranks, str(path)):
        assert_equal_tensors(loaded, sample_tensors())
