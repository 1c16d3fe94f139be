"""The config.json side of Mixtral and Qwen2-MoE (hf_moe.py maps their weights): the MoE fields
read and written, and what an export can express. Pure Python: the planner and config read it."""

from __future__ import annotations

from shardwise.core.errors import invalid

MOE_ARCHITECTURES = {"mixtral": "MixtralForCausalLM", "qwen2_moe": "Qwen2MoeForCausalLM"}


def moe_fields_from_hf(hf: dict, model_type: str, shape: dict) -> dict:
    """ModelConfig fields of a Mixtral / Qwen2-MoE config.json (empty for dense types); `shape` is
    `config/hf_config.hf_shape(hf)`, which reads the expert counts and sizes."""
    if model_type == "mixtral":
        if hf.get("router_jitter_noise"):
            raise invalid("config.json router_jitter_noise", hf["router_jitter_noise"],
                          "shardwise routers add no noise: use 0")
        return dict(n_experts=shape["n_experts"], experts_per_token=shape["experts_per_token"],
                    router_norm_topk=True, aux_loss_coef=hf.get("router_aux_loss_coef", 0.001), z_loss_coef=0.0)
    if model_type != "qwen2_moe":
        return {}
    if shape["dense_layers"]:
        raise invalid("config.json mlp_only_layers", hf["mlp_only_layers"],
                      "shardwise places MoE layers by model.moe_layer_step only: use []")
    moe_ffn, shared = shape["moe_ffn_dim"], shape["shared_ffn_dim"]
    if not shared or shared % moe_ffn:
        raise invalid("config.json shared_expert_intermediate_size", shared,
                      f"shardwise's shared experts are n x moe_intermediate_size ({moe_ffn}): use a positive multiple")
    return dict(
        n_experts=shape["n_experts"], experts_per_token=shape["experts_per_token"],
        moe_ffn_dim=moe_ffn, n_shared_experts=shared // moe_ffn, shared_expert_gate=True,
        moe_layer_step=shape["moe_layer_step"], router_norm_topk=bool(hf.get("norm_topk_prob", False)),
        aux_loss_coef=hf.get("router_aux_loss_coef", 0.001), z_loss_coef=0.0,
    )


def moe_fields_to_hf(cfg, arch: str) -> dict:
    common = dict(num_experts_per_tok=cfg.experts_per_token, router_aux_loss_coef=cfg.aux_loss_coef,
                  output_router_logits=False)
    if arch == "mixtral":
        return common | dict(num_local_experts=cfg.n_experts, router_jitter_noise=0.0)
    return common | dict(
        num_experts=cfg.n_experts, moe_intermediate_size=cfg.expert_ffn_dim,
        shared_expert_intermediate_size=cfg.n_shared_experts * cfg.expert_ffn_dim,
        decoder_sparse_step=cfg.moe_layer_step, mlp_only_layers=[], norm_topk_prob=cfg.router_norm_topk,
        qkv_bias=cfg.qkv_bias,
    )


def check_moe_exportable(cfg, arch: str) -> None:
    """Stop before writing when `arch` cannot express this model's MLPs."""
    if not cfg.n_experts:
        if arch in MOE_ARCHITECTURES:
            raise invalid("arch", arch, "the model has no experts (model.n_experts = 0): use llama, mistral, qwen2 or qwen3")
        return
    if arch not in MOE_ARCHITECTURES:
        raise invalid("arch", arch, f"a mixture-of-experts model exports as {' or '.join(MOE_ARCHITECTURES)}")
    if cfg.router_score != "softmax" or cfg.router_bias_update_rate:
        raise invalid("model.router_score", cfg.router_score,
                      f"HF {arch} routes by softmax without a selection bias: export softmax routers only")
    if arch == "mixtral":
        needs = dict(n_shared_experts=0, moe_layer_step=1, router_norm_topk=True, qkv_bias=False)
        for name, value in needs.items():
            if getattr(cfg, name) != value:
                raise invalid(f"model.{name}", getattr(cfg, name), f"HF Mixtral needs {value}: export as qwen2_moe?")
        if cfg.expert_ffn_dim != cfg.ffn_dim:
            raise invalid("model.moe_ffn_dim", cfg.moe_ffn_dim, "HF Mixtral experts are ffn_dim wide: use 0")
    elif not cfg.n_shared_experts or not cfg.shared_expert_gate:
        raise invalid("model.n_shared_experts", cfg.n_shared_experts,
                      "HF Qwen2-MoE always has a gated shared expert: set n_shared_experts > 0 and shared_expert_gate")
