"""Tensor and sequence parallelism: applies a model's plan (`ModelPlan.tp_top` / `tp_block`,
roles by module name) with PyTorch's DTensor parallel styles over the `tp` mesh axis.

With sequence parallelism the residual stream between blocks holds 1/tp of the sequence:
norms run on the local slice, each block's matmuls all-gather the sequence first and
reduce-scatter their output, instead of the all-reduce plain TP does (the same bytes on the
wire: all-gather + reduce-scatter = all-reduce). The vocabulary splits as `torch.chunk` cuts it
(it need not divide by tp). The loss never gathers the logits: with `train.chunked_loss` (the
default) each rank takes its vocabulary columns a chunk of tokens at a time and all-reduces the
softmax's statistics (distributed/vocab_parallel_loss.py); without it the
head's logits stay sharded by vocabulary and `loss_parallel` takes the cross-entropy.

Written by hand: only the role -> style table and the checks; the styles, the DTensor
collectives and loss parallel are PyTorch's.
"""

from __future__ import annotations

import inspect

from torch import nn
from torch.distributed._functional_collectives import AsyncCollectiveTensor
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_module, distribute_tensor
from torch.distributed.tensor.parallel.style import ParallelStyle
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    PrepareModuleOutput,
    RowwiseParallel,
    SequenceParallel,
    loss_parallel,
    parallelize_module,
)

from shardwise.distributed.lora_layout import adapted_style
from shardwise.distributed.vocab_parallel_loss import vocab_parallel_operands
from shardwise.models.common.plan import ModelPlan


def style_for(role: str, sp: bool, num_inputs: int = 1):
    """The DTensor parallel style of a plan role (None: nothing to do without sequence parallel).
    `num_inputs`: positional inputs of the module's forward (only the first is the sequence)."""
    seq = Shard(1)  # [batch, sequence, features]: the sequence dimension
    between_blocks = seq if sp else Replicate()
    if role == "colwise":
        return ColwiseParallel()
    if role == "rowwise":
        return RowwiseParallel(output_layouts=between_blocks)
    if role == "vocab":
        return RowwiseParallel(input_layouts=Replicate(), output_layouts=between_blocks)
    if role == "head":
        return ColwiseParallel(input_layouts=between_blocks, output_layouts=Shard(-1), use_local_output=False)
    if role == "tied_head":
        # h as a replicated DTensor times the Shard(0) table gives Shard(-1) logits; in backward
        # the partial gradient of h is reduced once here, as for the untied head.
        return PrepareModuleInput(input_layouts=(between_blocks,), desired_input_layouts=(Replicate(),),
                                  use_local_output=False)
    if role == "sequence":
        return SequenceParallel() if sp else None
    if role == "residual_norm":
        # A per-token module whose output IS the residual stream (a post-norm block's norms, BERT's
        # embedding norm): handed on as a plain local slice, as the rowwise projections' outputs
        # are, so the next residual sum adds like to like.
        return SequenceParallel(use_local_output=True) if sp else None
    if role == "head_norm":
        # A norm over each head's features, run on this rank's heads ([batch, seq, heads, head_dim],
        # heads split by the colwise projection before it), with or without SP: SequenceParallel's
        # machinery on the heads dimension. Its weight is replicated; each rank's gradient covers
        # only its heads, and DTensor sums the partial gradients over tp, as for the SP norms.
        return SequenceParallel(sequence_dim=2, use_local_output=True)
    if role == "vocab_bias":
        return VocabBiasParallel()
    if role == "sequence_scatter":
        # A module run whole on every rank (ViT's patch embedding: no vocabulary to split) whose
        # output enters the sequence-parallel residual stream: each rank keeps its slice of the
        # sequence. Backward all-gathers the slices' gradients, so every rank's replicated
        # parameters get the whole, identical gradient.
        return PrepareModuleOutput(output_layouts=Replicate(), desired_output_layouts=seq) if sp else None
    if role == "sequence_gather":
        # The way out of the sequence-parallel stream for a head that needs the whole sequence
        # (ViT's class-token pool): all-gather, then run replicated. Backward keeps each rank's
        # slice of the (identical) gradient.
        return PrepareModuleInput(input_layouts=(seq,), desired_input_layouts=(Replicate(),),
                                  use_local_output=True) if sp else None
    if role == "block_input":
        # One DTensor input shared by all of the module's column-parallel matmuls (q/k/v, gate/up):
        # in backward their partial input-gradients are summed first and reduced ONCE here
        # (all-reduce; reduce-scatter over the sequence with SP), as Megatron's f operator does,
        # instead of once per matmul. Inputs after the first (rope cos/sin, KV cache) are left alone.
        rest = (None,) * (num_inputs - 1)
        return PrepareModuleInput(input_layouts=(between_blocks, *rest), desired_input_layouts=(Replicate(), *rest),
                                  use_local_output=False)
    raise ValueError(f"unknown tensor-parallel role {role!r} in the model's sharding plan")


class VocabBiasParallel(ParallelStyle):
    """The output bias of a masked-LM head (BERT's `cls.predictions.bias`, a module whose forward
    adds its `bias` [vocab] to the logits): split by vocabulary like the logits it is added to
    (Shard(-1) from the head), so each rank adds its own slice."""

    def _apply(self, module: nn.Module, device_mesh) -> nn.Module:
        def shard_bias(name, mod, mesh):
            for param_name, param in list(mod.named_parameters(recurse=False)):
                sharded = nn.Parameter(distribute_tensor(param, mesh, [Shard(0)]), requires_grad=param.requires_grad)
                mod.register_parameter(param_name, sharded)

        return distribute_module(module, device_mesh, shard_bias)


def styles(root, plan: dict[str, str], sp: bool) -> dict:
    """Styles for the plan's modules that `root` has (a pipeline stage lacks some)."""
    modules, found = dict(root.named_modules()), {}
    for name, role in plan.items():
        if name not in modules:
            continue
        num_inputs = len(inspect.signature(modules[name].forward).parameters)
        if (style := style_for(role, sp, num_inputs)) is not None:
            found[name] = adapted_style(modules[name], style)  # a LoRA adapter splits as its base
    return found


def apply_tp(parts, plan: ModelPlan, tp_mesh, *, sp: bool) -> None:
    """Parallelize each model part (a whole model or pipeline stages, on meta or materialised)
    in place over `tp_mesh`, by the plan's roles."""
    for part in parts:
        parallelize_module(part, tp_mesh, styles(part, plan.tp_top, sp))
        part.split_vocabulary = vocab_parallel_operands  # the chunked loss over each rank's vocabulary rows
        modules = dict(part.named_modules())
        for name, role in plan.tp_top.items():
            if role == "vocab" and name in modules:
                modules[name].register_forward_hook(complete_output)
        for stack, index, block in plan.all_blocks(part):
            parallelize_module(block, tp_mesh, styles(block, plan.tp_roles(stack, index), sp))


def complete_output(module, inputs, output):
    """The vocabulary-parallel embedding's output as a plain tensor whose collective has
    completed: DTensor's styles return it as an AsyncCollectiveTensor (the all-reduce or
    reduce-scatter still in flight), and a compiled block given one as input returns its
    gradient as a plain tensor where DTensor's redistribute backward needs a DTensor
    (AttributeError `_local_tensor`, torch 2.13). A copy waits for it and unwraps it (a view
    would not: views of it stay asynchronous); the next block needs the value at once, so no
    overlap is lost, and the in-flight buffer is freed as the copy is made."""
    return output.clone() if isinstance(output, AsyncCollectiveTensor) else output


def tensor_parallel_context():
    """Around forward, loss and backward: loss_parallel computes the cross-entropy on
    vocabulary-sharded logits without gathering them."""
    return loss_parallel()


def align_grad_placements(model) -> None:
    """Give each gradient its parameter's placement. DTensor's embedding backward returns the
    vocabulary-parallel table's gradient replicated (full size on every rank); re-sharding it
    is a local slice, and frees 1 - 1/tp of that memory before any reduction moves it."""
    for param in model.parameters():
        grad = param.grad
        if isinstance(grad, DTensor) and grad.placements != param.placements:
            param.grad = grad.redistribute(param.device_mesh, param.placements)
