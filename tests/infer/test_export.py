"""`shardwise export` (issue 40, item 4): the package runs without shardwise and generates the tokens
`shardwise generate` does. Bad input (families that cannot be exported, --out that exists, a run
without checkpoints) is in tests/test_bad_input.py.

One tiny trained run, exported once for the module (the AOTInductor compile of both programs is most
of the time: ~40-60 s on 2 shared cores)."""

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

from shardwise.cli.main import main
from shardwise.generation.engine import generate_all
from shardwise.generation.sampling import SamplingParams
from shardwise.infer.commands import generate_results
from shardwise.infer.load import open_engine
from serving_run import train_serving_run

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "run_exported.py"
PROMPTS = ["def main():\n    ", "import ", "class Reader(object):\n    def ", "for i in range(", "x"]
MAX_NEW_TOKENS = 24
pytestmark = pytest.mark.slow  # every test here needs the trained run (~8 s), the first also its export (~45 s)
CHAT_TEMPLATE = "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}assistant:"


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory, data_cache):
    return train_serving_run(tmp_path_factory.mktemp("export") / "run", data_cache, steps=150, **{"run.name": "tiny"})


@pytest.fixture(scope="module")
def exported(run_dir):
    (run_dir / "chat_template.jinja").write_text(CHAT_TEMPLATE)  # travels with the tokenizer
    out = run_dir.parent / "exported"
    import torch._inductor.config

    # The generated wrapper (glue between kernels, which are compiled as always) built at -O0, not -O1:
    # the same tokens, a quarter less compile time for the test; users get the default.
    with torch._inductor.config.patch({"aot_inductor.compile_wrapper_opt_level": "O0"}):
        assert main(["export", "--run", str(run_dir), "--out", str(out)]) == 0
    return out


def load_example():
    """examples/run_exported.py as a module (its `load` and `generate`, in this process)."""
    spec = importlib.util.spec_from_file_location("run_exported", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def engine_tokens(run_dir: Path, prompt_ids: list[list[int]]) -> list[list[int]]:
    _, engine, _ = open_engine(run_dir, device_name="cpu", max_batch=len(prompt_ids))
    try:
        seqs = generate_all(engine, prompt_ids, SamplingParams(max_tokens=MAX_NEW_TOKENS, temperature=0.0))
    finally:
        engine.runner.close()
    return [seq.output_ids for seq in seqs]


def test_exported_package_generates_what_generate_does(exported, run_dir, tmp_path):
    manifest = json.loads((exported / "manifest.json").read_text())
    assert sorted(path.name for path in exported.iterdir()) == ["chat_template.jinja", "manifest.json", "model.pt2",
                                                               "tokenizer.json"]
    assert (exported / "chat_template.jinja").read_text() == CHAT_TEMPLATE
    assert manifest["chat_template_files"] == ["chat_template.jinja"]
    assert [path.name for path in exported.parent.iterdir() if path.name.startswith(".")] == []  # no staging left
    assert (manifest["model_name"], manifest["family"], manifest["dtype"]) == ("tiny", "llama", "float32")
    assert (manifest["vocab_size"], manifest["max_seq_len"], manifest["programs"]) == (512, 128, ["prefill", "decode"])

    # The example, run as a user would: every prompt in one batch (B = 5, prompts of 1 to 9 tokens, left-padded).
    argv = [sys.executable, str(EXAMPLE), str(exported), "--max-new-tokens", str(MAX_NEW_TOKENS), "--json"]
    for prompt in PROMPTS:
        argv += ["--prompt", prompt]
    lines = subprocess.run(argv, capture_output=True, text=True, check=True, cwd=tmp_path).stdout.splitlines()
    batched = [json.loads(line) for line in lines]

    prompts_file = tmp_path / "prompts.jsonl"
    prompts_file.write_text("".join(json.dumps(prompt) + "\n" for prompt in PROMPTS))
    args = [*"generate --temperature 0 --device cpu".split(), "--run", str(run_dir), "--prompts-file", str(prompts_file),
            "--max-new-tokens", str(MAX_NEW_TOKENS)]
    from shardwise.cli.main import build_parser

    generated = generate_results(build_parser().parse_args(args))
    assert [row["completion"] for row in batched] == [row["completion"] for row in generated]
    assert [len(row["token_ids"]) for row in batched] == [row["completion_tokens"] for row in generated]
    example = load_example()
    manifest, tokenizer, prefill, decode = example.load(exported)
    prompt_ids = [tokenizer.encode(prompt).ids for prompt in PROMPTS]
    assert [row["token_ids"] for row in batched] == engine_tokens(run_dir, prompt_ids)
    assert len({tuple(row["token_ids"]) for row in batched}) == len(PROMPTS)  # not one degenerate answer

    # One prompt at a time (B = 1) gives the batch's tokens: padding changes nothing.
    for ids, row in zip(prompt_ids, batched):
        assert example.generate(manifest, prefill, decode, [ids], MAX_NEW_TOKENS) == [row["token_ids"]]

    # A prompt that fills the context stops there, as the engine stops it.
    long_prompt = (prompt_ids[2] * 30)[:manifest["max_seq_len"] - 3]
    assert example.generate(manifest, prefill, decode, [long_prompt], MAX_NEW_TOKENS) == \
        engine_tokens(run_dir, [long_prompt])


def test_a_failed_export_leaves_nothing(run_dir, tmp_path, monkeypatch):
    import shardwise.infer.export as export

    def fail(programs, path):
        path.write_bytes(b"half a package")
        raise RuntimeError("the compiler failed")

    monkeypatch.setattr(export, "compile_package", fail)
    monkeypatch.setattr(export, "export_programs", lambda model: {})
    with pytest.raises(RuntimeError, match="the compiler failed"):
        export.export_run(run_dir, tmp_path / "new" / "deeper" / "out")
    assert list(tmp_path.iterdir()) == []
