"""A model family's parallelization plan: the names and roles a layout needs, as data.

`shardwise.distributed` applies every parallelism from this plan alone, so it names no
model's modules: a new family gets every layout by writing one `plan.py` that returns a
`ModelPlan` (see `shardwise/models/llama/plan.py`, and tests/distributed/toy_family.py for a
deliberately different family). Module names are relative to the model (or, for the
`tp_block` roles and `attention`, to one block).

What each layout reads:
  pipeline (pp)      `blocks` (a ModuleDict keyed by layer index), `first_stage` / `last_stage`
                     (modules only the first / last stage keeps), `tied_table` and
                     `stage_costs` (FLOPs per token of each block, of the first-stage extras,
                     of the last-stage extras: the splitter balances them)
  tensor (tp, sp)    `tp_top` and `tp_block(layer)`: module name -> role (see
                     distributed/tensor_parallel.py for the roles)
  context (cp)       `attention`: the module in each block whose `core_attention` (q, k, v ->
                     out) is swapped; `positions_kwarg`: the model's keyword for the global
                     positions of its tokens
  training step      `targets_kwarg` (the model returns the loss), `document_ids_kwarg` (packed
                     micro-batches' document ids)
  expert (ep)        MoE layers are found by type (`models.common.moe.MoE`); `is_expert_param`
                     tells their routed experts' parameters by name
  FSDP (zero 3)      each block is an all-gather unit; each pipeline part is a root
  recompute          each block is recomputed as a whole
  LoRA               `lora_roles`: role name (train.lora_targets) -> the linear of a block that gets an
                     adapter (models/common/lora.py); its tensor-parallel role splits the adapter too
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field


ATTENTION_BLOCK_PLAN = {
    "attn_norm": "sequence",
    "attn": "block_input",
    "attn.q_proj": "colwise",
    "attn.k_proj": "colwise",
    "attn.v_proj": "colwise",
    "attn.o_proj": "rowwise",
}
"""The `tp_block` roles of a pre-norm block's attention half (`attn_norm`, `attn.{q,k,v,o}_proj`),
shared by the families whose blocks name them so (llama, gpt2)."""


@dataclass(frozen=True, kw_only=True)
class ModelPlan:
    blocks: str = "layers"
    """The ModuleDict holding the blocks, keyed by layer index (names stay stable when a
    pipeline stage removes some)."""
    first_stage: tuple[str, ...] = ()
    """Modules only the first pipeline stage holds (the embedding)."""
    last_stage: tuple[str, ...] = ()
    """Modules only the last pipeline stage holds (final norm, output head)."""
    tied_table: str | None = None
    """The module whose weight the output head shares (the embedding), or None: the last stage
    keeps a copy of it and the two copies' gradients are summed."""
    stage_costs: Callable[[int], tuple[list[float], float, float]] = None
    """seq_len -> (cost of each block, of the first-stage modules, of the last-stage modules)."""
    tp_top: dict[str, str] = field(default_factory=dict)
    """Tensor-parallel roles of top-level modules."""
    tp_block: Callable[[int], dict[str, str]] = lambda layer: {}
    """Tensor-parallel roles of the modules of block `layer`."""
    attention: str = "attn"
    """The attention module of a block (its `core_attention` is what context parallelism swaps)."""
    positions_kwarg: str = "positions_S"
    """The model's keyword argument for its tokens' global positions."""
    document_ids_kwarg: str | None = None
    """The model's keyword for the document each token belongs to (packed batches: a token attends
    only earlier tokens of its own document, positions restart per document), or None: the family
    takes no document ids."""
    targets_kwarg: str | None = None
    """The model's keyword for the targets that makes it return the mean loss itself (the
    chunked linear-cross-entropy, `train.chunked_loss`), or None: the loss is taken on its logits."""
    needs_targets: bool = False
    """The model reads the targets itself on every layout (T5: its decoder's inputs are the targets
    shifted right), through `targets_kwarg`, and returns the loss."""
    is_expert_param: Callable[[str], bool] = lambda name: False
    """Whether a parameter (by its full name) is a routed expert's (sharded by expert parallelism)."""
    lora_roles: Mapping[str, str] = field(default_factory=dict)
    """LoRA: role name -> the linear it names within a block (the family spec's `lora_roles`)."""
    extra_blocks: tuple[str, ...] = ()
    """Further block stacks (T5's decoder, a ModuleDict each): tensor parallelism, FSDP units,
    recomputation and compilation treat their blocks as `blocks`' own. Pipeline and context
    parallelism read `blocks` only; a family with extra stacks refuses them."""
    tp_extra_block: Callable[[str, int], dict[str, str]] = lambda stack, layer: {}
    """Tensor-parallel roles of the modules of block `layer` of the extra stack `stack`."""

    def tp_roles(self, stack: str, layer: int) -> dict[str, str]:
        """The tensor-parallel roles of block `layer` of `stack` (`blocks` or an extra stack)."""
        return self.tp_block(layer) if stack == self.blocks else self.tp_extra_block(stack, layer)

    def all_blocks(self, part):
        """(stack, layer index, block) of every block `part` holds, `blocks` first."""
        for stack in (self.blocks, *self.extra_blocks):
            for index, block in (getattr(part, stack, None) or {}).items():
                yield stack, int(index), block
