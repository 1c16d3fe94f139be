"""The GPT-2 family as data: a pre-norm causal decoder with LayerNorm (with biases), learned
absolute positions, a GELU (tanh) MLP and plain multi-head attention, biases on every projection.
The HF config mapping is hf_config.py; the torch side is family.py."""

from shardwise.core.family import ATTENTION_LORA_ROLES, FamilySpec

SPEC = FamilySpec(
    name="gpt2",
    objective="causal_lm",
    multi_head=True,
    heads_span_dim=True,
    chunked_loss=True,
    layer_norm=True,
    linear_biases=True,
    mlp="gelu",
    position_table="sequence",
    norm_saved_tensors=2,
    mlp_saved_per_ffn_dim=2,
    lora_roles={**ATTENTION_LORA_ROLES, "up": "mlp.up_proj", "down": "mlp.down_proj"},
    hf_model_types=("gpt2",),
)
