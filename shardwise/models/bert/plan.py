"""The BERT family's parallelization plan, as data (`bert_plan`). The roles are those of
`shardwise/models/gpt2/plan.py` (see its table and llama's); what differs:

  three tables    token, position and token-type tables all take role "vocab": rows split over
                  the tp ranks, partial lookups summed (reduce-scattered over the sequence under
                  SP), so the three sums line up slice by slice. The model looks each up with an
                  index tensor (the type table with zeros), never by slicing a weight
  post-norm       `attn_norm` / `mlp_norm` (and `embed_norm`) follow the residual sums instead of
                  preceding the sublayers: their output is the residual stream itself, so under
                  SP they hand on a plain local slice ("residual_norm"), as rowwise outputs do
  MLM head        `head_transform` (dense, GELU, LayerNorm: per token) runs replicated on a
                  rank's sequence slice: its dense and norm are "sequence" each (DTensor's
                  SequenceParallel replicates a module's own parameters, not a submodule's);
                  `lm_head` gives vocabulary-sharded logits and `lm_bias` ("vocab_bias") adds
                  its own shard of the output bias to them
  loss            taken on the logits (`targets_kwarg` None): the chunked linear cross-entropy
                  has no output bias
  pipeline        the first stage embeds (three tables and the embedding LayerNorm); the last
                  holds the MLM head (and, tied, a copy of the token table)

Refused: context parallelism. Attention is bidirectional, so every query needs every key of the
sequence, and the ring / all-to-all cores (distributed/ring_attention.py, context_parallel.py)
compute causal attention. The padding mask is a second input of each block and attention core.
"""

from __future__ import annotations

from shardwise.core import model_counts
from shardwise.core.model import ModelConfig
from shardwise.core.stage_split import stage_costs
from shardwise.models.bert.spec import SPEC
from shardwise.models.common.plan import ATTENTION_BLOCK_PLAN, ModelPlan

BLOCK_PLAN = {
    **ATTENTION_BLOCK_PLAN,
    "attn_norm": "residual_norm",
    "mlp_norm": "residual_norm",
    "mlp": "block_input",
    "mlp.up_proj": "colwise",
    "mlp.down_proj": "rowwise",
}


def top_plan(cfg: ModelConfig) -> dict[str, str]:
    return {"embed_tokens": "vocab", "embed_positions": "vocab", "embed_types": "vocab", "embed_norm": "residual_norm",
            "head_transform.dense": "sequence", "head_transform.norm": "sequence",
            "lm_head": "tied_head" if cfg.tie_embeddings else "head", "lm_bias": "vocab_bias"}


def bert_stage_costs(cfg: ModelConfig, seq_len: int) -> tuple[list[float], float, float]:
    """The splitter's costs (config/stage_split.py), 6 FLOPs per parameter per token; a BERT
    block has GPT-2's count traits (the same tensors, in another order). The first stage
    scatters three lookups' gradients and runs the embedding LayerNorm; the last runs the masked-LM
    transform, the output projection (tied or not, a matmul) and the output bias."""
    blocks, _, _ = stage_costs(cfg, SPEC, seq_len)
    first = 3 * 2.0 * cfg.dim + 6.0 * model_counts.input_compute_params(cfg, SPEC)
    tied_table = cfg.vocab_size * cfg.dim if cfg.tie_embeddings else 0
    last = 6.0 * (model_counts.output_head_params(cfg, SPEC) + tied_table)
    return blocks, first, last


def bert_plan(cfg: ModelConfig) -> ModelPlan:
    return ModelPlan(
        blocks="layers",
        first_stage=("embed_tokens", "embed_positions", "embed_types", "embed_norm"),
        last_stage=("head_transform", "lm_head", "lm_bias"),
        tied_table="embed_tokens" if cfg.tie_embeddings else None,
        stage_costs=lambda seq_len: bert_stage_costs(cfg, seq_len),
        tp_top=top_plan(cfg),
        tp_block=lambda layer: dict(BLOCK_PLAN),
        attention="attn",
        positions_kwarg="positions_S",
        targets_kwarg=None,
    )
