"""The BERT family as data: a bidirectional post-norm encoder (LayerNorm, exact GELU, learned
positions, a token-type table) trained as a masked LM. Its blocks end normalised, so it has no
final norm. The HF config mapping is hf_config.py; the torch side is family.py."""

from shardwise.core.errors import require_positive
from shardwise.core.family import FamilySpec


def check(cfg) -> None:
    require_positive("model", cfg, "type_vocab_size")


SPEC = FamilySpec(
    name="bert",
    objective="masked_lm",
    bidirectional=True,
    multi_head=True,
    heads_span_dim=True,
    final_norm=False,
    layer_norm=True,
    linear_biases=True,
    mlp="gelu",
    position_table="sequence",
    token_type_table=True,
    embedding_norm=True,
    head_transform=True,
    norm_saved_tensors=2,
    mlp_saved_per_ffn_dim=2,
    own_fields={"type_vocab_size": "the token-type (segment) table"},
    check=check,
    hf_model_types=("bert",),
)
