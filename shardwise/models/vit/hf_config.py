"""config.json of HF `transformers` ViT (`ViTForImageClassification`) <-> shardwise ModelConfig
(family vit).

Field by field; what shardwise's ViT does not compute (another activation, q/k/v without biases,
non-square images or patches, a regression or multi-label head) is refused with an error naming
the key rather than converted approximately. A key config.json leaves out takes ViTConfig's
default. Dropout probabilities are accepted and ignored (shardwise trains without dropout), as are
the pooler's keys (ViTForImageClassification has no pooler) and `encoder_stride` (only HF's
masked-image-modeling decoder reads it). Class names (`id2label`) are not kept: shardwise knows the
classes by index, and an export names them LABEL_0, LABEL_1, ... as HF does by default. Used by
`hf_adapter`, which adds the weights.
"""

from __future__ import annotations

from shardwise.core.errors import invalid
from shardwise.core.model import ModelConfig
from shardwise.models.common.hf_config_parts import (ENCODER_CONSTANTS, ENCODER_FIELDS, Fields, check_model_type,
    config_json, fields_from_hf, fields_to_hf, hf_value)
from shardwise.models.families import validate_model

ARCHITECTURES = {"vit": "ViTForImageClassification"}
DEFAULTS = dict(hidden_size=768, num_hidden_layers=12, num_attention_heads=12, intermediate_size=3072,
                hidden_act="gelu", layer_norm_eps=1e-12, initializer_range=0.02, image_size=224, patch_size=16,
                num_channels=3, qkv_bias=True)
"""transformers' ViTConfig defaults."""
DEFAULT_NUM_LABELS = 2
"""PretrainedConfig's class count when config.json names neither id2label nor num_labels."""
CROSS_ENTROPY_PROBLEMS = (None, "single_label_classification")
"""HF `problem_type`s whose loss is cross-entropy over the classes, the loss shardwise trains."""


FIELDS: Fields = ENCODER_FIELDS | dict(n_channels=("num_channels", int))
"""The ModelConfig fields that are one config.json key each."""


def square_side(hf: dict, key: str) -> int:
    """`image_size` / `patch_size`: HF takes an int or a [height, width] pair; shardwise squares only."""
    value = hf_value(hf, key, DEFAULTS)
    if isinstance(value, (list, tuple)):
        if len(value) != 2 or value[0] != value[1]:
            raise invalid(f"config.json {key}", value, "shardwise's ViT takes square images and patches: "
                                                         "use one int (or [n, n])")
        value = value[0]
    return int(value)


def num_classes(hf: dict) -> int:
    """As PretrainedConfig counts them: id2label's length, else num_labels, else 2."""
    if hf.get("id2label") is not None:
        return len(hf["id2label"])
    return DEFAULT_NUM_LABELS if hf.get("num_labels") is None else int(hf["num_labels"])


def config_from_hf(hf: dict) -> ModelConfig:
    """The ModelConfig of a HF ViT config.json dict, validated."""
    check_model_type(hf, "vit")
    if hf_value(hf, "hidden_act", DEFAULTS) != "gelu":
        raise invalid("config.json hidden_act", hf["hidden_act"], "shardwise's ViT MLP is the exact erf GELU: use gelu")
    if not hf_value(hf, "qkv_bias", DEFAULTS):
        raise invalid("config.json qkv_bias", hf["qkv_bias"], "shardwise's ViT has q/k/v biases: only true converts")
    if hf.get("problem_type") not in CROSS_ENTROPY_PROBLEMS:
        raise invalid("config.json problem_type", hf["problem_type"],
                      "shardwise's ViT trains with cross-entropy over the classes: use single_label_classification")
    n_classes = num_classes(hf)
    if n_classes < 1:
        raise invalid("config.json num_labels", n_classes, "shardwise's ViT is a classifier: use at least 1 class")
    image_size, patch_size = square_side(hf, "image_size"), square_side(hf, "patch_size")
    if image_size % patch_size:
        raise invalid("config.json patch_size", patch_size, f"use a divisor of image_size ({image_size}): HF would "
                                                            "drop the remainder pixels, shardwise does not")
    fields = fields_from_hf(hf, FIELDS, DEFAULTS)
    cfg = ModelConfig(
        preset="vit-base",  # every field is set here; the preset name only satisfies ModelConfig.validate
        family="vit", n_kv_heads=fields["n_heads"],
        vocab_size=1,  # no token table: the field only satisfies the shared validation
        max_seq_len=(image_size // patch_size) ** 2 + 1, tie_embeddings=False,
        image_size=image_size, patch_size=patch_size, n_classes=n_classes, **fields,
    )
    validate_model(cfg)
    return cfg


def config_to_hf(cfg: ModelConfig, arch: str = "vit", *, dtype: str = "float32") -> dict:
    """A config.json dict that `transformers` (4.x and 5.x) loads as ViTForImageClassification."""
    check_exportable(cfg, arch)
    labels = [f"LABEL_{i}" for i in range(cfg.n_classes)]
    keys = fields_to_hf(cfg, FIELDS) | ENCODER_CONSTANTS | dict(
        image_size=cfg.image_size,
        patch_size=cfg.patch_size,
        qkv_bias=True,
        encoder_stride=cfg.patch_size,  # HF's masked-image decoder upsamples by it: one patch
        id2label={str(i): label for i, label in enumerate(labels)},
        label2id={label: i for i, label in enumerate(labels)},
        problem_type="single_label_classification",
    )
    return config_json(arch, ARCHITECTURES, keys, dtype)


def check_exportable(cfg: ModelConfig, arch: str) -> None:
    validate_model(cfg)
    if cfg.family != "vit":
        raise invalid("model.family", cfg.family, "only a ViT model converts to a HF ViT: use its own family's adapter")
    if arch not in ARCHITECTURES:
        raise invalid("arch", arch, 'a ViT model (model.family = "vit") exports as arch="vit"')
