"""A family is one folder, read through its spec: the registry, the traits the layout rules read, and
no family name compared outside `shardwise/models/` (docs/architecture.md, "Model families")."""

import dataclasses
import re
import subprocess
import sys
from pathlib import Path

import pytest

import shardwise
from shardwise.core.layout_rules import cp_family_violations, pipeline_family_violations, tp_shape_violations
from shardwise.models.families import FAMILY_NAMES, SPECS, spec_of

from toy_family import SPEC as TOY, ToyConfig

PACKAGE = Path(shardwise.__file__).parent
FAMILY_FILES = ("spec.py", "hf_config.py", "family.py", "model.py", "plan.py", "hf_adapter.py")


@pytest.mark.parametrize("name", FAMILY_NAMES)
def test_each_registered_family_is_a_folder_with_its_spec_and_torch_side(name):
    folder = PACKAGE / "models" / name
    assert sorted(f for f in FAMILY_FILES if not (folder / f).is_file()) == []
    assert spec_of(name).name == name


def test_an_unknown_family_is_refused_in_one_line_naming_the_registered_ones():
    with pytest.raises(ValueError, match=r"model.family = 'mamba' is invalid: use one of llama, gpt2, bert, vit, t5"):
        spec_of("mamba")


def test_layout_rules_read_the_toy_familys_traits_not_its_name():
    """The toy family is not registered: the rules see only its spec."""
    assert list(cp_family_violations(cp=2, spec=TOY)) == []  # causal: context parallelism splits it
    refused = list(cp_family_violations(cp=2, spec=dataclasses.replace(TOY, bidirectional=True)))
    assert [v.rule for v in refused] == ["cp_bidirectional"] and "model.family toy attends both ways" in refused[0].fix
    assert list(pipeline_family_violations(pp=2, spec=TOY)) == []
    assert [v.rule for v in pipeline_family_violations(pp=2, spec=dataclasses.replace(TOY, encoder_decoder=True))] \
        == ["pp_encoder_decoder"]
    shape = SimpleShape(n_heads=4, n_kv_heads=4, head_dim=8, ffn_dim=64, vocab_size=ToyConfig().vocab + 1)
    assert "tp_vocab_rows" in [v.rule for v in tp_shape_violations(128, shape, TOY)]
    image_input = dataclasses.replace(TOY, objective="image_classification")  # no vocabulary to split
    rules = [v.rule for v in tp_shape_violations(128, shape, image_input)]
    assert "tp_divides" in rules and "tp_vocab_rows" not in rules


@dataclasses.dataclass
class SimpleShape:
    n_heads: int
    n_kv_heads: int
    head_dim: int
    ffn_dim: int
    vocab_size: int
    n_experts: int = 0
    moe_ffn_dim: int = 0
    n_shared_experts: int = 0
    dim: int = 32

    @property
    def head_size(self):
        return self.head_dim


FAMILY_COMPARISON = re.compile(r"family\s*(==|!=|\bin\b|\bnot in\b)\s*[\"'(\[{]|[\"'](%s)[\"']\s*(==|!=|in)\s*\S*family"
                               % "|".join(FAMILY_NAMES))


def test_no_code_outside_models_compares_a_family_name():
    found = [f"{path.relative_to(PACKAGE)}:{number}: {line.strip()}"
             for path in PACKAGE.rglob("*.py") if "models" not in path.relative_to(PACKAGE).parts[:1]
             for number, line in enumerate(path.read_text().splitlines(), start=1)
             if FAMILY_COMPARISON.search(line) and not line.lstrip().startswith("#")]
    assert found == [], "read a trait of the family's spec instead:\n" + "\n".join(found)


def test_the_comparison_check_sees_a_comparison():
    assert FAMILY_COMPARISON.search('if cfg.model.family == "vit":')
    assert FAMILY_COMPARISON.search("if model.family in ('bert', 'vit'):")
    assert not FAMILY_COMPARISON.search("spec = spec_of(cfg.model.family)")


def test_config_planner_and_the_registry_import_no_torch():
    """Transitively: `import torch` anywhere under them would load it (tests/test_layers.py checks each
    module's own imports)."""
    code = ("import sys; import shardwise.config, shardwise.planner, shardwise.models.families; "
            "print('torch' in sys.modules)")
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip() \
        == "False"


def test_the_registry_lists_each_family_once_with_distinct_hf_types():
    types = [t for spec in SPECS.values() for t in spec.hf_model_types]
    assert len(types) == len(set(types))
    assert sum(spec.estimates_any_decoder for spec in SPECS.values()) == 1
