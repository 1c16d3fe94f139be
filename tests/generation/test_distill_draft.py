"""benchmarks/distill_draft.py: a draft's training text is the target's own greedy answers to prompts
that leave the speculation benchmark's functions out."""

import importlib
import json
import random
import sys
from pathlib import Path

import pytest

from serving_run import train_serving_run

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


@pytest.fixture(scope="module")
def distill():
    sys.path.insert(0, str(BENCHMARKS))
    try:
        yield importlib.import_module("distill_draft")
    finally:
        sys.path.remove(str(BENCHMARKS))


def test_the_prompts_leave_the_benchmarks_functions_out(distill):
    from speculation import SOURCES, function_source

    edits = distill.edit_prompts(40, random.Random(0))
    assert len(edits) == 40 and all("# The same function, with `" in prompt for prompt in edits)
    first_lines = [function_source(name).split("\n", 1)[0] for name in SOURCES]
    assert not any(line in prompt for line in first_lines for prompt in edits)
    assert not {name.split(":")[0] for name in SOURCES} & set(distill.EDIT_MODULES)
    windows = distill.window_prompts(20, random.Random(0))
    assert len(windows) == 20 and all(0 < len(prompt) <= 1201 and prompt.endswith("\n") for prompt in windows)


@pytest.mark.slow
def test_each_document_is_a_prompt_and_the_targets_answer_within_its_context(distill, tmp_path, data_cache, capsys):
    run = train_serving_run(tmp_path / "target", data_cache, steps=20)  # max_seq_len 128
    out = tmp_path / "answers"
    distill.main(["--target", str(run), "--out", str(out), "--prompts", "6", "--new-tokens", "8", "--batch", "4"])
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["documents"] == 6 and 0 < summary["generated_tokens"] <= 6 * 8
    documents = sorted(out.glob("*.txt"))
    assert len(documents) == 6 and all(document.read_text() for document in documents)
    from shardwise.infer.load import open_engine

    _, _, tokenizer = open_engine(run, device_name="cpu", max_batch=1)
    assert all(len(tokenizer.encode(document.read_text()).ids) <= 128 for document in documents)

    with pytest.raises(SystemExit) as refused:
        distill.main(["--target", str(run), "--out", str(tmp_path / "x"), "--new-tokens", "128"])
    assert refused.value.code == 2 and "--new-tokens = 128 is invalid" in capsys.readouterr().err
