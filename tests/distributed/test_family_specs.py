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
from shardwise.core.model import ModelConfig
from shardwise.core.model_counts import ModelCounts
from shardwise.models.families import FAMILY_NAMES, SPECS, spec_of

from toy_family import SPEC as TOY, ToyConfig, ToyLM

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


NAMES = "|".join(FAMILY_NAMES)
FAMILY_COMPARISON = re.compile(
    r"family\s*(\([^()]*\))?\s*(==|!=|\bnot in\b|\bin\b)\s*[\"'(\[{]"  # model.family == "t5", family(shape) in (
    r"|[\"'](%s)[\"']\s*(==|!=|\bnot in\b|\bin\b)\s*\S*family"  # "t5" == model.family
    r"|\bin\s*[(\[{][^()\[\]{}]*[\"'](%s)[\"']" % (NAMES, NAMES))  # kind in ("gpt2", "bert")
"""A family's name compared, anywhere outside `shardwise/models/`."""
NAME_COMPARISON = re.compile(r"(==|!=)\s*[\"'](%s)[\"']|[\"'](%s)[\"']\s*(==|!=)" % (NAMES, NAMES))
"""In core/, the layer below the families, also a family's name compared with anything (kind == "vit")."""


def compares_a_family_name(line: str, *, in_core: bool) -> bool:
    if line.lstrip().startswith("#"):
        return False
    return bool(FAMILY_COMPARISON.search(line) or (in_core and NAME_COMPARISON.search(line)))


def test_no_code_outside_models_compares_a_family_name():
    found = [f"{path.relative_to(PACKAGE)}:{number}: {line.strip()}"
             for path in PACKAGE.rglob("*.py") if "models" not in path.relative_to(PACKAGE).parts[:1]
             for number, line in enumerate(path.read_text().splitlines(), start=1)
             if compares_a_family_name(line, in_core=path.relative_to(PACKAGE).parts[0] == "core")]
    assert found == [], "read a trait of the family's spec instead:\n" + "\n".join(found)


@pytest.mark.parametrize("line", [
    'if cfg.model.family == "vit":',
    "if model.family in ('bert', 'vit'):",
    'if "t5" != cfg.family:',
    'if family(shape) == "t5":  # v1.0: wi, wo',  # the counts' comparisons before they read traits
    'return family(shape) in ("gpt2", "bert", "vit")',
    "elif shape.tie_embeddings and family(shape) != 'vit':",
    'if kind in ("gpt2", "bert"):',
])
def test_the_comparison_check_sees_a_comparison(line):
    assert compares_a_family_name(line, in_core=False)


def test_in_core_the_check_sees_any_comparison_with_a_family_name():
    assert compares_a_family_name('if kind == "vit":', in_core=True)
    assert not compares_a_family_name('if kind == "vit":', in_core=False)  # an HF model_type is compared so


@pytest.mark.parametrize("line", ["spec = spec_of(cfg.model.family)", 'family: str = "llama"',
                                  "if spec.encoder_decoder:", '# if model.family == "t5":'])
def test_the_comparison_check_passes_what_compares_no_name(line):
    assert not compares_a_family_name(line, in_core=True)


def test_the_counts_read_the_toy_familys_traits_not_its_name():
    """A ModelConfig of the toy's shape, counted with the toy's spec (LayerNorms, biased linears, a GELU MLP,
    learned positions, an untied head), has the toy model's parameters."""
    toy = ToyConfig()
    shape = ModelConfig(family="toy", dim=toy.width, n_layers=toy.depth, n_heads=toy.heads, n_kv_heads=toy.heads,
                        ffn_dim=toy.hidden, vocab_size=toy.vocab, max_seq_len=toy.max_len, tie_embeddings=False)
    assert ModelCounts(shape, TOY).num_params() == sum(p.numel() for p in ToyLM(toy).parameters())


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
