"""Build a validated `Config` from a TOML file plus `--section.field value` overrides.

Order: dataclass defaults < model preset < TOML file < command line. The model section is
special only in that `model.preset` (from the file or the command line) first fills every
shape field, so `--model.preset llama3-8b --model.n_layers 4` means "llama3-8b, 4 layers". With
`train.init_from` the source's model takes the preset's place, and a model.* value that contradicts
it is refused (config/init_source.py).
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import difflib
import functools
import inspect
import json
import textwrap
import typing
from pathlib import Path

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

from shardwise.config.init_source import fill_from_init_source
from shardwise.config.schema import SECTIONS, Config
from shardwise.core.errors import invalid
from shardwise.config.presets import PRESETS

TRUE_WORDS, FALSE_WORDS = ("true", "1", "yes", "on"), ("false", "0", "no", "off")


@functools.cache
def field_docs(cls) -> dict[str, str]:
    """The docstring written under each dataclass field (the CLI help)."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    body = tree.body[0].body
    docs = {}
    for stmt, nxt in zip(body, body[1:]):
        is_field = isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name)
        is_doc = isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant) and isinstance(nxt.value.value, str)
        if is_field and is_doc:
            docs[stmt.target.id] = " ".join(nxt.value.value.split())
    return docs


@functools.cache
def field_types(cls) -> dict[str, type]:
    hints = typing.get_type_hints(cls)  # every annotation of the class at once: once, not once per field
    return {f.name: hints[f.name] for f in dataclasses.fields(cls)}


def parse_bool(text: str) -> bool:
    if text.lower() in TRUE_WORDS:
        return True
    if text.lower() in FALSE_WORDS:
        return False
    raise argparse.ArgumentTypeError(f"{text!r} is not a boolean; use true or false")


def parse_list(text: str) -> list[str]:
    """A list field on the command line: comma-separated ("jsonl,tensorboard")."""
    return [part.strip() for part in text.split(",") if part.strip()]


def list_parser(kind: type):
    """The command-line parser of a list field: comma-separated items of its item type ("1,3")."""
    item_type = typing.get_args(kind)[0]
    if item_type is str:
        return parse_list

    def parse(text: str) -> list:
        try:
            return [item_type(part) for part in parse_list(text)]
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of {item_type.__name__}s") from None
    return parse


def coerce(key: str, value, kind: type):
    """Check a TOML value against the field's type (ints are accepted where floats are; a list
    also as one comma-separated string)."""
    if typing.get_origin(kind) is list:
        item_type = typing.get_args(kind)[0]
        if isinstance(value, str):
            try:
                return list_parser(kind)(value)
            except argparse.ArgumentTypeError:
                raise invalid(key, value, f"expected a list of {item_type.__name__}s") from None
        if not isinstance(value, list) or not all(isinstance(item, item_type) and not isinstance(item, bool)
                                                  for item in value):
            raise invalid(key, value, f"expected a list of {item_type.__name__}s")
        return value
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if kind is int and isinstance(value, bool) or not isinstance(value, kind):
        raise invalid(key, value, f"expected a value of type {kind.__name__}")
    return value


def unknown_key_error(key: str, known: list[str]) -> ValueError:
    near = difflib.get_close_matches(key, known, n=1)
    hint = f"did you mean {near[0]!r}?" if near else f"known keys: {', '.join(sorted(known))}"
    return ValueError(f"{key} is not a config field; {hint}")


def read_toml(path: str | Path) -> dict:
    """A TOML config, or the config.json a run directory holds (the same tree, as JSON)."""
    path = Path(path)
    if path.is_dir():
        raise ValueError(f"--config {str(path)!r} is a directory; pass a TOML file such as configs/demo.toml "
                         "(or a run directory's config.json)")
    if not path.is_file():
        raise ValueError(f"--config {str(path)!r} does not exist; pass a TOML file such as configs/demo.toml")
    if path.suffix == ".json":
        try:
            return json.loads(path.read_text())
        except json.JSONDecodeError as err:
            raise ValueError(f"--config {str(path)!r} is not valid JSON ({err}); fix the file") from None
    try:
        with path.open("rb") as f:
            return tomllib.load(f)
    except tomllib.TOMLDecodeError as err:
        raise ValueError(f"--config {str(path)!r} is not valid TOML ({err}); fix the file") from None


def flatten(tree: dict) -> dict[str, object]:
    """{"train": {"steps": 5}} -> {"train.steps": 5}, rejecting unknown sections and fields."""
    flat = {}
    for section, values in tree.items():
        if section not in SECTIONS:
            raise unknown_key_error(section, list(SECTIONS))
        if not isinstance(values, dict):
            raise invalid(section, values, f"expected a [{section}] table of {section}.* fields")
        cls = SECTIONS[section]
        for name, value in values.items():
            key = f"{section}.{name}"
            if name not in field_types(cls):
                raise unknown_key_error(key, [f"{section}.{n}" for n in field_types(cls)])
            flat[key] = coerce(key, value, field_types(cls)[name])
    return flat


def build_config(values: dict[str, object]) -> Config:
    """A validated Config from flat `section.field` values over the defaults and model preset (or, with
    train.init_from, the source's model: config/init_source.py)."""
    by_section: dict[str, dict] = {name: {} for name in SECTIONS}
    for key, value in values.items():
        section, name = key.split(".", 1)
        by_section[section][name] = value
    if by_section["train"].get("init_from"):
        fill_from_init_source(by_section)  # the model is the source's, not a preset's
    else:
        preset = by_section["model"].get("preset", "demo")
        if preset not in PRESETS:
            raise invalid("model.preset", preset, f"use one of {', '.join(PRESETS)}")
        by_section["model"] = {**PRESETS[preset], **by_section["model"], "preset": preset}
    cfg = Config(**{name: SECTIONS[name](**fields) for name, fields in by_section.items()})
    return cfg.validate()


def load_config(path: str | Path | None = None, overrides: dict[str, object] | None = None) -> Config:
    values = flatten(read_toml(path)) if path else {}
    for key, value in (overrides or {}).items():
        section, _, name = key.partition(".")
        if section not in SECTIONS or name not in field_types(SECTIONS[section]):
            raise unknown_key_error(key, [f"{s}.{n}" for s, c in SECTIONS.items() for n in field_types(c)])
        values[key] = value
    return build_config(values)


def add_config_arguments(parser: argparse.ArgumentParser) -> None:
    """`--section.field VALUE` for every field, typed, with its docstring as help."""
    parser.add_argument("--config", help="TOML config file (see configs/); command-line fields override it")
    for section, cls in SECTIONS.items():
        group = parser.add_argument_group(f"[{section}]")
        docs, defaults = field_docs(cls), cls()
        for name, kind in field_types(cls).items():
            shown_default = getattr(defaults, name)
            help_text = f"{docs.get(name, '')} (default: {shown_default!r})".replace("%", "%%")
            kwargs = dict(dest=f"{section}.{name}", default=argparse.SUPPRESS, help=help_text, metavar=kind.__name__.upper())
            if kind is bool:
                kwargs.update(type=parse_bool, nargs="?", const=True)
            elif typing.get_origin(kind) is list:
                kwargs.update(type=list_parser(kind), metavar="A,B")
            else:
                kwargs.update(type=kind)
            group.add_argument(f"--{section}.{name}", **kwargs)


def config_from_args(args: argparse.Namespace) -> Config:
    overrides = {key: value for key, value in vars(args).items() if "." in key}
    return load_config(getattr(args, "config", None), overrides)
