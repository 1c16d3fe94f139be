"""The T5 family's parallelization plan, as data (`t5_plan`). Roles as in llama's and gpt2's plans
(pre-norm blocks: norms "sequence", projections colwise in / rowwise out, each sublayer's
module "block_input"); what differs:

  two stacks      `blocks` is `encoder_layers`, `extra_blocks` adds `decoder_layers`: tensor
                  parallelism, FSDP units, recomputation and compilation treat both alike
  one block plan  `tp_block` is the union of both blocks' roles: `styles` skips the modules a
                  block lacks (an encoder block has no `cross_*`, a v1.0 MLP no `gate_proj`)
  cross-attention `cross_attn` is "block_input" for its queries' input (the decoder stream); its
                  second input, the encoder output, is left as it comes (replicated: the colwise
                  k/v take it as Replicate, and each reduces its input gradient in backward).
                  Under SP the encoder's final norm is "sequence_gather": the encoder output is
                  all-gathered once there, not in every decoder block
  position bias   each stack's table [buckets, heads] takes role "colwise": ColwiseParallel splits
                  an nn.Embedding by columns (Shard(1), the heads), in the same contiguous chunks
                  as the colwise q/k/v split their output features, so each rank looks up the
                  bias of exactly its own heads and the attention core adds a [1, heads/tp, S, T]
                  bias to [B, heads/tp, S, T] scores. Slicing a replicated table inside the model
                  by the local head count would need the rank (models know nothing of
                  distribution); one process applies no role, so its results are unchanged
  head            tied (v1.0): "tied_head", the scaling by dim**-0.5 is elementwise on the
                  decoder-norm output; untied (v1.1): "head". The loss is the model's own
                  (`targets_kwarg`): the decoder's inputs come from the targets

What works, each tested equal to one process (tests/distributed/test_encoder_layouts.py): dp,
ZeRO-0 to 3 (each decoder block its own FSDP unit), tp, tp + sp. The model reads the targets on every
layout (`needs_targets`: its decoder's inputs are the targets shifted right), and takes the lengths
of its position biases and causal mask from the token ids (under SP a stream holds a rank's slice).

Refused: pipeline parallelism — every decoder block reads the encoder output besides its own
hidden state, and a pipeline stage hands on one activation; the stages would also cut across two
stacks whose lengths differ. Context parallelism — the encoder attends both ways and every score
carries a relative-position bias of the global query/key distance; the ring / all-to-all cores
compute causal, unbiased attention. Sequence parallelism unless `data.length_multiple` is a multiple
of tp — span corruption gives the encoder and decoder sequences odd lengths (seq_len - 2n + 1 and
4n + 1), which that field rounds (the input cut, the targets padded with ignored positions).
config/layout_rules.py refuses these before any work.
"""

from __future__ import annotations

from shardwise.models.common.plan import ATTENTION_BLOCK_PLAN, ModelPlan

BLOCK_PLAN = {
    **ATTENTION_BLOCK_PLAN,
    "cross_norm": "sequence",
    "cross_attn": "block_input",
    "cross_attn.q_proj": "colwise",
    "cross_attn.k_proj": "colwise",
    "cross_attn.v_proj": "colwise",
    "cross_attn.o_proj": "rowwise",
    "mlp_norm": "sequence",
    "mlp": "block_input",
    "mlp.up_proj": "colwise",
    "mlp.gate_proj": "colwise",
    "mlp.down_proj": "rowwise",
}
"""The roles of an encoder and of a decoder block (a block lacks some: they are skipped)."""


def top_plan(cfg) -> dict[str, str]:
    return {"embed_tokens": "vocab", "encoder_rel_bias": "colwise", "decoder_rel_bias": "colwise",
            "encoder_norm": "sequence_gather", "decoder_norm": "sequence",
            "lm_head": "tied_head" if cfg.tie_embeddings else "head"}


def t5_plan(cfg) -> ModelPlan:
    return ModelPlan(
        blocks="encoder_layers",
        tied_table="embed_tokens" if cfg.tie_embeddings else None,
        tp_top=top_plan(cfg),
        tp_block=lambda layer: dict(BLOCK_PLAN),
        attention="attn",
        targets_kwarg="targets_BT",
        needs_targets=True,
        extra_blocks=("decoder_layers",),
        tp_extra_block=lambda stack, layer: dict(BLOCK_PLAN),
    )
