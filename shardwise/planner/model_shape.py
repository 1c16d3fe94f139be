"""The shape of a model (a Llama-family decoder, dense or mixture-of-experts; GPT-2, BERT, ViT), as
plain numbers.

`ModelShape` is what the cost model needs and nothing more; it is built from a preset name
(shardwise's `config/presets.py`), a shardwise model config (the `model` section as a
dict), or a Hugging Face `config.json` (Llama, Mistral, Qwen2, Mixtral, Qwen2-MoE, Qwen3-MoE; GPT-2,
BERT, ViT).
No torch: the planner runs without it.

Its parameter and FLOP counts are `config/model_counts.py`'s, the same functions that count
`ModelConfig` (llama3-8b: 8,030,261,248 parameters either way); ModelShape adds what the
runtime's config cannot express (Qwen3's q/k norms, explicit MoE layer lists from
`mlp_only_layers`, shared-expert widths that are not a multiple of an expert's).
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, replace
from functools import cached_property
from pathlib import Path

from shardwise.core import model_counts
from shardwise.models.bert import hf_config as hf_bert
from shardwise.models.gpt2 import hf_config as hf_gpt2
from shardwise.models.t5 import hf_config as hf_t5
from shardwise.models.vit import hf_config as hf_vit
from shardwise.models.llama.hf_shape import hf_shape


@dataclass(frozen=True, kw_only=True)
class ModelShape:
    name: str = "custom"
    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int = 0
    ffn_dim: int
    vocab_size: int
    tie_embeddings: bool = False
    qkv_bias: bool = False
    qk_norm: bool = False
    """RMSNorm on each head's queries and keys (Qwen3): 2 x head_dim parameters per block."""
    n_experts: int = 0
    """Routed experts per MoE layer; 0 = dense."""
    experts_per_token: int = 0
    moe_ffn_dim: int = 0
    """Width of one routed expert; 0 = ffn_dim."""
    shared_ffn_dim: int = 0
    """Total width of the shared (always-on) expert MLPs of an MoE layer."""
    shared_expert_gate: bool = False
    """Qwen-MoE's sigmoid gate (h -> 1) on the shared expert."""
    moe_layers: tuple = ()
    """Indices of the MoE blocks (empty for a dense model)."""
    capacity_factor: float = 0.0
    """Tokens an expert may take, as a multiple of the balanced share; 0 = dropless."""
    family: str = "llama"
    """llama, or gpt2 / bert / vit (LayerNorm with biases, learned positions, GELU MLP:
    config/model_counts.py)."""
    max_seq_len: int = 0
    """Rows of a gpt2 or bert model's learned position table (counted as parameters)."""
    type_vocab_size: int = 2
    """BERT: rows of the token-type table."""
    image_size: int = 0
    patch_size: int = 0
    n_channels: int = 3
    n_classes: int = 0
    """ViT: the image, its patches and the classifier (config/model.py's fields)."""
    n_decoder_layers: int = 0
    relative_buckets: int = 32
    relative_max_distance: int = 128
    gated_mlp: bool = False
    """T5: its decoder stack, relative-position buckets and MLP kind (config/model.py's fields)."""

    def __post_init__(self):
        for name in ("dim", "n_layers", "n_heads", "n_kv_heads", "ffn_dim", "vocab_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"model.{name} = {value!r} is invalid: use a positive integer")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"model.n_kv_heads = {self.n_kv_heads} is invalid: use a divisor of "
                             f"model.n_heads ({self.n_heads})")
        if not self.head_dim and self.dim % self.n_heads:
            raise ValueError(f"model.n_heads = {self.n_heads} is invalid: use a divisor of model.dim "
                             f"({self.dim}) or give head_dim")
        if self.n_experts < 0 or (self.n_experts and not 1 <= self.experts_per_token <= self.n_experts):
            raise ValueError(f"model.experts_per_token = {self.experts_per_token} is invalid: use between 1 and "
                             f"model.n_experts ({self.n_experts})")

    # -- sizes -------------------------------------------------------------------------------

    @property
    def head_size(self) -> int:
        return self.head_dim or self.dim // self.n_heads

    @property
    def q_width(self) -> int:
        return model_counts.q_width(self)

    @property
    def kv_width(self) -> int:
        return model_counts.kv_width(self)

    @property
    def is_moe(self) -> bool:
        return self.n_experts > 0 and bool(self.moe_layers)

    @property
    def expert_ffn_dim(self) -> int:
        return self.moe_ffn_dim or self.ffn_dim

    @cached_property
    def moe_layer_set(self) -> frozenset:
        return frozenset(self.moe_layers) if self.n_experts else frozenset()

    def is_moe_layer(self, layer: int) -> bool:
        return layer in self.moe_layer_set

    @property
    def norms_per_block(self) -> int:
        """Two RMSNorms (attention and MLP); the planner does not model parallel blocks."""
        return 2

    # -- counts (shardwise/core/model_counts.py, shared with ModelConfig) --------------------

    def attention_params(self) -> int:
        return model_counts.attention_params(self)

    def dense_mlp_params(self) -> int:
        return model_counts.dense_mlp_params(self)

    def expert_params(self) -> int:
        """One routed expert."""
        return model_counts.expert_params(self)

    def moe_non_expert_params(self) -> int:
        """Router, shared experts (and their gate) of one MoE layer: held by every expert-parallel rank."""
        return model_counts.moe_shared_params(self)

    def block_params(self, layer: int) -> int:
        return model_counts.block_params(self, layer)

    def embedding_params(self) -> int:
        return model_counts.embedding_params(self)

    def head_params(self) -> int:
        """The output projection's own parameters (0 when tied to the embedding) plus the final norm."""
        return model_counts.output_head_params(self) + self.dim

    @cached_property
    def num_params(self) -> int:
        return model_counts.num_params(self)

    @cached_property
    def num_active_params(self) -> int:
        """Parameters one token goes through (experts_per_token of the routed experts)."""
        return model_counts.num_params(self, active=True)

    def matmul_params_per_token(self, layer: int) -> int:
        """Weights a token multiplies in one block (the routed experts it is sent to)."""
        return model_counts.matmul_params(self, layer)

    def moe_flops_params_per_token(self) -> int:
        """Weights a token multiplies in the MLP of a MoE block: router, its k experts, shared experts."""
        return model_counts.moe_mlp_params(self, active=True)

    def block_flops_per_token(self, layer: int, seq_len: int) -> float:
        """Training FLOPs of one block per token, 6*N_block + 12*a*d*s, N_block its matmul weights."""
        return model_counts.block_matmul_flops_per_token(self, layer, seq_len)

    def head_flops_per_token(self) -> float:
        return model_counts.head_flops_per_token(self)

    def flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs per token, 6N + 12*L*a*d*s with N the active matmul weights (norms
        excluded: `model_counts.matmul_flops_per_token`; ModelConfig.flops_per_token and the
        trainer's MFU also count the norm weights)."""
        return model_counts.matmul_flops_per_token(self, seq_len)


# -- construction ------------------------------------------------------------------------------

SHARDWISE_KEYS = {"dim", "n_layers", "n_heads", "n_kv_heads", "ffn_dim", "vocab_size"}
FAMILY_SHAPE_KEYS = ("type_vocab_size", "image_size", "patch_size", "n_channels", "n_classes", "n_decoder_layers",
                     "relative_buckets", "relative_max_distance")
FAMILY_READERS = {"gpt2": hf_gpt2, "bert": hf_bert, "vit": hf_vit, "t5": hf_t5}
"""HF model types read by their family's config reader (the rest are Llama-family decoders)."""
HF_KEYS = {"hidden_size", "num_hidden_layers", "num_attention_heads"}


def moe_layer_indices(n_layers: int, step: int, dense_layers=()) -> tuple:
    """Layers i with (i + 1) % step == 0 (Qwen-MoE's decoder_sparse_step; 1 = all) and not in dense_layers."""
    step = max(1, int(step))
    dense = set(dense_layers or ())
    return tuple(i for i in range(n_layers) if (i + 1) % step == 0 and i not in dense)


def shape_from_shardwise(values: dict, name: str = "custom") -> ModelShape:
    """From a shardwise `model` section (preset name + overrides, or all fields)."""
    from shardwise.config.presets import PRESETS

    values = dict(values)
    preset = values.pop("preset", None)
    if preset is not None:
        if preset not in PRESETS:
            raise ValueError(f"model.preset = {preset!r} is invalid: use one of {', '.join(PRESETS)}")
        values = {**PRESETS[preset], **values}
        name = preset if name == "custom" else name
    missing = sorted(SHARDWISE_KEYS - set(values))
    if missing:
        raise ValueError(f"model.{missing[0]} is missing: give it, or a preset to start from")
    n_layers = int(values["n_layers"])
    n_experts = int(values.get("n_experts", 0) or 0)
    moe_dim = int(values.get("moe_ffn_dim", 0) or 0)
    shared = int(values.get("n_shared_experts", 0) or 0) * (moe_dim or int(values["ffn_dim"]))
    return ModelShape(
        name=name, dim=int(values["dim"]), n_layers=n_layers, n_heads=int(values["n_heads"]),
        n_kv_heads=int(values["n_kv_heads"]), head_dim=int(values.get("head_dim", 0) or 0),
        ffn_dim=int(values["ffn_dim"]), vocab_size=int(values["vocab_size"]),
        tie_embeddings=bool(values.get("tie_embeddings", True)), qkv_bias=bool(values.get("qkv_bias", False)),
        qk_norm=bool(values.get("qk_norm", False)), n_experts=n_experts, experts_per_token=int(values.get("experts_per_token", 0) or (2 if n_experts else 0)),
        moe_ffn_dim=moe_dim, shared_ffn_dim=shared, shared_expert_gate=bool(values.get("shared_expert_gate", False)),
        moe_layers=moe_layer_indices(n_layers, values.get("moe_layer_step", 1)) if n_experts else (),
        capacity_factor=float(values.get("capacity_factor", 0.0) or 0.0),
        family=str(values.get("family", "llama")), max_seq_len=int(values.get("max_seq_len", 0) or 0),
        **{key: int(values[key]) for key in FAMILY_SHAPE_KEYS if key in values},
        gated_mlp=bool(values.get("gated_mlp", False)),
    )


def shape_from_hf(values: dict, name: str = "custom") -> ModelShape:
    """From a Hugging Face config.json (Llama/Mistral/Qwen2/Qwen3, Mixtral, Qwen2/Qwen3-MoE), read
    by the converter's reader (`config/hf_config.hf_shape`); GPT-2, BERT and ViT configs by their
    family's reader (`config/hf_<family>.py`), which refuses what shardwise does not compute."""
    model_type = str(values.get("model_type", ""))
    if model_type in FAMILY_READERS:
        cfg = FAMILY_READERS[model_type].config_from_hf(values)
        fields = cfg if isinstance(cfg, dict) else {field.name: getattr(cfg, field.name)
                                                    for field in dataclasses.fields(cfg)}
        return shape_from_shardwise(fields, name=name if name != "custom" else
                                    (values.get("_name_or_path") or model_type))
    fields = hf_shape(values)
    n_experts, dense_layers = fields["n_experts"], fields.pop("dense_layers")
    step = fields.pop("moe_layer_step")
    return ModelShape(
        name=name if name != "custom" else (values.get("_name_or_path") or model_type or "custom"), **fields,
        shared_expert_gate=bool(fields["shared_ffn_dim"]),
        moe_layers=moe_layer_indices(fields["n_layers"], step, dense_layers) if n_experts else (),
    )


def resolve_model(spec) -> ModelShape:
    """A preset name, a dict (shardwise model config or HF config.json), JSON text, or a .json/.toml path."""
    from shardwise.config.presets import PRESETS

    if isinstance(spec, ModelShape):
        return spec
    if isinstance(spec, dict):
        values = spec.get("model", spec) if "model" in spec and isinstance(spec["model"], dict) else spec
        if HF_KEYS & set(values) or values.get("model_type") in FAMILY_READERS:
            return shape_from_hf(values)
        if "preset" in values or SHARDWISE_KEYS & set(values):
            return shape_from_shardwise(values)
        raise ValueError(f"model = {json.dumps(spec)[:60]} is invalid: give a preset name, a shardwise model "
                         f"config (dim, n_layers, ...) or a Hugging Face config (hidden_size, ...)")
    if not isinstance(spec, str) or not spec.strip():
        raise ValueError(f"model = {spec!r} is invalid: use a preset ({', '.join(PRESETS)}), a JSON object or a file")
    text = spec.strip()
    if text in PRESETS:
        return shape_from_shardwise({"preset": text}, name=text)
    if text.startswith("{"):
        try:
            return resolve_model(json.loads(text))
        except json.JSONDecodeError as err:
            raise ValueError(f"model = {text[:40]!r} is invalid JSON: {err}") from None
    path = Path(text)
    if path.suffix in (".json", ".toml") or path.is_dir():
        if path.is_dir():
            path = path / "config.json"
        if not path.is_file():
            raise FileNotFoundError(f"model = {text!r} is invalid: no such file")
        if path.suffix == ".toml":
            import tomllib

            return resolve_model(tomllib.loads(path.read_text()))
        try:
            return resolve_model(json.loads(path.read_text()))
        except json.JSONDecodeError as err:
            raise ValueError(f"model file {path} is invalid JSON: {err}") from None
    raise ValueError(f"model = {text!r} is invalid: use a preset ({', '.join(PRESETS)}), a JSON object or a file")


def with_overrides(shape: ModelShape, **fields) -> ModelShape:
    return replace(shape, **fields)
