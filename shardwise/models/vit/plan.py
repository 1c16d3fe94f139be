"""The ViT family's parallelization plan, as data (`vit_plan`). The block roles are GPT-2's
(shardwise/models/gpt2/plan.py): colwise q/k/v and up_proj, rowwise o_proj and down_proj, the
LayerNorms "sequence". What differs is around the blocks:

  embedding       role "sequence_scatter": the patch projection, class token and position table are
                  small and run whole on every rank (no vocabulary to split); under sequence
                  parallelism each rank keeps its slice of the output sequence
  pool            role "sequence_gather": the class token sits on the first rank's slice, so the
                  sequence is gathered before the pool; the final norm and the classifier then run
                  replicated on [B, D], too small to split
  pipeline        the first stage embeds the images; the last holds the pool, norm and classifier
  context         refused: attention is bidirectional (no causal ring to balance) and the sequence
                  is short (197 tokens for ViT-B/16 at 224 pixels), so there is nothing to gain;
                  `positions_kwarg` is set only because the plan has the field
  loss            the model returns its mean cross-entropy itself (`targets_B`): the trainer's
                  token loss is for [B, S, vocab] logits
"""

from __future__ import annotations

from shardwise.core import model_counts
from shardwise.core.model import ModelConfig
from shardwise.models.common.plan import ATTENTION_BLOCK_PLAN, ModelPlan
from shardwise.models.vit.spec import SPEC

BLOCK_PLAN = {
    **ATTENTION_BLOCK_PLAN,
    "mlp_norm": "sequence",
    "mlp": "block_input",
    "mlp.up_proj": "colwise",
    "mlp.down_proj": "rowwise",
}
TOP_PLAN = {"embed": "sequence_scatter", "pool": "sequence_gather"}


def vit_stage_costs(cfg: ModelConfig) -> tuple[list[float], float, float]:
    """The splitter's costs (config/stage_split.py), training FLOPs per token of the sequence, from
    model_counts (a ViT block has GPT-2's count traits: the same tensors). The sequence is
    fixed by the image (max_seq_len = patches + 1), whatever sequence length the caller passes, so
    it is used here. The first stage projects each patch (model_counts' input compute: the
    [C*p*p -> D] matmul with bias; the class token and position table are lookups, no FLOPs to
    speak of); the last stage's norm and classifier see one token (the class token) of every S."""
    seq_len = cfg.max_seq_len
    attention = model_counts.attention_flops_per_token(cfg, seq_len)
    blocks = [float(6 * model_counts.block_params(cfg, SPEC, i) + attention) for i in range(cfg.n_layers)]
    embedding = 6.0 * model_counts.input_compute_params(cfg, SPEC)
    head = 6.0 * (model_counts.params_per_norm(cfg, SPEC) + model_counts.output_head_params(cfg, SPEC)) / seq_len
    return blocks, embedding, head


def vit_plan(cfg: ModelConfig) -> ModelPlan:
    return ModelPlan(
        blocks="layers",
        first_stage=("embed",),
        last_stage=("pool", "norm", "classifier"),
        tied_table=None,
        stage_costs=lambda seq_len: vit_stage_costs(cfg),
        tp_top=dict(TOP_PLAN),
        tp_block=lambda layer: dict(BLOCK_PLAN),
        attention="attn",
        positions_kwarg="positions_S",
        targets_kwarg="targets_B",
    )
