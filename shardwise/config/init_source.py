"""`train.init_from`, as the config loader reads it: which source it names, the model it holds and
its tokenizer. Torch-free (a config is checked before torch loads); the weights themselves are
copied by `shardwise/checkpoint/init_from.py` once the model is laid out.

A source is a Hugging Face model directory (config.json with a `model_type` that a family's
config.json mapping reads, and safetensors weights) or a shardwise run directory (config.json with
a `model` section, and `checkpoints/`), optionally `RUN@STEP` for one step's checkpoint.

model.* comes from the source, before validation: the family's `config_from_hf` (what
`shardwise convert --from-hf` would make) or the run's model section. A model.* field the user set
that contradicts it is an error naming the field, its value and the source's; the fields of
`TRAINING_FIELDS` describe how the model is trained, not what it is, and may be set freely.
data.tokenizer, when empty, is the source's tokenizer.json (a chat template is read beside it).

A run's own config.json names its source too, with every model.* field filled in: where the source
has gone since (a deleted download), the run still resumes, serves and exports from its own files.
"""

from __future__ import annotations

import dataclasses
import json
import re
from dataclasses import dataclass
from pathlib import Path

from shardwise.core.errors import invalid
from shardwise.core.model import ModelConfig
from shardwise.core.run_files import CHECKPOINT_DIR, finished_step_dirs, step_dir_name
from shardwise.models.families import SPECS, family_of_hf_type, hf_config_of, spec_of
from shardwise.config.schema import RunConfig

TRAINING_FIELDS = ("aux_loss_coef", "z_loss_coef", "capacity_factor", "router_bias_update_rate")
"""model.* fields a run may set whatever the source says: loss weights and routing capacity of a MoE,
which change the training, not the weights."""
HF_WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json")
TOKENIZER_FILE = "tokenizer.json"
SOURCE_KINDS = "a Hugging Face model directory (config.json + *.safetensors) or a shardwise run directory (RUN or RUN@STEP)"


@dataclass(frozen=True)
class InitSource:
    """What `train.init_from` names."""

    text: str
    """train.init_from as written."""
    directory: Path
    kind: str
    """"hf" or "run"."""
    step: int | None = None
    """RUN@STEP's step; None: the newest valid checkpoint."""

    @property
    def tokenizer(self) -> Path | None:
        """The source's tokenizer.json (None where it has none: an image model, or an HF directory without one)."""
        path = self.directory / TOKENIZER_FILE
        return path if path.is_file() else None

    def step_checkpoint(self) -> Path | None:
        """RUN@STEP's checkpoint directory (None for a whole run or an HF directory)."""
        if self.step is None:
            return None
        return self.directory / CHECKPOINT_DIR / step_dir_name(self.step)


def refuse(text: str, why: str) -> ValueError:
    return invalid("train.init_from", text, f"{why}; name {SOURCE_KINDS}")


def parse_init_from(text: str) -> InitSource:
    """The source `train.init_from` names, refused in one line when it is no model."""
    directory, step = Path(text), None
    match = re.fullmatch(r"(.+)@(\d+)", text)
    if not directory.is_dir() and match:
        directory, step = Path(match[1]), int(match[2])
    if not directory.is_dir():
        raise refuse(text, "no such directory")
    config = read_source_config(text, directory)
    if isinstance(config.get("model"), dict):
        source = InitSource(text, directory, "run", step)
        check_run_checkpoint(source, config)
        return source
    if step is not None:
        raise refuse(text, f"{directory} is no shardwise run (its config.json has no model section), so @STEP names nothing")
    if "model_type" not in config:
        raise refuse(text, "its config.json has neither a model_type (Hugging Face) nor a model section (a run)")
    if not any((directory / name).is_file() for name in HF_WEIGHT_FILES):
        raise refuse(text, f"it holds no {' or '.join(HF_WEIGHT_FILES)} (pickled .bin weights are not read: re-save "
                           "with save_pretrained(..., safe_serialization=True))")
    return InitSource(text, directory, "hf")


def names_a_gone_source(text: str) -> bool:
    """Nothing is where train.init_from points (the model downloaded for a run since deleted, say)."""
    return not Path(text).exists() and not Path(text.rpartition("@")[0] or text).exists()


def read_source_config(text: str, directory: Path) -> dict:
    path = directory / "config.json"
    if not path.is_file():
        raise refuse(text, "it holds no config.json, so it is no model")
    try:
        config = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise refuse(text, f"its config.json is not valid JSON ({error})") from None
    if not isinstance(config, dict):
        raise refuse(text, "its config.json is not a JSON object")
    return config


def check_run_checkpoint(source: InitSource, config: dict) -> None:
    """The run has a finished checkpoint (the one of RUN@STEP), and holds whole weights."""
    if config.get("train", {}).get("lora_rank"):
        raise invalid("train.init_from", source.text, "it is a LoRA run, whose checkpoints hold adapters, not the "
                      "model: start from its merged weights (shardwise convert --to-hf RUN --merge) instead")
    steps = finished_steps(source.directory)
    if source.step is not None and source.step not in steps:
        have = ", ".join(map(str, steps)) or "none"
        raise refuse(source.text, f"the run has no finished checkpoint at step {source.step} (it has: {have})")
    if not steps:
        raise refuse(source.text, "the run has no finished checkpoint, so it holds no model")


def finished_steps(run_dir: Path) -> list[int]:
    return [step for step, _ in finished_step_dirs(run_dir)]


# -- the model and tokenizer the config takes from it ------------------------------------------------


def source_model_fields(source: InitSource) -> dict:
    """Every model.* value of the source."""
    config = read_source_config(source.text, source.directory)
    if source.kind == "run":
        fields = dict(config["model"])
        unknown = sorted(set(fields) - {f.name for f in dataclasses.fields(ModelConfig)})
        if unknown:
            raise refuse(source.text, f"its config.json has model fields this shardwise lacks ({', '.join(unknown)})")
        return fields
    spec = family_of_hf_type(config["model_type"])
    if spec is None:
        known = ", ".join(name for each in SPECS.values() for name in each.hf_model_types)
        raise refuse(source.text, f"its model_type {config['model_type']!r} is none that shardwise reads ({known})")
    try:
        mapping = hf_config_of(spec.name)
        mapped = mapping.config_from_hf(config)
    except ValueError as error:
        raise ValueError(f"train.init_from = {source.text!r} cannot be read: {error}") from None
    if isinstance(mapped, dict):
        # a mapping that returns field values (T5's) names what an import adds to them
        return dataclasses.asdict(ModelConfig(**getattr(mapping, "IMPORT_DEFAULTS", {}), **mapped))
    return dataclasses.asdict(mapped)


def model_section_from_source(source: InitSource, explicit: dict) -> dict:
    """The model section of a run started from `source`; `explicit`: the model.* values the user set."""
    fields = source_model_fields(source)
    for name, value in explicit.items():
        if name in TRAINING_FIELDS or value == fields.get(name):
            continue
        if name == "preset":
            raise invalid("model.preset", value, "the model comes from train.init_from: leave model.preset unset")
        raise invalid(f"model.{name}", value, f"train.init_from {source.text!r} holds a model with {name} = "
                                              f"{fields.get(name)!r}: leave model.{name} unset (the model comes from "
                                              "train.init_from)")
    return {**fields, **explicit}


def tokenizer_from_source(source: InitSource, model_family: str) -> str:
    """data.tokenizer when the user left it empty: the source's tokenizer.json ("" for an image model)."""
    if source.tokenizer is not None:
        return str(source.tokenizer)
    if spec_of(model_family).image_input:
        return ""
    raise invalid("train.init_from", source.text, f"it holds no {TOKENIZER_FILE}, which the model's token ids come "
                                                  "from: set data.tokenizer to the model's tokenizer.json")


def fill_from_init_source(by_section: dict[str, dict]) -> None:
    """train.init_from set: the model section from the source, and data.tokenizer when empty (in place)."""
    text = by_section["train"]["init_from"]
    run_dir = Path(by_section["run"].get("dir", RunConfig().dir))
    if names_a_gone_source(text) and {f.name for f in dataclasses.fields(ModelConfig)} <= by_section["model"].keys():
        keep_run_config(by_section["data"], run_dir)
        return
    source = parse_init_from(text)
    if source.kind == "run" and run_dir.resolve() == source.directory.resolve():
        raise invalid("train.init_from", source.text, "it is run.dir itself: to go on with that run leave "
                                                      "train.init_from empty; to start from it, use another run.dir")
    by_section["model"] = model_section_from_source(source, by_section["model"])
    if not by_section["data"].get("tokenizer"):
        by_section["data"]["tokenizer"] = tokenizer_from_source(source, by_section["model"]["family"])


def keep_run_config(data: dict, run_dir: Path) -> None:
    """A run's own config.json whose source is gone: its model was filled in when it started, so it resumes,
    serves and exports alone, with the copy of the source's tokenizer it keeps."""
    tokenizer, own_copy = data.get("tokenizer", ""), run_dir / TOKENIZER_FILE
    if tokenizer and not Path(tokenizer).is_file() and own_copy.is_file():
        data["tokenizer"] = str(own_copy)
