"""train.init_from on one process: a run starts from a Hugging Face directory (its first loss is
`transformers`' on the same batch), from a run directory or RUN@STEP (the source checkpoint's loss);
model.* and data.tokenizer come from the source, a contradicting model.* is one error; a resumed run
keeps its own weights; a directory that is no model is refused before anything is written. Every
family's HF mapping reads through the per-tensor path to exactly what `convert --from-hf` reads.
The layouts (dp2 ZeRO-3, tp2, pp2) are tests/distributed/test_init_from_layouts.py."""

import json
import shutil

import pytest
import torch
import torch.nn.functional as F

from pretrained_dirs import hf_model, write_hf_dir
from shardwise.checkpoint.init_from import base_tensors, plan_hf_read, pretrained_state_dict
from shardwise.cli.main import main
from shardwise.config.loader import load_config
from shardwise.data.training_data import build_run_loaders, prepare_data
from shardwise.infer.load import load_run
from shardwise.models.build import build_on_meta, torch_family
from shardwise.models.families import hf_config_of
from shardwise.train.trainer import train

pytest.importorskip("transformers")


def run_values(tmp_path, data_cache, init_from, name="run", **overrides) -> dict:
    """A tiny fine-tuning run of `init_from` (no model.*: it comes from the source)."""
    return {"train.init_from": str(init_from), "data.source": "stdlib", "data.max_corpus_bytes": 200_000,
            "data.cache_dir": data_cache, "train.steps": 1, "train.global_batch_size": 4,
            "train.micro_batch_size": 2, "train.seq_len": 32, "train.warmup_steps": 1, "train.lr": 1e-3,
            "train.sample_tokens": 0, "run.dir": str(tmp_path / name), "run.progress": False, **overrides}


@torch.no_grad()
def first_batch_loss(logits_of, cfg) -> float:
    """The mean next-token loss of `logits_of(inputs)` over the run's first global batch."""
    loader, _ = build_run_loaders(cfg, prepare_data(cfg))
    total, count = 0.0, 0
    for inputs, targets, *_ in loader.next_step():
        logits = logits_of(inputs)
        total += F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=-100, reduction="sum").item()
        count += (targets != -100).sum().item()
    return total / count


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf")
    return {family: write_hf_dir(root / family, family) for family in ("llama", "gpt2")}


@pytest.fixture(scope="module")
def source_run(tmp_path_factory, data_cache):
    """A 2-step run of the debug model with a checkpoint after each step."""
    run_dir = tmp_path_factory.mktemp("source") / "run"
    values = {"model.preset": "debug", "data.source": "stdlib", "data.vocab_size": 512, "data.max_corpus_bytes": 200_000,
              "data.cache_dir": data_cache, "train.steps": 2, "train.global_batch_size": 4, "train.micro_batch_size": 2,
              "train.seq_len": 32, "train.lr": 1e-2, "train.sample_tokens": 0, "checkpoint.every": 1,
              "checkpoint.keep": 2, "run.dir": str(run_dir), "run.progress": False}
    train(load_config(overrides=values))
    return run_dir


# -- the weights ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_step0_logits_equal_transformers(hf_dirs, tmp_path, data_cache, family):
    cfg = load_config(overrides=run_values(tmp_path, data_cache, hf_dirs[family]))
    model = build_on_meta(cfg.model)
    model.to_empty(device="cpu")
    model.load_state_dict(pretrained_state_dict(cfg.train.init_from, cfg.model), strict=True)
    tokens = torch.randint(0, 300, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(model.eval()(tokens), hf_model(hf_dirs[family])(tokens).logits, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_first_loss_of_a_run_from_hf_equals_transformers(hf_dirs, tmp_path, data_cache, family):
    cfg = load_config(overrides=run_values(tmp_path, data_cache, hf_dirs[family]))
    result = train(cfg)
    reference = hf_model(hf_dirs[family])
    assert result.first_step == 1
    assert result.losses[0] == pytest.approx(first_batch_loss(lambda x: reference(x).logits, cfg), rel=1e-5)


@pytest.mark.parametrize("step", [None, 1])
def test_run_directory_and_run_at_step(source_run, tmp_path, data_cache, step):
    """RUN takes its newest checkpoint (step 2), RUN@1 step 1's: the new run's first loss is that model's."""
    text = f"{source_run}@{step}" if step else str(source_run)
    cfg = load_config(overrides=run_values(tmp_path, data_cache, text))
    assert cfg.model == load_config(source_run / "config.json").model
    assert cfg.data.tokenizer == str(source_run / "tokenizer.json")
    _, source_model, _ = load_run(source_run, checkpoint=source_run / f"checkpoints/step_{step or 2:08d}")
    result = train(cfg)
    assert result.first_step == 1
    assert result.losses[0] == pytest.approx(first_batch_loss(source_model, cfg), rel=1e-5)


def test_a_resumed_run_keeps_its_own_weights(hf_dirs, tmp_path, data_cache):
    """Stopped after step 1, its source deleted, resumed from its own config.json: the source is not read
    again, and step 2 equals an uninterrupted run's; the run still serves alone."""
    source = shutil.copytree(hf_dirs["llama"], tmp_path / "source")
    values = run_values(tmp_path, data_cache, source, "stopped", **{"train.steps": 2, "checkpoint.every": 1})
    whole = train(load_config(overrides={**values, "run.dir": str(tmp_path / "whole")}))
    train(load_config(overrides={**values, "train.stop_at_step": 1}))
    shutil.rmtree(source)
    resumed = train(load_config(tmp_path / "stopped/config.json", {"train.stop_at_step": 0}))
    assert resumed.first_step == 2
    assert resumed.losses == pytest.approx(whole.losses[1:], rel=1e-6)
    assert load_run(tmp_path / "stopped")[0].model == load_config(tmp_path / "whole/config.json").model
    with pytest.raises(ValueError, match=r"^train.init_from = .* is invalid: no such directory"):
        load_config(overrides={**values, "run.dir": str(tmp_path / "again")})  # a new run still needs it


def test_a_lora_run_reads_its_base_at_every_start(hf_dirs, tmp_path, data_cache):
    """Its checkpoints hold only the adapters: the first loss is the base's (B = 0), and a resumed run reads
    the base again, so step 2 equals an uninterrupted run's."""
    values = run_values(tmp_path, data_cache, hf_dirs["llama"], "stopped",
                        **{"train.lora_rank": 4, "train.lr": 1e-2, "train.steps": 2, "checkpoint.every": 1})
    whole = train(load_config(overrides={**values, "run.dir": str(tmp_path / "whole")}))
    reference = hf_model(hf_dirs["llama"])
    assert whole.losses[0] == pytest.approx(first_batch_loss(lambda x: reference(x).logits, load_config(overrides=values)),
                                            rel=1e-5)
    train(load_config(overrides={**values, "train.stop_at_step": 1}))
    resumed = train(load_config(overrides=values))
    assert resumed.first_step == 2
    assert resumed.losses == pytest.approx(whole.losses[1:], rel=1e-6)


@pytest.mark.parametrize("case", ["mixtral", "t5", "bert", "vit"])
def test_every_family_reads_what_convert_reads(tmp_path, case):
    """Slices and traced groups give exactly the family adapter's whole-checkpoint import."""
    transformers = pytest.importorskip("transformers")
    config, model_class = {
        "mixtral": (transformers.MixtralConfig(vocab_size=320, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2, num_local_experts=4, max_position_embeddings=64),
                    transformers.MixtralForCausalLM),
        "t5": (transformers.T5Config(vocab_size=320, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4),
               transformers.T5ForConditionalGeneration),
        "bert": (transformers.BertConfig(vocab_size=320, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                         intermediate_size=64, max_position_embeddings=64), transformers.BertForMaskedLM),
        "vit": (transformers.ViTConfig(image_size=8, patch_size=2, num_channels=1, hidden_size=32, num_hidden_layers=2,
                                       num_attention_heads=4, intermediate_size=64, num_labels=10),
                transformers.ViTForImageClassification),
    }[case]
    torch.manual_seed(0)
    model_class(config).save_pretrained(tmp_path)
    model_cfg, expected = torch_family(case if case != "mixtral" else "llama").hf_adapter.load_hf_checkpoint(tmp_path)
    assert model_cfg == load_config(overrides={"train.init_from": str(tmp_path), "data.tokenizer": "unused.json",
                                               **image_data(case)}).model
    ours = pretrained_state_dict(str(tmp_path), model_cfg)
    assert ours.keys() == expected.keys()
    for name, tensor in expected.items():
        assert torch.equal(ours[name], tensor.float()), name
    assert (case == "mixtral") == bool(plan_hf_read(tmp_path, model_cfg).computed)  # stacked experts are computed


def image_data(case: str) -> dict:
    return {"data.source": "digits", "train.seq_len": 17} if case == "vit" else {"train.seq_len": 32}


def test_gpt2_fused_attention_is_computed_from_its_own_tensor_only(hf_dirs):
    """q/k/v come from c_attn alone (no other tensor is read to make them), the rest are renames."""
    model_cfg = load_config(overrides={"train.init_from": str(hf_dirs["gpt2"]), "train.seq_len": 32}).model
    plan = plan_hf_read(hf_dirs["gpt2"], model_cfg)
    assert plan.computed["layers.1.attn.k_proj.weight"] == {"transformer.h.1.attn.c_attn.weight"}
    assert plan.computed["layers.0.mlp.up_proj.weight"] == {"transformer.h.0.mlp.c_fc.weight"}
    assert plan.renamed["layers.0.attn_norm.weight"] == "transformer.h.0.ln_1.weight"


def test_adapters_are_not_base_weights():
    model = torch.nn.Module()
    model.q_proj = torch.nn.Linear(4, 4)
    model.q_proj.lora_A = torch.nn.Linear(4, 2, bias=False)
    model.q_proj.lora_B = torch.nn.Linear(2, 4, bias=False)
    assert sorted(base_tensors(model)) == ["q_proj.bias", "q_proj.weight"]


# -- the config -----------------------------------------------------------------------------------------


def test_model_and_tokenizer_come_from_the_source(hf_dirs, tmp_path, data_cache):
    source = hf_dirs["llama"]
    cfg = load_config(overrides=run_values(tmp_path, data_cache, source))
    assert cfg.model == hf_config_of("llama").config_from_hf(json.loads((source / "config.json").read_text()))
    assert cfg.data.tokenizer == str(source / "tokenizer.json")
    mine = tmp_path / "mine.json"
    shutil.copy(source / "tokenizer.json", mine)
    assert load_config(overrides=run_values(tmp_path, data_cache, source, **{"data.tokenizer": str(mine)})).data.tokenizer == str(mine)


@pytest.mark.parametrize("field, value, accepted", [
    ("model.n_layers", 2, True), ("model.dim", 64, True), ("model.z_loss_coef", 0.0, True),
    ("model.n_layers", 3, False), ("model.tie_embeddings", True, False), ("model.family", "gpt2", False),
])
def test_model_fields_that_contradict_the_source_are_one_error(hf_dirs, tmp_path, data_cache, field, value, accepted):
    values = run_values(tmp_path, data_cache, hf_dirs["llama"], **{field: value})
    if accepted:
        assert getattr(load_config(overrides=values).model, field.split(".")[1]) == value
        return
    source_value = getattr(load_config(overrides=run_values(tmp_path, data_cache, hf_dirs["llama"])).model, field[6:])
    with pytest.raises(ValueError) as error:
        load_config(overrides=values)
    assert str(error.value) == (f"{field} = {value!r} is invalid: train.init_from {str(hf_dirs['llama'])!r} holds a "
                                f"model with {field[6:]} = {source_value!r}: leave {field} unset (the model comes from "
                                "train.init_from)")


def test_a_preset_beside_init_from_is_refused(hf_dirs, tmp_path, data_cache):
    with pytest.raises(ValueError, match=r"^model.preset = 'debug' is invalid: the model comes from train.init_from"):
        load_config(overrides=run_values(tmp_path, data_cache, hf_dirs["llama"], **{"model.preset": "debug"}))


def test_a_run_cannot_start_from_itself(source_run, data_cache):
    with pytest.raises(ValueError, match=r"^train.init_from = .* is invalid: it is run.dir itself"):
        load_config(overrides=run_values(source_run.parent, data_cache, source_run, name=source_run.name))


def no_model_cases(tmp_path, source_run):
    """(train.init_from, what the error says) of directories that hold no model."""
    (tmp_path / "empty").mkdir()
    (tmp_path / "weightless").mkdir()
    (tmp_path / "weightless/config.json").write_text('{"model_type": "llama"}')
    (tmp_path / "binary").mkdir()
    (tmp_path / "binary/config.json").write_text("not json")
    unfinished = tmp_path / "unfinished"
    unfinished.mkdir()
    shutil.copy(source_run / "config.json", unfinished / "config.json")
    return [
        (tmp_path / "missing", "no such directory"),
        (tmp_path / "empty", "it holds no config.json, so it is no model"),
        (tmp_path / "weightless", "it holds no model.safetensors or model.safetensors.index.json"),
        (tmp_path / "binary", "its config.json is not valid JSON"),
        (unfinished, "the run has no finished checkpoint, so it holds no model"),
        (f"{source_run}@7", "the run has no finished checkpoint at step 7 (it has: 1, 2)"),
    ]


def test_a_directory_that_is_no_model_is_one_line_and_writes_nothing(tmp_path, source_run, data_cache, capsys):
    for init_from, why in no_model_cases(tmp_path, source_run):
        run_dir = tmp_path / "new-run"
        argv = ["train", "--nproc", "1", "--train.init_from", str(init_from), "--data.cache_dir", data_cache,
                "--run.dir", str(run_dir), "--train.seq_len", "32"]
        with pytest.raises(SystemExit) as exit_info:
            main(argv)
        err = capsys.readouterr().err
        assert exit_info.value.code == 2, err
        assert err.startswith(f"shardwise: error: train.init_from = {str(init_from)!r} is invalid: {why}"), err
        assert err.count("\n") == 1, err
        assert not run_dir.exists()
