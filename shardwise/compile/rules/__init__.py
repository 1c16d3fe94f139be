"""Declarative rewrite rules: a source pattern, a result pattern and constraints, in Python.

Each rule (one short file here) writes its pattern the way model code naively writes the
operation (RMSNorm as float / pow / mean / rsqrt, SwiGLU as silu(a) * b, ...) and its
replacement as one call of a fused operation (`shardwise/compile/fused.py`). `registry.RULES`
lists them in the order they are tried (a longer pattern before one it contains).

How they are applied, and why this way: the compile step (`compile/regional.py`) compiles each
block with `rules_backend`, which receives the block graph dynamo captured (torch-level calls,
one graph per block), rewrites it with `torch.fx.subgraph_rewriter` (pattern placeholders match
tensors and literals alike, so eps and dtypes are constraints, not part of the pattern), then
hands it to inductor. Rewriting before inductor, not inside it with `register_replacement`,
keeps the rules at the level the model is written in (a pattern is a few lines of the same
torch code), needs no private inductor hooks that move between torch 2.11 and 2.13, and lets
`shardwise rules` count matches without compiling. Inductor then differentiates and partitions
the rewritten graph, so a rule changes what is saved for backward only through its fused op.

The output projection + cross-entropy cannot be a graph rule (the loss is taken outside the
compiled blocks, in a chunk loop that must not be fused back into one buffer): it is a
module-level replacement, `models/common/chunked_loss.py`, switched by `train.chunked_loss`.
"""
