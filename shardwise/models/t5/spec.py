"""The T5 family as data: an encoder-decoder with RMSNorm, relative position biases and no biases,
a v1.0 ReLU or v1.1 gated-GELU MLP, trained on span corruption. Its decoder blocks also read the
encoder's output. The HF config mapping is hf_config.py; the torch side is family.py."""

from shardwise.core.errors import invalid, require_positive
from shardwise.core.family import FamilySpec


def check(cfg) -> None:
    require_positive("model", cfg, "relative_buckets", "relative_max_distance")
    if cfg.n_decoder_layers < 0:
        raise invalid("model.n_decoder_layers", cfg.n_decoder_layers, "use 0 (= model.n_layers) or more")


SPEC = FamilySpec(
    name="t5",
    objective="span_corruption",
    bidirectional=True,
    encoder_decoder=True,
    multi_head=True,
    mlp="relu_or_gated_gelu",
    relative_position_bias=True,
    norm_saved_tensors=3,
    own_fields={
        "n_decoder_layers": "a decoder stack",
        "relative_buckets": "relative position buckets",
        "relative_max_distance": "relative position buckets",
        "gated_mlp": "the T5 v1.1 gated-GELU MLP",
    },
    check=check,
    hf_model_types=("t5",),
)
