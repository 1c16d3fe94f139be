"""Quantized serving of a trained run: `generate --quantize` through the engine computes what the
stored weights say (its greedy tokens equal a float model holding the dequantized weights), `shardwise
quantize` writes a run that generates as quantizing at load does, tensor-parallel over 2 processes
as in one, and every bad flag is one line with exit status 2 that writes nothing."""

import json
import subprocess
import sys

import pytest
import torch
from torch import nn

from shardwise.cli.main import build_parser, main
from shardwise.generation.engine import engine_for_model, generate_all
from shardwise.generation.quantize import QuantizedLinear
from shardwise.generation.sampling import SamplingParams
from shardwise.infer.commands import generate_results
from shardwise.infer.load import load_run, open_engine
from shardwise.infer.quantized_run import write_quantized_run
from serving_run import train_serving_run

PROMPTS = ["def main():\n    ", "import os\n", "class Parser:\n    def "]
GREEDY = SamplingParams(max_tokens=16, temperature=0)


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory, data_cache):
    """The debug model with a 192-unit MLP: every width (64, 192; 32 and 96 per rank over 2) holds
    whole int4 groups of 32, so int4 also splits over 2 ranks. Tied embeddings (a quantized head copy)."""
    return train_serving_run(tmp_path_factory.mktemp("quantize") / "run", data_cache, **{"model.ffn_dim": 192})


@pytest.fixture(scope="module")
def int4_run(run_dir):
    return write_quantized_run(run_dir, "int4", run_dir.parent / "int4", group_size=32)


def greedy_tokens(engine, tokenizer) -> list[list[int]]:
    return [seq.output_ids for seq in generate_all(engine, [tokenizer.encode(p).ids for p in PROMPTS], GREEDY)]


def dequantized_reference(quantized_model: nn.Module) -> nn.Module:
    """A float model whose linears hold the quantized model's stored weights, dequantized (a tied
    head's copy of the table included); its embedding lookups keep the float table, as serving does."""
    for name, module in list(quantized_model.named_modules()):
        if isinstance(module, QuantizedLinear):
            linear = nn.Linear(module.in_features, module.out_features, bias=module.bias is not None)
            linear.weight = nn.Parameter(module.dequantized())
            if module.bias is not None:
                linear.bias = module.bias
            parent, _, attribute = name.rpartition(".")
            setattr(quantized_model.get_submodule(parent), attribute, linear)
    return quantized_model


@pytest.mark.parametrize("scheme", ["int8", "int4"])
def test_quantized_greedy_generation_equals_the_dequantized_weights_reference(run_dir, scheme):
    _, engine, tokenizer = open_engine(run_dir, device_name="cpu", max_batch=3, quantize=scheme)
    model = engine.runner.model
    assert not any(isinstance(m, nn.Linear) for m in model.modules())  # the head included
    quantized = greedy_tokens(engine, tokenizer)

    _, reference, _ = load_run(run_dir)
    from shardwise.generation.quantize import quantize_model

    with torch.no_grad():
        reference = dequantized_reference(quantize_model(reference, scheme))
    expected = greedy_tokens(engine_for_model(reference, tokenizer, eos_id=engine.eos_id, max_batch=3), tokenizer)
    assert quantized == expected and len(set().union(*quantized)) > 6  # not one token repeated: the test can fail


def generate_args(run, *flags):
    return build_parser().parse_args(["generate", "--run", str(run), "--prompts-file", "unused", "--temperature",
                                      "0", "--max-new-tokens", "16", "--device", "cpu", *flags])


def generated(run, tmp_path, *flags) -> list[str]:
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps(p) + "\n" for p in PROMPTS))
    args = generate_args(run, *flags)
    args.prompts_file = str(prompts)
    return [result["completion"] for result in generate_results(args)]


def test_the_quantize_command_writes_a_run_that_generates_as_quantizing_at_load(run_dir, int4_run, tmp_path):
    config = json.loads((int4_run / "config.json").read_text())
    assert config["checkpoint"]["quantization"] == "int4" and config["checkpoint"]["quantization_group_size"] == 32
    assert (int4_run / "tokenizer.json").read_bytes() == (run_dir / "tokenizer.json").read_bytes()
    assert not [p for p in int4_run.parent.iterdir() if p.name.startswith(".")]  # no partial directory left
    from_run = generated(int4_run, tmp_path)
    assert from_run == generated(run_dir, tmp_path, "--quantize", "int4", "--group-size", "32")
    assert len(set(from_run)) == len(PROMPTS) and all(text.strip() for text in from_run)  # not all alike


@pytest.mark.slow
def test_tensor_parallel_quantized_generation_equals_one_process(run_dir, int4_run, tmp_path):
    """int4 from the quantized run (each rank reads its share of the codes) and int8 at load (each
    rank quantizes the whole weight, then keeps its share)."""
    for run, flags in ((int4_run, []), (run_dir, ["--quantize", "int8"])):
        command = [sys.executable, "-m", "shardwise.cli.main", "generate", "--run", str(run), "--prompt", PROMPTS[0],
                   "--temperature", "0", "--max-new-tokens", "16", "--device", "cpu", "--json", *flags]
        split = subprocess.run([*command, "--nproc", "2", "--parallel.tp", "2"], capture_output=True, text=True,
                               timeout=300)
        assert split.returncode == 0, split.stderr
        (whole,) = generate_results(build_parser().parse_args(command[3:]))  # one process: this one
        assert json.loads(split.stdout)["completion"] == whole["completion"] and whole["completion_tokens"] == 16


BAD_QUANTIZE = [
    (["--scheme", "int3"], "--scheme = 'int3' is invalid: use int8 (per-channel) or int4 (grouped)"),
    (["--scheme", "int4", "--group-size", "48"], "--group-size = 48 is invalid: the int4 kernel takes group sizes"),
    (["--scheme", "int4", "--group-size", "128"], "--group-size = 128 is invalid: it must divide every linear's "
                                                  "input width, and layers.0.attn.q_proj has 64"),
    (["--scheme", "int8", "--group-size", "32"], "--group-size = 32 is invalid with --scheme int8"),
]


@pytest.mark.parametrize("flags, message", BAD_QUANTIZE)
def test_bad_quantize_flags_are_one_line_errors_that_write_nothing(run_dir, tmp_path, flags, message, capsys):
    out = tmp_path / "out"
    with pytest.raises(SystemExit) as caught:
        main(["quantize", "--run", str(run_dir), "--out", str(out), *flags])
    err = capsys.readouterr().err
    assert caught.value.code == 2 and message in err and err.count("\n") == 1, err
    assert list(tmp_path.iterdir()) == []


def test_quantize_refuses_a_quantized_run_an_existing_out_and_a_model_that_does_not_generate(
        run_dir, int4_run, tmp_path, capsys):
    bert = tmp_path / "bert"
    bert.mkdir()
    (bert / "config.json").write_text(json.dumps({"model": {"preset": "bert-debug"}, "data": {"vocab_size": 512}}))
    cases = [(int4_run, tmp_path / "a", "is invalid: it is already quantized (int4); quantize the float run"),
             (run_dir, run_dir, "--out " + repr(str(run_dir)) + " is invalid: it exists; choose a new directory"),
             (bert, tmp_path / "b", "is a bert model, and quantization is for text generation")]
    for run, out, message in cases:
        with pytest.raises(SystemExit) as caught:
            main(["quantize", "--run", str(run), "--scheme", "int8", "--out", str(out)])
        err = capsys.readouterr().err
        assert caught.value.code == 2 and message in err and err.count("\n") == 1, err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bert"]


@pytest.mark.parametrize("command", ["generate", "serve"])
def test_bad_quantize_at_load_flags_are_one_line_errors(run_dir, int4_run, command, capsys):
    cases = [([str(int4_run), "--quantize", "int8"], "--quantize = int8 is invalid: --run"),
             ([str(run_dir), "--quantize", "int5"], "--quantize = 'int5' is invalid: use int8"),
             ([str(run_dir), "--quantize", "int4", "--group-size", "128"], "--group-size = 128 is invalid: it must "
                                                                           "divide every linear's input width"),
             ([str(run_dir), "--group-size", "32"], "--group-size = 32 is invalid without --quantize int4")]
    for (run, *flags), message in cases:
        with pytest.raises(SystemExit) as caught:
            main([command, "--run", run, "--device", "cpu", *flags])
        err = capsys.readouterr().err
        assert caught.value.code == 2 and message in err and err.count("\n") == 1, err


def test_training_a_quantized_run_is_refused(int4_run, tmp_path, capsys):
    with pytest.raises(SystemExit) as caught:
        main(["train", "--config", str(int4_run / "config.json"), "--run.dir", str(tmp_path / "again"), "--nproc", "1"])
    err = capsys.readouterr().err
    assert caught.value.code == 2 and "checkpoint.quantization = 'int4' is invalid for training" in err, err
    assert list(tmp_path.iterdir()) == []
