"""Peak extra memory of the loss (output projection + cross-entropy, forward and backward):
today's logits-then-`token_loss` path against the chunked linear-cross-entropy, each in a
fresh process, measured as the resident-set high-water mark (VmHWM) above the resident set
once the inputs exist.

    python benchmarks/loss_memory.py [--tokens 8192] [--vocab 131072] [--dim 256] [--autocast bfloat16]

Prints one JSON object; docs/benchmarks.md records the figures. Linux only (/proc/self/status).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

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


def measure(mode: str, args) -> dict:
    out = subprocess.run([sys.executable, "-c", CHILD, mode, str(args.tokens), str(args.vocab), str(args.dim),
                          args.autocast], check=True, capture_output=True, text=True).stdout.split()
    return {"peak_extra_GiB": round(int(out[0]) / 2**30, 3), "seconds": round(float(out[1]), 2),
            "loss": float(out[2])}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--vocab", type=int, default=131072)
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--autocast", default="float32", choices=["float32", "bfloat16"])
    args = parser.parse_args()
    full, chunked = measure("full", args), measure("chunked", args)
    print(json.dumps({"tokens": args.tokens, "vocab": args.vocab, "dim": args.dim, "autocast": args.autocast,
                      "full": full, "chunked": chunked,
                      "memory_ratio": round(full["peak_extra_GiB"] / max(chunked["peak_extra_GiB"], 1e-9), 1),
                      "full_logits_fp32_GiB": round(args.tokens * args.vocab * 4 / 2**30, 3)}))


if __name__ == "__main__":
    main()
