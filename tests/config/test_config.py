import argparse
from pathlib import Path

import pytest

from shardwise.config import add_config_arguments, config_from_args, load_config
from shardwise.config.loader import field_docs
from shardwise.config.schema import SECTIONS

CONFIGS = Path(__file__).resolve().parents[2] / "configs"


def parse(argv):
    parser = argparse.ArgumentParser()
    add_config_arguments(parser)
    return config_from_args(parser.parse_args(argv))


def test_demo_toml_equals_the_defaults():
    assert load_config(CONFIGS / "demo.toml") == load_config()


def test_every_field_has_help():
    for section, cls in SECTIONS.items():
        docs = field_docs(cls)
        missing = [f for f in cls.__dataclass_fields__ if f not in docs]
        assert not missing, f"{section}: fields without a docstring: {missing}"


def test_cli_overrides_file_which_overrides_preset():
    cfg = parse(["--config", str(CONFIGS / "debug.toml"), "--train.steps", "7", "--model.n_layers", "3",
                 "--train.deterministic", "--run.progress", "false"])
    assert cfg.train.steps == 7
    assert cfg.model.n_layers == 3 and cfg.model.dim == 64  # preset "debug" from the file
    assert cfg.train.deterministic is True and cfg.run.progress is False
    assert cfg.data.vocab_size == 512  # from the file


def test_preset_fills_the_shape_and_fields_override_it():
    cfg = load_config(overrides={"model.preset": "llama3-8b", "model.n_layers": 2, "train.seq_len": 64})
    assert (cfg.model.dim, cfg.model.n_layers, cfg.model.n_kv_heads) == (4096, 2, 8)
    assert cfg.model.rope_scaling_factor == 8.0 and cfg.model.tie_embeddings is False


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"train.stepz": 3}, "train.stepz is not a config field; did you mean 'train.steps'"),
        ({"train.steps": 0}, "train.steps = 0 is invalid: use a positive integer"),
        ({"train.global_batch_size": 10, "train.micro_batch_size": 4}, "train.global_batch_size = 10 is invalid"),
        ({"model.n_kv_heads": 3}, "model.n_kv_heads = 3 is invalid: use a divisor of model.n_heads"),
        ({"model.preset": "gpt5"}, "model.preset = 'gpt5' is invalid: use one of"),
        ({"train.seq_len": 4096}, "train.seq_len = 4096 is invalid: use at most model.max_seq_len"),
        ({"parallel.cp": 2, "parallel.cp_mode": "ulysses"}, "parallel.cp_mode = 'ulysses' is invalid: use one of ring, alltoall"),
        ({"train.recompute": "half"}, "train.recompute = 'half' is invalid: use one of none, full, selective"),
        ({"parallel.tp": 2, "parallel.zero": 1}, "parallel.zero = 1 is invalid: ZeRO-1/2 are written for replicated"),
        ({"parallel.dp_replicate": 2}, "parallel.dp_replicate = 2 is invalid: HSDP shards parameters"),
        ({"parallel.pp_schedule": "wavy"}, "parallel.pp_schedule = 'wavy' is invalid"),
        ({"parallel.pp": 2, "parallel.pp_virtual_stages": 2},
         "parallel.pp_virtual_stages = 2 is invalid: 1f1b runs one stage per rank"),
        ({"parallel.pp": 2, "parallel.pp_schedule": "zbv"},
         "parallel.pp_virtual_stages = 1 is invalid: the zbv schedule places exactly 2 stages per rank"),
        ({"parallel.pp": 2, "parallel.zero": 2}, "parallel.zero = 2 is invalid: ZeRO-2 frees gradients"),
        ({"parallel.pp": 2, "parallel.tp": 2, "parallel.sp": True}, "parallel.sp = True is invalid"),
        ({"train.autocast_dtype": "float16"}, "train.autocast_dtype = 'float16' is invalid"),
        ({"data.vocab_size": 8192}, "data.vocab_size = 8192 is invalid: use at most model.vocab_size"),
        ({"train.lr": -1.0}, "train.lr = -1.0 is invalid"),
    ],
)
def test_invalid_values_name_field_value_and_fix(overrides, message):
    with pytest.raises(ValueError) as err:
        load_config(overrides=overrides)
    assert message in str(err.value)
    assert "\n" not in str(err.value)


def test_bad_toml_files(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        load_config(tmp_path / "nope.toml")
    broken = tmp_path / "broken.toml"
    broken.write_text("[train\nsteps = 1")
    with pytest.raises(ValueError, match="is not valid TOML"):
        load_config(broken)
    typed = tmp_path / "typed.toml"
    typed.write_text('[train]\nsteps = "many"\n')
    with pytest.raises(ValueError, match="train.steps = 'many' is invalid: expected a value of type int"):
        load_config(typed)
    unknown = tmp_path / "unknown.toml"
    unknown.write_text("[trian]\nsteps = 1\n")
    with pytest.raises(ValueError, match="trian is not a config field; did you mean 'train'"):
        load_config(unknown)


def test_cli_rejects_badly_typed_value(capsys):
    with pytest.raises(SystemExit):
        parse(["--train.steps", "many"])
    assert "--train.steps: invalid int value: 'many'" in capsys.readouterr().err
