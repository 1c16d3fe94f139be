"""Regional compilation: each block is compiled on its own, in place (`nn.Module.compile`).

Why per block and not the whole model:
- compile time: the blocks of a model run the same code, so dynamo traces one graph and reuses
  it for every block (their parameters are graph inputs, not constants); a whole-model compile
  traces all L of them;
- layouts: what sits between blocks — a pipeline stage boundary, FSDP2's all-gather and
  reduce-scatter hooks, DDP's bucketed all-reduce, the embedding and the loss — stays eager and
  works exactly as without compilation; tensor and expert parallelism act inside the block
  through DTensor and the experts' all-to-all, which dynamo traces; context parallelism's attention
  core (its collectives) runs eagerly between the block's graphs (distributed/context_parallel.py);
- recomputation is already applied when the compile step runs (parallelize's order), so the
  compiled region is the block as it will run, checkpoint included.

`nn.Module.compile` compiles the module's call in place: the module, its class and its
parameter names stay what they were, so checkpoints and plans are unchanged.
"""

from __future__ import annotations

from shardwise.core.errors import invalid
from shardwise.core.layout_rules import CONFIG_NAMES, compile_violations


def check_compile(cfg, *, tp: int) -> None:
    """Stop before any work where compiled blocks do not run yet (`layout_rules.compile_violations`;
    the planner's `runtime_refuses` applies the same rules)."""
    first = next(compile_violations(compile=cfg.train.compile, tp=tp, sp=cfg.parallel.sp,
                                    recompute=cfg.train.recompute), None)
    if first is not None:
        raise invalid(CONFIG_NAMES[first.field], first.value, first.fix_for(CONFIG_NAMES))


def compile_blocks(parts, plan, *, fullgraph: bool = False, rules: bool = True,
                   backward_runs_twice: bool = False, inside_checkpoint: bool = False) -> None:
    """Compile every block of the model parts in place, with the rewrite rules
    (compile/rules/) applied to each block graph before inductor unless `rules` is False.
    `fullgraph=True` makes a graph break an error (the tests use it to prove a block compiles
    as one graph). `backward_runs_twice`: a zero-bubble schedule runs each block's backward
    once for the input gradient (keeping the graph) and again for the weight gradients, which
    a compiled backward that reuses ("donates") its saved buffers refuses; donation is turned
    off then (process-wide: AOTAutograd reads it when each graph compiles). `inside_checkpoint`:
    compile each block's parts (its norms, attention and MLP) and leave the block's own forward,
    which the recomputation wraps in a checkpoint, eager: tensor parallelism's DTensors saved
    by a checkpoint traced into a graph are refused by AOTAutograd (torch 2.13), and an eager
    full-recompute checkpoint around compiled parts runs them again in backward as it would
    eager ones."""
    import torch._functorch.config

    from shardwise.compile.rules.backend import rules_backend

    if backward_runs_twice:
        torch._functorch.config.donated_buffer = False

    backend = rules_backend if rules else "inductor"

    def compile_one(module):
        module.compile(backend=backend, fullgraph=fullgraph, dynamic=False)

    for part in parts:
        part.compiled_loss = True  # a decoder's chunked loss fuses its per-chunk softmax (decoder_output)
        for _, _, block in plan.all_blocks(part):
            for region in (block.children() if inside_checkpoint else (block,)):
                compile_regions(region, compile_one)


def is_data_dependent(module) -> bool:
    return getattr(module, "data_dependent", False)


def compile_regions(module, compile_one) -> None:
    """Compile `module` whole, unless it holds a module whose work depends on data values
    (`data_dependent = True`: a mixture-of-experts layer's experts); then compile each of its
    children the same way and leave that module, and the forwards around it, eager. A dense
    block is one region; a MoE block becomes its norms, attention, router and shared experts,
    each one graph, with the residual adds, the dispatch and the experts eager."""
    if is_data_dependent(module):
        return
    if not any(is_data_dependent(m) for m in module.modules()):
        compile_one(module)
        return
    for child in module.children():
        compile_regions(child, compile_one)


def graph_breaks() -> dict[str, int]:
    """Graph breaks dynamo has recorded in this process (reason -> count)."""
    from torch._dynamo.utils import counters

    return dict(counters["graph_break"])
