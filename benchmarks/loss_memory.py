"""Peak extra memory of the loss (output projection + cross-entropy, forward and backward):
today's logits-then-`token_loss` path against the chunked linear-cross-entropy, each in a
fresh process, measured as the resident-set high-water mark (VmHWM) above the resident set
once the inputs exist.

    python benchmarks/loss_memory.py [--tokens 8192] [--vocab 131072] [--dim 256] [--autocast bfloat16] [--tp 2]

`--tp N`: the same under tensor parallelism, N gloo processes, each holding its rows of the head
weight (a DTensor split by vocabulary): "full" is the vocabulary-sharded logits and torch's
`loss_parallel` cross-entropy (`train.chunked_loss = false`), "chunked" the chunked loss over each
rank's columns; the figure is the largest rank's. Prints one JSON object; docs/benchmarks.md
records the figures. Linux only (/proc/self/status).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile

CHILD = r"""
import sys, time, torch
from shardwise.models.common.chunked_loss import linear_cross_entropy
from shardwise.models.common.loss import token_loss
mode, tokens, vocab, dim, autocast = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), sys.argv[5]

def status(key):
    for line in open("/proc/self/status"):
        if line.startswith(key):
            return int(line.split()[1]) * 1024

torch.manual_seed(0)
h = torch.randn(1, tokens, dim, requires_grad=True)
weight = (torch.randn(vocab, dim) * 0.02).requires_grad_()
targets = torch.randint(0, vocab, (1, tokens))
h.grad, weight.grad = torch.zeros_like(h), torch.zeros_like(weight)  # the gradients exist either way
base = status("VmRSS")
start = time.perf_counter()
with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast == "bfloat16"):
    loss = token_loss(h @ weight.t(), targets) if mode == "full" else linear_cross_entropy(h, weight, targets)
loss.backward()
seconds = time.perf_counter() - start
print(status("VmHWM") - base, seconds, float(loss))
"""


TP_CHILD = r"""
import sys, time, torch, torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import loss_parallel
from shardwise.distributed.vocab_parallel_loss import vocab_parallel_operands
from shardwise.models.common.chunked_loss import linear_cross_entropy
from shardwise.models.common.loss import token_loss
mode, tokens, vocab, dim, rank, tp, store = sys.argv[1], *map(int, sys.argv[2:7]), sys.argv[7]

def status(key):
    for line in open("/proc/self/status"):
        if line.startswith(key):
            return int(line.split()[1]) * 1024

dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=tp)
mesh = init_device_mesh("cpu", (tp,))
dist.all_reduce(torch.ones(tokens))  # the group's buffers exist before the baseline
torch.manual_seed(0)
h = torch.randn(1, tokens, dim, requires_grad=True)
targets = torch.randint(0, vocab, (1, tokens))
rows = [len(r) for r in torch.arange(vocab).chunk(tp)]
local = torch.randn(rows[rank], dim, generator=torch.Generator().manual_seed(1 + rank)) * 0.02
table = torch.nn.Parameter(DTensor.from_local(local, mesh, [Shard(0)], shape=torch.Size([vocab, dim]),
                                              stride=(dim, 1)))
h.grad, table.grad = torch.zeros_like(h), torch.zeros_like(table)  # the gradients exist either way
base = status("VmRSS")
start = time.perf_counter()
if mode == "full":
    with loss_parallel():
        loss = token_loss(DTensor.from_local(h, mesh, [Replicate()]) @ table.t(), targets)
        loss.backward()
else:
    loss = linear_cross_entropy(h, table, targets, split_vocabulary=vocab_parallel_operands)
    loss.backward()
seconds = time.perf_counter() - start
loss = loss.full_tensor() if isinstance(loss, DTensor) else loss
print(status("VmHWM") - base, seconds, loss.item(), flush=True)
dist.barrier()
dist.destroy_process_group()
"""


def measure(mode: str, args) -> dict:
    if args.tp > 1:
        return measure_tp(mode, args)
    out = subprocess.run([sys.executable, "-c", CHILD, mode, str(args.tokens), str(args.vocab), str(args.dim),
                          args.autocast], check=True, capture_output=True, text=True).stdout.split()
    return {"peak_extra_GiB": round(int(out[0]) / 2**30, 3), "seconds": round(float(out[1]), 2),
            "loss": float(out[2])}


def measure_tp(mode: str, args) -> dict:
    """The loss under tensor parallelism on args.tp gloo processes (fp32): the largest rank's peak."""
    with tempfile.TemporaryDirectory() as tmp:
        store = f"{tmp}/store"
        ranks = [subprocess.Popen([sys.executable, "-c", TP_CHILD, mode, str(args.tokens), str(args.vocab),
                                   str(args.dim), str(rank), str(args.tp), store], stdout=subprocess.PIPE, text=True)
                 for rank in range(args.tp)]
        outs = [rank.communicate()[0].split() for rank in ranks]
    if any(rank.returncode for rank in ranks):
        raise SystemExit(f"a rank of the {mode} loss failed")
    return {"peak_extra_GiB": round(max(int(out[0]) for out in outs) / 2**30, 3),
            "seconds": round(max(float(out[1]) for out in outs), 2), "loss": float(outs[0][2])}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--vocab", type=int, default=131072)
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--autocast", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--tp", type=int, default=1, help="tensor-parallel processes (fp32 only)")
    args = parser.parse_args()
    if args.tp > 1 and args.autocast != "float32":
        parser.error(f"--autocast {args.autocast} with --tp {args.tp}: the tensor-parallel measurement runs in "
                     "float32; drop --autocast")
    full, chunked = measure("full", args), measure("chunked", args)
    print(json.dumps({"tokens": args.tokens, "vocab": args.vocab, "dim": args.dim, "autocast": args.autocast,
                      "tp": args.tp,
                      "full": full, "chunked": chunked,
                      "memory_ratio": round(full["peak_extra_GiB"] / max(chunked["peak_extra_GiB"], 1e-9), 1),
                      "full_logits_fp32_GiB": round(args.tokens * args.vocab * 4 / 2**30, 3)}))


if __name__ == "__main__":
    main()
