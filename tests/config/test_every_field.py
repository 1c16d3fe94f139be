"""Every number of every config section and every numeric flag, walked with NaN, +-inf, 0, -1 and a
huge value (issue 37, item 4): each is refused with one line naming the field or flag, or its
acceptance is listed below with the reason. The fields come from the dataclasses and the flags from
the parsers, so a field or flag added later is walked without touching this file; an allow-list
entry that is refused after all fails the test, so the lists cannot go stale.

In-process and fast (the TOML path: `flatten` + `build_config`; the command line: the parsers and a
few `main([...])` calls). serve and generate's flags are walked by the server's tests (tests/infer).
"""

from __future__ import annotations

import argparse
import dataclasses
import math
from pathlib import Path

import pytest
import torch

from shardwise.cli.main import build_parser, main
from shardwise.config.loader import build_config, field_types, flatten
from shardwise.config.presets import PRESETS
from shardwise.config.schema import SECTIONS, TrainConfig
from shardwise.models.families import SPECS, spec_of
from shardwise.train.optim import build_optimizer

LABELS = ("nan", "inf", "-inf", "0", "-1", "huge")


def value_of(label: str, kind: type):
    """The value as TOML (or the command line's type) hands it over: NaN and infinities are floats
    even for an integer field (TOML has no integer NaN); huge is past int64, or near float's top."""
    if label == "huge":
        return 2**63 if kind is int else 1e300
    value = float(label)
    return kind(value) if label in ("0", "-1") else value


FINITE = ("a finite value takes effect as written (a poor one shows in the loss, or stops the run at "
          "train.on_nonfinite); only NaN and the infinities cannot")
ACCEPTED = {
    "model.head_dim": {"0": "documented: dim / n_heads"},
    "model.norm_eps": {"huge": FINITE},
    "model.rope_theta": {"huge": FINITE},
    "model.rope_scaling_factor": {"0": "documented: no RoPE scaling", "huge": FINITE},
    "model.rope_low_freq_factor": {"huge": FINITE},
    "model.rope_high_freq_factor": {"huge": FINITE},
    "model.sliding_window": {"0": "documented: full causal attention"},
    "model.init_std": {"huge": FINITE},
    "model.n_experts": {"0": "documented: a dense model"},
    "model.n_shared_experts": {"0": "documented: no shared experts"},
    "model.moe_ffn_dim": {"0": "documented: ffn_dim"},
    "model.shared_expert_ffn_dim": {"0": "documented: the routed experts' width"},
    "model.router_bias_update_rate": {"0": "documented: off", "huge": FINITE},
    "model.capacity_factor": {"0": "documented: dropless", "huge": FINITE},
    "model.aux_loss_coef": {"0": "documented: off", "huge": FINITE},
    "model.z_loss_coef": {"0": "documented: off", "huge": FINITE},
    "model.n_decoder_layers": {"0": "documented: n_layers"},
    "data.max_corpus_bytes": {"0": "documented: no cap"},
    "data.val_fraction": {"0": "documented: no validation split"},
    "data.image_pad": {"0": "documented: no padding"},
    "parallel.dp": {"0": "documented: what tp*cp*pp leave of the world size"},
    "parallel.zero": {"0": "documented: ZeRO stage 0, replicated"},
    "parallel.bucket_mb": {"huge": "one bucket for all gradients: takes effect (one collective, no overlap)"},
    "train.stop_at_step": {"0": "documented: run all train.steps"},
    "train.seed": {"0": "a seed like any other"},
    "train.lr": {"huge": FINITE},
    "train.min_lr_ratio": {"0": "decay to 0, as many schedules do"},
    "train.warmup_steps": {"0": "no warm-up"},
    "train.weight_decay": {"0": "no decay", "huge": FINITE},
    "train.beta1": {"0": "no momentum (torch accepts 0)"},
    "train.beta2": {"0": "no second-moment averaging (torch accepts 0)"},
    "train.eps": {"huge": FINITE},
    "train.grad_clip": {"0": "documented: no clipping", "huge": "a finite threshold binds once the norm reaches it"},
    "train.max_restarts": {"0": "documented: never restart"},
    "train.stall_timeout_s": {"0": "documented: never", "huge": "a timeout no run reaches: it takes effect as written"},
    "train.sample_tokens": {"0": "documented: no closing sample"},
    "train.sample_temperature": {"0": "documented: greedy"},
    "train.sample_top_k": {"0": "documented: all tokens"},
    "train.eval_every": {"0": "documented: only after the last step"},
    "train.dpo_beta": {"huge": "DPO's beta is unbounded above (TRL accepts any positive beta): the policy stays at the reference"},
    "train.lora_rank": {"0": "documented: no LoRA, every weight trained"},
    "train.lora_alpha": {"huge": FINITE},
    "train.lora_dropout": {"0": "documented: no dropout"},
    "checkpoint.every": {"0": "documented: only at the end"},
    "checkpoint.quantization_group_size": {"0": "documented: no groups (float weights, or int8's per-channel scales)"},
}
"""Field -> {value label: why it is accepted}. Everything else must be refused."""

BASE = {"model": {"preset": "debug"}, "data": {"vocab_size": 300}}
"""A valid config to change one field of (the debug model's vocabulary is 512)."""
MODEL_BASES = {preset: BASE | {"model": {"preset": preset}} for preset in PRESETS if preset.endswith("debug")}
MODEL_BASES["vit-debug"] = {**MODEL_BASES["vit-debug"], "data": {"source": "digits"}, "train": {"seq_len": 17}}
"""Model fields are walked on every family's small preset (MoE's too): each checks its own fields."""


def settable_model_fields(preset: str) -> set[str]:
    """The model fields a preset's family may set (validate_model refuses other families' own fields)."""
    family = spec_of(PRESETS[preset].get("family", "llama"))
    others = {name for spec in SPECS.values() if spec is not family for name in spec.own_fields}
    return set(field_types(SECTIONS["model"])) - (others - set(family.own_fields))


def walk_cases():
    """(base config, section, field, type) of every numeric field: model fields once per family preset."""
    for section, cls in SECTIONS.items():
        for name, kind in field_types(cls).items():
            if kind not in (int, float):
                continue
            bases = ([MODEL_BASES[p] for p in MODEL_BASES if name in settable_model_fields(p)]
                     if section == "model" else [BASE])
            for base in bases:
                yield base, section, name, kind


def outcome(base: dict, section: str, name: str, value) -> str | None:
    """None when the config is accepted, else the error's text."""
    tree = {part: dict(values) for part, values in base.items()}
    tree.setdefault(section, {})[name] = value
    try:
        build_config(flatten(tree))
    except ValueError as err:
        return str(err)
    return None


def test_every_field_refuses_what_cannot_take_effect_naming_it():
    wrong, accepted_seen = [], set()
    cases = list(walk_cases())
    assert len({(s, n) for _, s, n, _ in cases}) > 60  # the walk finds the fields
    for base, section, name, kind in cases:
        key = f"{section}.{name}"
        for label in LABELS:
            error = outcome(base, section, name, value_of(label, kind))
            if error is None:
                if label not in ACCEPTED.get(key, {}):
                    wrong.append(f"{key} = {label} ({base['model']['preset']}) accepted without a listed reason")
                accepted_seen.add((key, label))
            elif not error.startswith(f"{key} ") or "\n" in error:
                wrong.append(f"{key} = {label} ({base['model']['preset']}): the error names another subject: {error}")
    assert not wrong, "\n".join(wrong)
    listed = {(key, label) for key, labels in ACCEPTED.items() for label in labels}
    assert not listed - accepted_seen, f"listed as accepted but refused: {sorted(listed - accepted_seen)}"


@pytest.fixture(scope="module")
def parser() -> argparse.ArgumentParser:
    return build_parser()


def parse_error(parser, argv: list[str], capsys) -> str:
    """The one line a parse refusal prints (the test fails if the command line parses)."""
    with pytest.raises(SystemExit) as stop:
        parser.parse_args(argv)
    assert stop.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("shardwise: error: "), err
    return err


def test_integer_fields_refuse_nan_and_infinities_on_the_command_line(parser, capsys):
    for section, cls in SECTIONS.items():
        for name, kind in field_types(cls).items():
            if kind is int:
                for text in ("nan", "inf", "-inf", "1e3"):
                    assert f"--{section}.{name}" in parse_error(parser, ["train", f"--{section}.{name}={text}"], capsys)


REQUIRED = {
    "plan": ["--model", "debug", "--devices", "2", "--global-batch-tokens", "1024", "--seq-len", "128"],
    "predict": ["--run", "RUN"],
    "report": ["RUN"],
}
"""What each walked subcommand needs besides the flag under test."""
ACCEPTED_FLAGS = {
    ("report", "--step", "0"): "a step number, checked against the run's pipeline timelines when the command runs",
    ("plan", "--lora-rank", "0"): "documented: no LoRA",
    ("plan", "--lora-dropout", "0"): "documented: no dropout",
}
WALKED_COMMANDS = ("train", "plan", "estimate", "calibrate", "convert", "predict", "report", "checkpoints", "rules")
"""serve and generate (and the --parallel.tp they share) belong to the server's tests."""


def numeric_flags(parser):
    """(command, flag) of every option with a numeric type, outside the config fields (walked above)."""
    commands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices
    for command in WALKED_COMMANDS:
        for action in commands[command]._actions:
            flag = action.option_strings[-1] if action.option_strings else None
            if flag and "." not in flag and action.type not in (None, str, Path):
                yield command, flag


def test_every_numeric_flag_refuses_what_it_cannot_use(parser, capsys):
    flags = list(numeric_flags(parser))
    assert ("plan", "--devices") in flags and ("calibrate", "--size-mb") in flags
    seen = set()
    for command, flag in flags:
        for label in LABELS:
            text = str(2**63) if label == "huge" else label
            argv = [command, *REQUIRED.get(command, []), f"{flag}={text}"]
            if (command, flag, label) in ACCEPTED_FLAGS:
                parser.parse_args(argv)
                seen.add((command, flag, label))
                continue
            assert f"{flag} = {text} is invalid" in parse_error(parser, argv, capsys)
    assert seen == set(ACCEPTED_FLAGS)


@pytest.mark.parametrize("argv, subject", [
    (["train", "--train.grad_clip", "nan"], "train.grad_clip = nan is invalid"),
    (["train", "--train.grad_clip", "inf"], "train.grad_clip = inf is invalid"),
    (["train", "--train.eps", "0"], "train.eps = 0.0 is invalid"),
    (["train", "--train.beta2", "1"], "train.beta2 = 1.0 is invalid"),
    (["train", "--train.stop_at_step", "500", "--train.steps", "10"], "train.stop_at_step = 500 is invalid"),
    (["train", "--nproc", "nan"], "--nproc = 'nan' is invalid"),
    (["plan", "--model", "debug", "--devices", "-1", "--global-batch-tokens", "8", "--seq-len", "4"],
     "--devices = -1 is invalid"),
    (["estimate", "--model", '{"preset": "debug", "norm_eps": NaN}', "--layout", '{"dp": 1}'],
     "model.norm_eps = nan is invalid"),
])
def test_the_command_line_says_one_line_and_writes_nothing(argv, subject, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as stop:
        main([*argv, *(["--run.dir", str(tmp_path / "run")] if argv[0] == "train" else [])])
    assert stop.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"shardwise: error: {subject}"), err
    assert list(tmp_path.iterdir()) == []


def torch_refuses(**settings) -> bool:
    try:
        torch.optim.AdamW([torch.nn.Parameter(torch.zeros(2, 2))], **settings)
    except ValueError:
        return True
    return False


OPTIMIZER_FIELDS = {"lr": "lr", "eps": "eps", "weight_decay": "weight_decay", "beta1": 0, "beta2": 1}
"""TrainConfig field -> AdamW's argument (betas by position)."""


@pytest.mark.parametrize("name", OPTIMIZER_FIELDS)
def test_optimizer_values_torch_refuses_are_refused_by_the_config_first(name):
    """Each AdamW value torch's own check refuses (with a message that names no field) is refused by
    config validation naming the field; each the config accepts builds the optimizer."""
    for value in (math.nan, math.inf, -math.inf, -1.0, 0.0, 1.0, 0.5, 1e-8, 1e300):
        argument = OPTIMIZER_FIELDS[name]
        settings = {"betas": tuple(value if i == argument else 0.9 for i in (0, 1))} \
            if isinstance(argument, int) else {argument: value}
        error = outcome(BASE, "train", name, value)
        if torch_refuses(**settings):
            assert error and error.startswith(f"train.{name} = "), (name, value, error)
        if error is None:
            cfg = TrainConfig(**{name: value})
            build_optimizer([torch.nn.Parameter(torch.zeros(2, 2))], cfg)


@pytest.mark.parametrize("spec, message", [
    ({"dim": 64, "n_layer": 2, "n_heads": 4, "n_kv_heads": 2, "ffn_dim": 128, "vocab_size": 512},
     "model.n_layer is not a config field; did you mean 'model.n_layers'?"),
    ({"prest": "debug"}, "model.prest is not a config field; did you mean 'model.preset'?"),
    ({"model": {"preset": "debug"}, "trian": {"steps": 3}}, "trian is not a config field; did you mean 'train'?"),
])
def test_a_planner_model_spec_names_the_nearest_known_key(spec, message):
    from shardwise.planner.model_resolution import resolve_model

    with pytest.raises(ValueError) as refused:
        resolve_model(spec)
    assert str(refused.value) == message


def test_a_corpus_smaller_than_one_batch_is_refused_naming_the_numbers():
    import numpy as np

    from shardwise.data.prepare import TokenFile
    from shardwise.data.splits import build_loaders

    cfg = build_config({"model.preset": "debug", "data.vocab_size": 300, "train.seq_len": 16,
                        "train.global_batch_size": 8, "train.micro_batch_size": 4})
    tokens = TokenFile(path=Path("corpus"), tokens=np.arange(16 * 7 + 1, dtype=np.uint16) % 300,
                       meta={"sha256": "0" * 64, "max_token_id": 299})
    with pytest.raises(ValueError) as refused:
        build_loaders(cfg, tokens)
    assert str(refused.value).startswith(
        "train.global_batch_size = 8 is invalid: one step needs that many samples, but the training data "
        "(data.source 'stdlib') holds 113 tokens, 7 sequences of train.seq_len = 16; use train.global_batch_size <= 7")
    tokens = dataclasses.replace(tokens, tokens=np.arange(16 * 8 + 1, dtype=np.uint16) % 300)
    assert build_loaders(cfg, tokens)[0].num_windows == 8  # one batch exactly: accepted
