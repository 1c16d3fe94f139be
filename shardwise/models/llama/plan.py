"""The Llama family's parallelization plan, as data (`llama_plan`): pipeline stage modules and
costs, the tied table, tensor-parallel roles, the attention module and the expert parameters.

Tensor/sequence-parallel roles: module name -> role.

Names are relative to the model (top level) or to one block (`layers.<i>.` is prefixed by the
code that applies the plan, `shardwise.distributed.tensor_parallel`, which also turns each role
into a DTensor parallel style). Megatron-style (Shoeybi et al., 2019; Korthikanti et al., 2022):

  role              what it does to the module
  colwise           weight split by output features: each rank computes some heads / some FFN units
  rowwise           weight split by input features: partial sums, all-reduced (or reduce-scattered
                    over the sequence when sequence parallel)
  vocab             embedding table split by vocabulary rows; partial lookups all-reduced
                    (reduce-scattered over the sequence when sequence parallel)
  head              output projection split by vocabulary: logits stay sharded by vocabulary,
                    and the loss is computed without gathering them (loss parallel)
  tied_head         the same for a head tied to the (vocabulary-split) embedding table
  sequence          (sequence parallel only) runs on this rank's slice of the sequence
  head_norm         a norm over each head's features (Qwen3's q/k norms), run on this rank's heads
                    (after a colwise projection): its weight stays replicated and its gradient,
                    partial per rank (only its heads), is summed over the tp ranks. Not "sequence":
                    with SP it still sees the whole sequence, split by heads, not the residual
  block_input       the input shared by a module's column-parallel matmuls: all-gathered over the
                    sequence first with SP; its gradient is reduced once for all of them

Roles the other families use (their plans say why):
  residual_norm     "sequence" whose output is the residual stream itself (BERT's post-norms)
  vocab_bias        an output bias split by vocabulary like the logits it is added to (BERT)
  sequence_scatter  a module run whole on every rank whose output enters the SP stream (ViT's
                    patch embedding); sequence_gather: the way out of it for a pooled head (ViT)
"""

from __future__ import annotations

from shardwise.core.model import ModelConfig
from shardwise.core.stage_split import stage_costs
from shardwise.models.common.plan import ATTENTION_BLOCK_PLAN, ModelPlan
from shardwise.models.llama.spec import SPEC


def block_plan(cfg: ModelConfig, layer_idx: int | None = None) -> dict[str, str]:
    """The plan of block `layer_idx`. A mixture-of-experts MLP is not split by tensor parallelism
    (tp ranks replicate it and route the same tokens; expert parallelism splits its experts)."""
    plan = {
        **ATTENTION_BLOCK_PLAN,
        "mlp": "block_input",
        "mlp.gate_proj": "colwise",
        "mlp.up_proj": "colwise",
        "mlp.down_proj": "rowwise",
    }
    if cfg.qk_norm:
        plan |= {"attn.q_norm": "head_norm", "attn.k_norm": "head_norm"}
    if not cfg.parallel_block:
        plan["mlp_norm"] = "sequence"
    if layer_idx is not None and cfg.is_moe_layer(layer_idx):
        plan = {name: role for name, role in plan.items() if not name.startswith("mlp.") and name != "mlp"}
    return plan


def top_plan(cfg: ModelConfig) -> dict[str, str]:
    # A tied head multiplies by the embedding table, already split by vocabulary rows: it only
    # needs its input as a whole-sequence DTensor, and its logits come out split by vocabulary.
    return {"embed_tokens": "vocab", "norm": "sequence", "lm_head": "tied_head" if cfg.tie_embeddings else "head"}


def is_expert_param(name: str) -> bool:
    """A routed expert's weight: `layers.<i>.mlp.experts.<gate|up|down>_proj`."""
    return ".mlp.experts." in f".{name}"


def llama_plan(cfg: ModelConfig) -> ModelPlan:
    return ModelPlan(
        blocks="layers",
        first_stage=("embed_tokens",),
        last_stage=("norm", "lm_head"),
        tied_table="embed_tokens" if cfg.tie_embeddings else None,
        stage_costs=lambda seq_len: stage_costs(cfg, SPEC, seq_len),
        tp_top=top_plan(cfg),
        tp_block=lambda layer: block_plan(cfg, layer),
        attention="attn",
        positions_kwarg="positions_S",
        targets_kwarg="targets_BS",
        lora_roles=SPEC.lora_roles,
        document_ids_kwarg="document_ids_BS",
        is_expert_param=is_expert_param,
    )
