"""The GPT-2 family's parallelization plan, as data (`gpt2_plan`). The roles are those of
`shardwise/models/llama/plan.py` (see its table); what differs:

  biases          colwise q/k/v and up_proj split their biases with their output features;
                  rowwise o_proj and down_proj keep theirs whole, added once after the reduction
  position table  role "vocab" like the token table: its rows (positions) split over the tp
                  ranks and the partial lookups summed. Under sequence parallelism the token
                  embeddings come out split by sequence, and the position vectors they are added
                  to must be split the same way, which this role does (reduce-scatter over the
                  sequence); a replicated table would give every rank the whole sequence's vectors
  LayerNorms      "sequence": per token, so they run on a rank's slice of the sequence under SP
  pipeline        the first stage embeds tokens and adds positions; the last holds the final
                  norm and the head (and, tied, a copy of the token table)
"""

from __future__ import annotations

from shardwise.core.model import ModelConfig
from shardwise.core.stage_split import stage_costs
from shardwise.models.common.plan import ATTENTION_BLOCK_PLAN, ModelPlan
from shardwise.models.gpt2.spec import SPEC

BLOCK_PLAN = {
    **ATTENTION_BLOCK_PLAN,
    "mlp_norm": "sequence",
    "mlp": "block_input",
    "mlp.up_proj": "colwise",
    "mlp.down_proj": "rowwise",
}


def top_plan(cfg: ModelConfig) -> dict[str, str]:
    return {"embed_tokens": "vocab", "embed_positions": "vocab", "norm": "sequence",
            "lm_head": "tied_head" if cfg.tie_embeddings else "head"}


def gpt2_stage_costs(cfg: ModelConfig, seq_len: int) -> tuple[list[float], float, float]:
    """The splitter's costs (config/stage_split.py; blocks counted by model_counts from GPT-2's traits):
    the first stage scatters two lookups' gradients (tokens and positions), the last one's norm
    has a bias too."""
    blocks, embedding, head = stage_costs(cfg, SPEC, seq_len)
    return blocks, 2 * embedding, head + 6.0 * cfg.dim


def gpt2_plan(cfg: ModelConfig) -> ModelPlan:
    return ModelPlan(
        blocks="layers",
        first_stage=("embed_tokens", "embed_positions"),
        last_stage=("norm", "lm_head"),
        tied_table="embed_tokens" if cfg.tie_embeddings else None,
        stage_costs=lambda seq_len: gpt2_stage_costs(cfg, seq_len),
        tp_top=top_plan(cfg),
        tp_block=lambda layer: dict(BLOCK_PLAN),
        attention="attn",
        positions_kwarg="positions_S",
        targets_kwarg="targets_BS",
        lora_roles=SPEC.lora_roles,
        document_ids_kwarg="document_ids_BS",
    )
