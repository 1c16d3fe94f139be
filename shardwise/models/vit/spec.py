"""The ViT family as data: a pre-norm bidirectional encoder over image patches with a class token,
trained as an image classifier (no tokenizer, no vocabulary). The HF config mapping is
hf_config.py; the torch side is family.py."""

from shardwise.core.errors import invalid, require_positive
from shardwise.core.family import FamilySpec


def check(cfg) -> None:
    require_positive("model", cfg, "image_size", "patch_size", "n_channels", "n_classes")
    if cfg.image_size % cfg.patch_size:
        raise invalid("model.patch_size", cfg.patch_size, f"use a divisor of model.image_size ({cfg.image_size})")
    if cfg.max_seq_len != cfg.num_patches + 1:
        raise invalid("model.max_seq_len", cfg.max_seq_len,
                      f"a ViT sequence is its {cfg.num_patches} patches and the class token: "
                      f"use {cfg.num_patches + 1}")


SPEC = FamilySpec(
    name="vit",
    objective="image_classification",
    bidirectional=True,
    multi_head=True,
    heads_span_dim=True,
    layer_norm=True,
    linear_biases=True,
    mlp="gelu",
    position_table="patches",
    norm_saved_tensors=2,
    mlp_saved_per_ffn_dim=2,
    own_fields={
        "image_size": "image inputs",
        "patch_size": "image inputs",
        "n_channels": "image inputs",
        "n_classes": "the classification head",
    },
    check=check,
    hf_model_types=("vit",),
)
