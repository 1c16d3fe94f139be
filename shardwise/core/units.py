"""Constants that the config, the runtime and the planner each need, written once.

Byte units, the byte size of each dtype the planner and the runtime name, the default
gradient bucket (`parallel.bucket_mb`'s default is the size the runtime's DDP and ZeRO-1/2
buckets use and the size the planner's memory and time models assume) and the chunked loss's
chunk (the runtime's, and the planner's count of its memory).
"""

from __future__ import annotations

KIB = 2**10
MIB = 2**20
GIB = 2**30

DTYPE_BYTES = {"fp32": 4, "bf16": 2}
"""Bytes of one element, by the planner's dtype names (`float32` / `bfloat16` in the config)."""

DEFAULT_BUCKET_MB = 25
"""Gradient bucket in MiB: DDP's default bucket_cap_mb, and shardwise's ZeRO-1/2 buckets alike."""
GRADIENT_BUCKET_BYTES = DEFAULT_BUCKET_MB * MIB

LOSS_CHUNK_ELEMENTS = {"cpu": 1 << 23, "cuda": 1 << 28}
"""Logits per chunk of the chunked linear-cross-entropy (models/common/chunked_loss.py), by device
type. CPU: 8M (32 MiB in fp32; at vocab 128k, 64 tokens a chunk), near the caches. GPU: 256M
(1 GiB in fp32; 2,048 tokens at 128k): every chunk adds its [vocab, width] weight gradient into
the fp32 sum, about 4 bytes x 3 of memory traffic per weight, so at 64 tokens a chunk that
traffic, not the matmuls, would set the loss's time on a GPU."""


def loss_chunk_tokens(vocab: int, device_type: str) -> int:
    """Tokens a chunk of the chunked loss takes at this vocabulary (an unknown device type: the
    accelerator's chunk)."""
    return max(1, LOSS_CHUNK_ELEMENTS.get(device_type, LOSS_CHUNK_ELEMENTS["cuda"]) // vocab)
