"""The commands that load a run's newest checkpoint (generate, serve, predict, convert: all through
`load_run`) say which newer checkpoint they skipped and why, as training does: one warning line on
stderr naming it, and then the previous checkpoint is used."""

import shutil

import pytest

from shardwise.cli.main import main
from shardwise.infer.load import load_run

STEP_1, STEP_2 = "checkpoints/step_00000001", "checkpoints/step_00000002"


@pytest.fixture(scope="module")
def trained(tmp_path_factory, data_cache):
    """A run of the debug model with checkpoints at steps 1 and 2, trained once."""
    run_dir = tmp_path_factory.mktemp("choice") / "run"
    assert main(["train", "--nproc", "1", "--model.preset", "debug", "--data.vocab_size", "512",
                 "--data.max_corpus_bytes", "200000", "--data.cache_dir", data_cache, "--train.seq_len", "32",
                 "--train.global_batch_size", "2", "--train.micro_batch_size", "2", "--train.steps", "2",
                 "--train.sample_tokens", "0", "--checkpoint.every", "1", "--run.progress", "false",
                 "--run.dir", str(run_dir)]) == 0
    return run_dir


def garble(path):
    path.write_bytes(b"\x80" * path.stat().st_size)


DAMAGES = {
    "metadata missing": (lambda step: (step / ".metadata").unlink(), "incomplete (.metadata is missing)"),
    "state missing": (lambda step: (step / "state.json").unlink(), "incomplete (state.json is missing)"),
    "metadata garbled": (lambda step: garble(step / ".metadata"), "corrupt (.metadata does not match"),
    "no manifest": (lambda step: (step / "manifest.json").unlink(), "incomplete (no manifest.json"),
}


@pytest.fixture(params=sorted(DAMAGES))
def damaged_run(request, trained, tmp_path):
    run_dir = tmp_path / "run"
    shutil.copytree(trained, run_dir)
    damage, reason = DAMAGES[request.param]
    damage(run_dir / STEP_2)
    return run_dir, reason


def skip_warnings(err: str) -> list[str]:
    return [line for line in err.splitlines() if line.startswith("shardwise: warning: skipping checkpoint")]


def test_load_run_names_the_checkpoint_it_skipped_and_uses_the_previous(damaged_run, capsys, monkeypatch):
    import shardwise.infer.load as load

    run_dir, reason = damaged_run
    loaded = []
    monkeypatch.setattr(load, "load_model_weights", lambda checkpoint, model: loaded.append(checkpoint.name))
    load_run(run_dir)
    (line,) = skip_warnings(capsys.readouterr().err)
    assert str(run_dir / STEP_2) in line and reason in line
    assert loaded == ["step_00000001"]


@pytest.mark.parametrize("command", ["generate", "convert"])
def test_generate_and_convert_say_which_checkpoint_they_skipped(trained, tmp_path, capsys, command):
    run_dir = tmp_path / "run"
    shutil.copytree(trained, run_dir)
    (run_dir / STEP_2 / ".metadata").unlink()
    argv = {"generate": ["generate", "--run", str(run_dir), "--max-new-tokens", "2"],
            "convert": ["convert", "--to-hf", str(run_dir), "--out", str(tmp_path / "hf")]}[command]
    capsys.readouterr()
    assert main(argv) == 0
    err = capsys.readouterr().err
    (line,) = skip_warnings(err)
    assert str(run_dir / STEP_2) in line and "trying an older checkpoint" in line
    assert "Traceback" not in err
