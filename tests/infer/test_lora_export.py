"""A LoRA run out of shardwise: `convert --to-peft` writes an adapter the real `peft` library loads onto
the Hugging Face base (PeftModel.from_pretrained) with our logits; `convert --to-hf --merge` writes a
checkpoint `transformers` loads with them; `generate` serves the run with its adapters merged, as its
merged export converted back (--from-hf) and as the unmerged model's own greedy loop. Llama's
adapters are renames; GPT-2's q, k and v sit in one transposed, fused c_attn (one PEFT adapter of rank
3r there, and of r where only q is adapted). fp32 throughout; logits to 1e-5, the contract's tolerance
(measured: ~2e-7). Each run is two steps from a tiny `transformers` model (tests/pretrained_dirs.py),
with lora_alpha high enough that its adapters change the logits by far more than the tolerance."""

from __future__ import annotations

import json

import pytest
import torch

from pretrained_dirs import hf_model, write_hf_dir
from shardwise.cli.main import main
from shardwise.config.loader import load_config
from shardwise.convert.peft import placement_of, target_names
from shardwise.infer.load import load_run
from shardwise.train.trainer import train

pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

RUNS = {"llama": ("llama", "q,k,v,o,gate,up,down"), "llama-q,v": ("llama", "q,v"),
        "gpt2": ("gpt2", "q,k,v,o,up,down"), "gpt2-q,o": ("gpt2", "q,o")}
TOLERANCE = 1e-5


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf")
    return {family: write_hf_dir(root / family, family) for family in ("llama", "gpt2")}


@pytest.fixture(scope="module")
def lora_runs(tmp_path_factory, hf_dirs, data_cache):
    """Run name -> a two-step LoRA run from the family's HF directory (made when first asked for)."""
    root, made = tmp_path_factory.mktemp("runs"), {}

    def run(name: str):
        if name not in made:
            family, targets = RUNS[name]
            values = {"train.init_from": str(hf_dirs[family]), "data.source": "stdlib",
                      "data.max_corpus_bytes": 200_000, "data.cache_dir": data_cache, "train.steps": 2,
                      "train.global_batch_size": 4, "train.micro_batch_size": 2, "train.seq_len": 32,
                      "train.warmup_steps": 1, "train.lr": 1e-2, "train.sample_tokens": 0,
                      "run.dir": str(root / name), "run.progress": False, "train.lora_rank": 4,
                      "train.lora_alpha": 128.0, "train.lora_targets": targets}
            train(load_config(overrides=values))
            made[name] = root / name
        return made[name]

    return run


def batch() -> torch.Tensor:
    return torch.randint(0, 300, (2, 24), generator=torch.Generator().manual_seed(1))


@torch.no_grad()
def our_logits(run_dir, *, merge: bool) -> torch.Tensor:
    return load_run(run_dir, merge=merge)[1](batch())


@torch.no_grad()
def hf_logits(model) -> torch.Tensor:
    return model.eval()(batch()).logits


@pytest.mark.parametrize("name", RUNS)
def test_peft_loads_the_adapters_onto_the_base_with_our_logits(lora_runs, hf_dirs, tmp_path, name):
    run_dir = lora_runs(name)
    assert main(["convert", "--to-peft", str(run_dir), "--out", str(tmp_path / "adapter")]) == 0
    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == str(hf_dirs[RUNS[name][0]])
    assert (config["r"], config["lora_alpha"]) == (4, 128.0)
    base = hf_model(hf_dirs[RUNS[name][0]])
    before = hf_logits(base)
    adapted = peft.PeftModel.from_pretrained(base, str(tmp_path / "adapter"))
    ours = our_logits(run_dir, merge=False)
    assert (ours - before).abs().max() > 100 * TOLERANCE  # the adapters matter
    torch.testing.assert_close(hf_logits(adapted), ours, rtol=0, atol=TOLERANCE)


@pytest.mark.parametrize("name", ["llama", "gpt2"])
def test_merged_export_is_what_transformers_loads(lora_runs, tmp_path, name):
    run_dir = lora_runs(name)
    out = tmp_path / "merged"
    assert main(["convert", "--to-hf", str(run_dir), "--merge", "--out", str(out)]) == 0
    torch.testing.assert_close(hf_logits(hf_model(out)), our_logits(run_dir, merge=False), rtol=0, atol=TOLERANCE)


def generated(run_dir, capsys) -> str:
    capsys.readouterr()
    assert main(["generate", "--run", str(run_dir), "--prompt", "def ", "--temperature", "0",
                 "--max-new-tokens", "12", "--json"]) == 0
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])["completion"]


@torch.no_grad()
def unmerged_greedy(run_dir, steps: int = 12) -> str:
    """The adapted model's own greedy continuation of "def ", one full forward per token."""
    _, model, tokenizer = load_run(run_dir, merge=False)
    tokens = tokenizer.encode("def ").ids
    prompt = len(tokens)
    for _ in range(steps):
        tokens.append(int(model(torch.tensor([tokens]))[0, -1].argmax()))
    return tokenizer.decode(tokens[prompt:])


def test_generate_from_a_lora_run_equals_its_merged_export_and_the_unmerged_model(lora_runs, hf_dirs, tmp_path,
                                                                                  capsys):
    run_dir = lora_runs("llama")
    assert main(["convert", "--to-hf", str(run_dir), "--merge", "--out", str(tmp_path / "merged")]) == 0
    assert main(["convert", "--from-hf", str(tmp_path / "merged"), "--out", str(tmp_path / "back")]) == 0
    from_run = generated(run_dir, capsys)
    assert from_run == generated(tmp_path / "back", capsys)
    assert from_run == unmerged_greedy(run_dir)
    assert main(["convert", "--from-hf", str(hf_dirs["llama"]), "--out", str(tmp_path / "base")]) == 0
    assert from_run != generated(tmp_path / "base", capsys)  # the adapters change what it says


def refused(argv: list[str], capsys) -> str:
    capsys.readouterr()
    with pytest.raises(SystemExit) as stop:
        main(argv)
    assert stop.value.code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1
    return lines[0]


def test_bad_exports_are_one_line_and_write_nothing(lora_runs, hf_dirs, tmp_path, capsys):
    plain = tmp_path / "plain"
    assert main(["convert", "--from-hf", str(hf_dirs["llama"]), "--out", str(plain)]) == 0
    out = tmp_path / "out"
    message = refused(["convert", "--to-peft", str(plain), "--out", str(out)], capsys)
    assert "--to-peft" in message and "train.lora_rank = 0" in message and "--to-hf" in message
    message = refused(["convert", "--to-hf", str(lora_runs("llama")), "--out", str(out)], capsys)
    assert "LoRA run" in message and "--merge" in message and "--to-peft" in message
    message = refused(["convert", "--to-peft", str(lora_runs("llama")), "--merge", "--out", str(out)], capsys)
    assert "--merge" in message
    assert not out.exists()


def test_the_output_directory_may_come_last(lora_runs, tmp_path):
    assert main(["convert", "--to-peft", str(lora_runs("llama-q,v")), str(tmp_path / "adapter")]) == 0
    assert (tmp_path / "adapter" / "adapter_model.safetensors").is_file()


def test_a_linear_laid_out_otherwise_is_found_nowhere():
    """A block of rows (a Linear) or of columns (a Conv1D) is placed; permuted rows are not (refused)."""
    probe = torch.arange(12, dtype=torch.float64).view(3, 4)
    fused = torch.cat([torch.full((2, 4), -1.0, dtype=torch.float64), probe])
    assert placement_of(fused, probe) == (False, 2)
    assert placement_of(fused.t().contiguous(), probe) == (True, 2)
    assert placement_of(probe[[1, 0, 2]], probe) is None


def test_target_names_are_the_shortest_suffixes_naming_only_the_adapted():
    adapted = ["transformer.h.0.attn.c_proj", "transformer.h.1.attn.c_proj", "transformer.h.0.attn.c_attn"]
    others = ["transformer.h.0.mlp.c_proj", "transformer.h.1.mlp.c_proj", "transformer.wte"]
    assert target_names(adapted, others) == {adapted[0]: "attn.c_proj", adapted[1]: "attn.c_proj",
                                             adapted[2]: "c_attn"}
