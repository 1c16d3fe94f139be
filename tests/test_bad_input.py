"""Bad input to the `shardwise` command (issue 17, item 8), each case one bad value, flag, file or path.

Every case asserts the same outcome: exit status 2; on stderr exactly one line, starting with
`shardwise: error:`, that names what is wrong (the field, flag or path and its value); and every
file and directory under the test's directory (the data files, a trained run with its
checkpoints, a Hugging Face export) byte-for-byte as it was, with nothing added. 

The one training run (2 steps of the debug model, a checkpoint after each) is trained once per
module and copied into each case that needs it; every other case stops before any work.
"""

import hashlib
import shutil
from dataclasses import dataclass
from pathlib import Path

import pytest

from shardwise.cli.main import main

ROOT = Path(__file__).resolve().parents[1]
TRAIN_FLAGS = ["--config", str(ROOT / "configs/debug.toml"), "--train.seq_len", "32", "--train.sample_tokens", "0",
               "--run.progress", "false"]
STEP_1, STEP_2 = "checkpoints/step_00000001", "checkpoints/step_00000002"


def snapshot(root: Path) -> dict[str, str | None]:
    """Every file (its SHA-256) and directory (None) under `root`, by relative path."""
    return {path.relative_to(root).as_posix(): None if path.is_dir() else hashlib.sha256(path.read_bytes()).hexdigest()
            for path in sorted(root.rglob("*"))}


@pytest.fixture(scope="module")
def trained(tmp_path_factory, data_cache):
    """A finished run (checkpoints at steps 1 and 2) and its Hugging Face export, made once."""
    root = tmp_path_factory.mktemp("trained")
    argv = ["train", "--nproc", "1", *TRAIN_FLAGS, "--data.cache_dir", data_cache, "--train.steps", "2",
            "--checkpoint.every", "1", "--run.dir", str(root / "run")]
    assert main(argv) == 0
    assert main(["convert", "--to-hf", str(root / "run"), "--out", str(root / "hf")]) == 0
    assert (root / "run" / STEP_2 / "manifest.json").is_file() and (root / "hf/config.json").is_file()
    return root


@dataclass
class Case:
    """What a case's argv is built from: the test's directory, and copies of the trained run and its export."""

    tmp: Path
    cache: str
    trained: Path | None

    def train(self, *flags: str, nproc: str = "1") -> list[str]:
        return ["train", "--nproc", nproc, *TRAIN_FLAGS, "--data.cache_dir", self.cache, "--train.steps", "2",
                "--run.dir", str(self.tmp / "run"), *flags]

    def file(self, name: str, content: str | bytes) -> str:
        path = self.tmp / "data" / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(content.encode() if isinstance(content, str) else content)
        return str(path)

    def dir(self, name: str, files: dict[str, str] | None = None) -> str:
        path = self.tmp / name
        path.mkdir(parents=True, exist_ok=True)
        for file_name, text in (files or {}).items():
            (path / file_name).write_text(text)
        return str(path)

    def copy(self, name: str, target: str | None = None) -> str:
        """A copy of the trained run ("run") or its export ("hf") under the test's directory."""
        destination = self.tmp / (target or name)
        if not destination.exists():
            shutil.copytree(self.trained / name, destination)
        return str(destination)

    @property
    def run(self) -> str:
        return self.copy("run")

    def run_without_checkpoints(self) -> str:
        return self.dir("fresh", {name: (self.trained / "run" / name).read_text()
                                  for name in ("config.json", "tokenizer.json")})


def run_cli(argv: list[str]) -> int:
    try:
        return main(argv)
    except SystemExit as exit_info:
        return exit_info.code


def check_bad_input(make_argv, message: str, tmp_path: Path, data_cache: str, trained, capsys) -> None:
    argv = make_argv(Case(tmp_path, data_cache, trained))
    before = snapshot(tmp_path)
    capsys.readouterr()
    status = run_cli(argv)
    err = capsys.readouterr().err
    assert status == 2, err
    assert err.startswith("shardwise: error: ") and err.count("\n") == 1 and err.endswith("\n"), err
    assert "Traceback" not in err
    assert message in err, err
    assert snapshot(tmp_path) == before  # nothing that existed changed, nothing was added


def cases(*params):
    return pytest.mark.parametrize("make_argv, message", params)


@pytest.fixture
def no_launch(monkeypatch):
    """`train --nproc 2` checks before launching; a case that got as far as launching fails, without launching."""
    import shardwise.runtime.launch as launch

    def refuse(*args, **kwargs):
        raise AssertionError("the bad input was not caught before launching the workers")

    monkeypatch.setattr(launch, "launch_local", refuse)


# ---- config values: types, ranges, unknown fields, files, layouts against the process count ----

@cases(
    pytest.param(lambda c: c.train("--model.dim", "-64"), "model.dim = -64 is invalid: use a positive integer",
                 id="negative-dim"),
    pytest.param(lambda c: c.train("--data.vocab_size", "100"), "data.vocab_size = 100 is invalid: use at least",
                 id="vocab-below-bytes"),
    pytest.param(lambda c: c.train("--train.stall_timeout_s", "-1"), "train.stall_timeout_s = -1.0 is invalid",
                 id="negative-stall-timeout"),
    pytest.param(lambda c: c.train("--train.preempt_signals", "SIGTERM,SIGKILL"),
                 "train.preempt_signals = 'SIGTERM,SIGKILL' is invalid: SIGKILL is not a signal that can be caught",
                 id="uncatchable-preempt-signal"),
    pytest.param(lambda c: c.train("--train.device", "tpu"), "train.device = 'tpu' is invalid", id="unknown-device"),
    pytest.param(lambda c: c.train(nproc="0"), "--nproc = '0' is invalid: use auto or a positive integer",
                 id="nproc-zero"),
    pytest.param(lambda c: c.train("--train.micro_batch_size", "3"),
                 "train.global_batch_size = 4 is invalid: use a multiple of train.micro_batch_size (3)",
                 id="micro-batch-does-not-divide"),
    pytest.param(lambda c: c.train("--parallel.tp", "2"),
                 "parallel: tp*cp*pp = 2*1*1 = 2 does not divide the process count 1", id="tp-over-one-process"),
    pytest.param(lambda c: c.train("--config", c.file("dup.toml", "[train]\nsteps = 1\nsteps = 2\n")),
                 "dup.toml' is not valid TOML (Cannot overwrite a value", id="toml-duplicate-key"),
    pytest.param(lambda c: c.train("--config", c.file("list.toml", "[train]\nlr = [1, 2]\n")),
                 "train.lr = [1, 2] is invalid: expected a value of type float", id="toml-list-for-float"),
    pytest.param(lambda c: c.train("--config", c.file("flat.toml", "train = 3\n")),
                 "train = 3 is invalid: expected a [train] table", id="toml-section-not-a-table"),
    pytest.param(lambda c: c.train("--config", c.file("typo.toml", "[model]\ndimm = 64\n")),
                 "model.dimm is not a config field; did you mean 'model.dim'?", id="toml-unknown-field"),
    pytest.param(lambda c: c.train("--config", c.file("run.json", '{"train": {"steps": 2,}}')),
                 "run.json' is not valid JSON", id="json-config-syntax"),
    pytest.param(lambda c: c.train("--config", c.dir("configs")),
                 "configs' is a directory; pass a TOML file", id="config-is-a-directory"),
    pytest.param(lambda c: c.train("--train.lr", "fast"), "--train.lr", id="cli-float-not-a-number"),
    pytest.param(lambda c: c.train("--train.stepz", "3"), "--train.stepz", id="cli-unknown-flag"),
    pytest.param(lambda c: c.train("--train.float8", "e4m3"), "train.float8 = 'e4m3' is invalid: use one of none, "
                 "tensorwise, rowwise", id="float8-unknown-recipe"),
    pytest.param(lambda c: c.train("--train.float8", "rowwise"), "train.float8 = 'rowwise' is invalid: float8 "
                 "training needs train.compile = true", id="float8-without-compile"),
    pytest.param(lambda c: c.train("--train.float8", "tensorwise", "--train.compile", "true"),
                 "FP8 training needs an NVIDIA GPU with FP8 tensor cores (compute capability 8.9 or newer: L4, L40S, "
                 "H100, H200, B200); this run trains on cpu", id="float8-on-a-cpu"),
)
def test_bad_config(make_argv, message, tmp_path, data_cache, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    check_bad_input(make_argv, message, tmp_path, data_cache, None, capsys)


@cases(
    pytest.param(lambda c: c.train("--train.global_batch_size", "6", nproc="2"),
                 "train.global_batch_size = 6 is invalid: use a multiple of train.micro_batch_size x dp = 2 x 2 = 4",
                 id="batch-does-not-divide-over-dp"),
    pytest.param(lambda c: c.train("--parallel.dp", "3", nproc="2"),
                 "dp*tp*cp*pp = 3*1*1*1 = 3 but 2 processes were launched", id="degrees-exceed-processes"),
    pytest.param(lambda c: c.train("--parallel.ep", "2", nproc="2"),
                 "parallel.ep = 2 is invalid: the model is dense", id="expert-parallel-on-dense-model"),
    pytest.param(lambda c: c.train("--train.float8", "rowwise", "--train.compile", "true", nproc="2"),
                 "this run trains on cpu", id="float8-on-cpus-before-launch"),
    pytest.param(lambda c: c.train("--train.float8", "rowwise", "--train.compile", "true", "--parallel.tp", "2",
                                   nproc="2"),
                 "float8 training does not run with tensor parallelism (parallel.tp = 2)", id="float8-with-tp"),
)
def test_bad_layout_for_the_process_count(make_argv, message, tmp_path, data_cache, capsys, monkeypatch, no_launch):
    monkeypatch.chdir(tmp_path)
    check_bad_input(make_argv, message, tmp_path, data_cache, None, capsys)


# ---- data: paths, empty, binary, malformed ----

@cases(
    pytest.param(lambda c: c.train("--data.source", str(c.tmp / "nowhere.txt")),
                 "nowhere.txt' does not exist; fix the path", id="missing-path"),
    pytest.param(lambda c: c.train("--data.source", c.file("empty.txt", "")),
                 "data.source: the corpus is empty", id="empty-file"),
    pytest.param(lambda c: c.train("--data.source", c.file("blob.txt", bytes(range(256)) * 64)),
                 "blob.txt is a binary file (a NUL byte at character 0)", id="binary-file-named-txt"),
    pytest.param(lambda c: c.train("--data.source", c.file("weights.bin", bytes(range(256)) * 64)),
                 "weights.bin' has an unsupported type '.bin'", id="binary-file-type"),
    pytest.param(lambda c: c.train("--data.source", c.file("bad.jsonl", '{"text": "fine"}\n{"text": oops}\n')),
                 "bad.jsonl:2 is not valid JSON", id="jsonl-malformed-line"),
    pytest.param(lambda c: c.train("--data.source", c.file("num.jsonl", '{"text": "fine"}\n{"text": 5}\n')),
                 "num.jsonl:2 field 'text' is a int, not text", id="jsonl-field-not-text"),
    pytest.param(lambda c: c.train("--data.source", str(Path(c.file("tables/a.csv", "a,b\n")).parent)),
                 "data.source: no .txt/.py/.md/.jsonl/.parquet files found in", id="directory-without-text"),
    pytest.param(lambda c: c.train("--data.source", c.file("tiny.txt", "hello world " * 3)),
                 "train.seq_len = 32 is longer than the corpus", id="corpus-shorter-than-a-sequence"),
    pytest.param(lambda c: c.train("--data.tokenizer", c.file("tokenizer.json", "{}")),
                 "tokenizer.json' is not a tokenizers JSON file", id="tokenizer-not-a-tokenizer"),
)
def test_bad_data(make_argv, message, tmp_path, data_cache, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    check_bad_input(make_argv, message, tmp_path, data_cache, None, capsys)


# ---- chat, instruction and preference rows (issue 38, item 8) ----

GOOD_CHAT = '{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}\n'


def rows(c, name: str, *lines: str) -> str:
    return c.file(name, "".join(lines))


@cases(
    pytest.param(lambda c: c.train("--data.format", "chat", "--data.source",
                                   rows(c, "chat.jsonl", GOOD_CHAT, '{"text": "hi"}\n')),
                 "chat.jsonl row 2 has no 'messages' (data.format = 'chat' reads rows with messages)",
                 id="chat-row-without-messages"),
    pytest.param(lambda c: c.train("--data.format", "chat", "--data.source", rows(
        c, "chat.jsonl", GOOD_CHAT, '{"messages": [{"role": "human", "content": "hi"}]}\n')),
                 "chat.jsonl row 2: messages[0].role = 'human' is not a role; use system, user, assistant",
                 id="chat-unknown-role"),
    pytest.param(lambda c: c.train("--data.format", "chat", "--data.source", rows(
        c, "chat.jsonl", '{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": ""}]}\n')),
                 "chat.jsonl row 1: messages[1] is an empty assistant turn (content = '')", id="chat-empty-assistant"),
    pytest.param(lambda c: c.train("--data.format", "prompt_completion", "--data.overlong", "error", "--data.source",
                                   rows(c, "pairs.jsonl", '{"prompt": "a", "completion": "b"}\n',
                                        '{"prompt": "a", "completion": "%s"}\n' % ("words and more " * 40))),
                 "data.overlong = 'error': {tmp}/data/pairs.jsonl row 2 is", id="row-longer-than-seq-len"),
    pytest.param(lambda c: c.train("--data.format", "preference", "--train.objective", "dpo", "--data.source",
                                   rows(c, "prefs.jsonl", '{"prompt": "a", "chosen": "b", "rejected": "c"}\n',
                                        '{"prompt": "a", "rejected": "c"}\n')),
                 "prefs.jsonl row 2 has no 'chosen' (data.format = 'preference' reads rows with prompt, chosen, "
                 "rejected)", id="preference-row-without-chosen"),
)
def test_bad_rows(make_argv, message, tmp_path, data_cache, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    check_bad_input(make_argv, message.replace("{tmp}", str(tmp_path)), tmp_path, data_cache, None, capsys)


def test_a_bad_row_is_refused_before_launching_the_ranks(tmp_path, data_cache, capsys, monkeypatch, no_launch):
    monkeypatch.chdir(tmp_path)
    check_bad_input(lambda c: c.train("--data.format", "chat", "--data.source", rows(c, "chat.jsonl", GOOD_CHAT,
                                                                                      '{"text": "hi"}\n'), nproc="2"),
                    "chat.jsonl row 2 has no 'messages'", tmp_path, data_cache, None, capsys)


# ---- resume under a changed model shape: the run's checkpoints and config stay as they were ----

CHANGED_SHAPES = [("dim", "128", "64"), ("n_layers", "3", "2"), ("vocab_size", "1024", "512")]


@pytest.mark.parametrize("field, value, saved", CHANGED_SHAPES, ids=[f[0] for f in CHANGED_SHAPES])
def test_resume_with_another_shape_is_refused_before_launch(field, value, saved, trained, tmp_path, data_cache,
                                                            capsys, no_launch):
    def argv(c):
        c.copy("run")
        return c.train("--train.steps", "4", f"--model.{field}", value, nproc="2")

    check_bad_input(argv, f"model.{field} = {value} is invalid: run.dir {tmp_path / 'run'} holds checkpoint "
                          f"step_00000002 of a model with model.{field} = {saved}", tmp_path, data_cache, trained, capsys)


@pytest.mark.parametrize("field, value, saved", CHANGED_SHAPES, ids=[f[0] for f in CHANGED_SHAPES])
def test_resume_with_another_shape_in_one_process(field, value, saved, trained, tmp_path, data_cache, capsys):
    def argv(c):
        c.copy("run")
        return c.train("--train.steps", "4", f"--model.{field}", value)

    check_bad_input(argv, f"model.{field} = {value} is invalid: run.dir {tmp_path / 'run'} holds checkpoint "
                          f"step_00000002 of a model with model.{field} = {saved}", tmp_path, data_cache, trained, capsys)


CHANGED_DATA = [
    (["--train.seq_len", "16"], "seq_len = 32 in the checkpoint but 16 now; resume with the same train.seq_len"),
    (["--train.global_batch_size", "8", "--train.micro_batch_size", "2"],
     "global_batch_size = 4 in the checkpoint but 8 now; resume with the same train.global_batch_size"),
    (["--data.max_corpus_bytes", "150000"], "data_sha256 = '"),  # "... now; resume with the same data (...)"
]


@pytest.mark.parametrize("nproc", ["1", "2"])
@pytest.mark.parametrize("flags, fragment", CHANGED_DATA, ids=["seq_len", "global_batch", "corpus"])
def test_resume_on_other_data_or_batches_is_refused(flags, fragment, nproc, trained, tmp_path, data_cache, capsys,
                                                    monkeypatch):
    import shardwise.runtime.launch as launch

    monkeypatch.setattr(launch, "launch_local", lambda *a, **k: pytest.fail("launched despite the bad input"))

    def argv(c):
        c.copy("run")
        return c.train("--train.steps", "4", *flags, nproc=nproc)

    check_bad_input(argv, f"data loader state: {fragment}", tmp_path, data_cache, trained, capsys)


# ---- generate, convert, checkpoints, report: runs and paths ----

@cases(
    pytest.param(lambda c: ["generate", "--run", c.run_without_checkpoints()], "fresh' has no checkpoint yet",
                 id="generate-run-without-checkpoints"),
    pytest.param(lambda c: ["generate", "--run", c.run, "--max-new-tokens", "0"],
                 "--max-new-tokens = 0 is invalid: ask for at least 1 token", id="generate-zero-tokens"),
    pytest.param(lambda c: ["generate", "--run", c.run, "--checkpoint", str(c.tmp / "run" / "checkpoints/step_9")],
                 "checkpoints/step_9' does not exist; pass a checkpoint directory of the run",
                 id="generate-checkpoint-missing"),
    pytest.param(lambda c: ["generate", "--run", c.run, "--checkpoint", str(Path(c.copy("run", "other")) / STEP_1)],
                 f"other/{STEP_1}' is not a checkpoint of --run", id="generate-checkpoint-of-another-run"),
    pytest.param(lambda c: ["generate", "--run", c.run, "--top-k", "-1", "--max-new-tokens", "2"],
                 "--top-k = -1 is invalid: use 0 (every token) or a positive count", id="generate-negative-top-k"),
    pytest.param(lambda c: ["generate", "--run", c.run, "--temperature", "-0.5", "--max-new-tokens", "2"],
                 "temperature = -0.5 is invalid", id="generate-negative-temperature"),
    pytest.param(lambda c: ["convert", "--from-hf", str(c.tmp / "nowhere"), "--out", str(c.tmp / "out")],
                 "--from-hf '{tmp}/nowhere' is not a directory", id="from-hf-missing-dir"),
    pytest.param(lambda c: ["convert", "--from-hf", c.dir("hf", {"tokenizer.json": "{}"}), "--out", str(c.tmp / "out")],
                 "hf' has no config.json", id="from-hf-without-config"),
    pytest.param(lambda c: ["convert", "--from-hf", c.dir("hf", {"config.json": '{"model_type": "gpt_neox"}',
                                                                "tokenizer.json": "{}"}), "--out", str(c.tmp / "out")],
                 "model_type = 'gpt_neox' is invalid: use one of llama", id="from-hf-unknown-architecture"),
    pytest.param(lambda c: ["convert", "--from-hf", c.copy("hf"), "--out", c.run],
                 "run' is invalid: it holds a run (checkpoints/), which this would overwrite", id="from-hf-into-a-run"),
    pytest.param(lambda c: ["convert", "--from-hf", c.copy("hf"), "--out", c.copy("hf")],
                 "hf' is invalid: it is the input directory", id="from-hf-onto-itself"),
    pytest.param(lambda c: ["convert", "--to-hf", c.dir("notarun", {"notes.txt": "hi"}), "--out", str(c.tmp / "out")],
                 "--to-hf '{tmp}/notarun' is not a run directory (no config.json)", id="to-hf-not-a-run"),
    pytest.param(lambda c: ["convert", "--to-hf", c.run, "--out", c.run],
                 "run' is invalid: it is the input directory", id="to-hf-onto-the-run"),
    pytest.param(lambda c: ["checkpoints", str(c.tmp / "nowhere")], "RUN_DIR = {tmp}/nowhere is not a directory",
                 id="checkpoints-missing-dir"),
    pytest.param(lambda c: ["checkpoints", str(Path(c.run) / "config.json")], "config.json is not a directory",
                 id="checkpoints-of-a-file"),
    pytest.param(lambda c: ["report", c.dir("notarun", {"notes.txt": "hi"})],
                 "RUN_DIR = {tmp}/notarun is not a run directory (no config.json)", id="report-not-a-run"),
    pytest.param(lambda c: ["report", c.run, "--step", "1"],
                 "--step = 1 is invalid: it picks the pipeline timeline to draw, and no run given has one "
                 "(parallel.pp > 1)", id="report-step-of-a-run-without-pipeline"),
    pytest.param(lambda c: ["report", c.run_without_checkpoints()],
                 "RUN_DIR = {tmp}/fresh has no metrics (metrics.jsonl is missing or empty)", id="report-run-without-metrics"),
)
def test_bad_run_inputs(make_argv, message, trained, tmp_path, data_cache, capsys):
    check_bad_input(make_argv, message.replace("{tmp}", str(tmp_path)), tmp_path, data_cache, trained, capsys)


def config_of(name: str) -> str:
    """The config.json a run of configs/<name>.toml would hold (no training: export refuses before reading more)."""
    import json

    from shardwise.config.loader import load_config

    return json.dumps(load_config(ROOT / "configs" / f"{name}.toml").to_dict())


@cases(
    pytest.param(lambda c: ["export", "--run", c.dir("bert", {"config.json": config_of("bert-demo")}), "--out",
                            str(c.tmp / "out")],
                 "bert' is a bert model, which cannot be exported: it is an encoder (masked_lm)", id="export-bert"),
    pytest.param(lambda c: ["export", "--run", c.dir("t5", {"config.json": config_of("t5-demo")}), "--out",
                            str(c.tmp / "out")],
                 "t5' is a t5 model, which cannot be exported: its decoder also attends to the encoder's output",
                 id="export-t5"),
    pytest.param(lambda c: ["export", "--run", c.dir("vit", {"config.json": config_of("vit-digits")}), "--out",
                            str(c.tmp / "new" / "out")],
                 "vit' is a vit model, which cannot be exported: it classifies images", id="export-vit"),
    pytest.param(lambda c: ["export", "--run", c.run, "--out", c.dir("taken")],
                 "--out '{tmp}/taken' already exists; choose a new directory", id="export-out-exists"),
    pytest.param(lambda c: ["export", "--run", c.run_without_checkpoints(), "--out", str(c.tmp / "new" / "out")],
                 "fresh' has no checkpoint yet", id="export-run-without-checkpoints"),
    pytest.param(lambda c: ["export", "--run", c.dir("notarun", {"notes.txt": "hi"}), "--out", str(c.tmp / "out")],
                 "notarun' has no config.json", id="export-not-a-run"),
)
def test_bad_export_inputs(make_argv, message, trained, tmp_path, data_cache, capsys):
    """Refused in one line before any work, and nothing written (not even --out's missing parents)."""
    check_bad_input(make_argv, message.replace("{tmp}", str(tmp_path)), tmp_path, data_cache, trained, capsys)


# ---- planner: estimate and plan ----

PLAN = ["plan", "--model", "llama3-8b", "--devices", "8", "--global-batch-tokens", "1048576", "--seq-len", "4096"]
ESTIMATE = ["estimate", "--model", "llama3-8b"]


def replaced(argv: list[str], flag: str, value: str) -> list[str]:
    return [value if previous == flag else word for previous, word in zip([None, *argv], argv)]


@cases(
    pytest.param(lambda c: replaced(PLAN, "--devices", "0"), "--devices = 0 is invalid: use a positive integer",
                 id="plan-zero-devices"),
    pytest.param(lambda c: replaced(PLAN, "--seq-len", "0"), "--seq-len = 0 is invalid: use a positive integer",
                 id="plan-zero-seq-len"),
    pytest.param(lambda c: [*PLAN, "--top", "0"], "--top = 0 is invalid", id="plan-zero-rows"),
    pytest.param(lambda c: [*PLAN, "--hardware", str(c.tmp / "hw.toml")], "hw.toml' is invalid: no such file",
                 id="plan-missing-hardware-file"),
    pytest.param(lambda c: [*ESTIMATE, "--layout", '{"dp": 8, "fsdp": 2}'], "layout.fsdp is invalid: not a layout field",
                 id="estimate-unknown-layout-field"),
    pytest.param(lambda c: [*ESTIMATE, "--layout", str(c.tmp / "layout.json")], "layout.json' is invalid: no such file",
                 id="estimate-missing-layout-file"),
    pytest.param(lambda c: [*ESTIMATE, "--layout", '{"dp": 8}', "--hardware", c.file("hw.toml", "[broken\n")],
                 "hw.toml is invalid TOML", id="estimate-broken-hardware-file"),
    pytest.param(lambda c: ["estimate", "--model", '{"dim": 64}', "--layout", '{"dp": 8}'],
                 "model.ffn_dim is missing", id="estimate-incomplete-model"),
    pytest.param(lambda c: ["estimate", "--jsonl", "--model", "llama3-8b"], "--jsonl reads model, layout and hardware",
                 id="estimate-jsonl-with-model"),
)
def test_bad_planner_inputs(make_argv, message, tmp_path, data_cache, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    check_bad_input(make_argv, message, tmp_path, data_cache, None, capsys)
