"""Constants that the config, the runtime and the planner each need, written once.

Byte units, the byte size of each dtype the planner and the runtime name, and the default
gradient bucket: `parallel.bucket_mb`'s default is the size the runtime's DDP and ZeRO-1/2
buckets use and the size the planner's memory and time models assume.
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
