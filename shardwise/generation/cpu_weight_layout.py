"""On a CPU, the inference engine keeps each linear layer's weight stored transposed.

PyTorch stores a linear's weight as [out, in] and multiplies rows by its transpose. With that
layout MKL's fp32 GEMM was slower on this CPU for a few rows than with the weight's storage
transposed, [in, out] row by row, which makes `weight.t()` contiguous: 1.1-2.9x at 2-8 rows,
2.7-4.5x at 16-32 rows, about equal at 1 row and at 64 or more (x [16, 256] by a [704, 256]
weight: 181 us vs 40 us; the tied head [4096, 256]: 987 vs 284 us; 560 rows: within 5%;
docs/benchmarks.md, "Serving"). A decode step multiplies as many rows as there
are running sequences, and a prefill a prompt's tokens: both are in that range. The values and
shapes stay as they were, so the model, its forward and its compiled step are unchanged; only the
strides differ, and no weight is copied twice.

Commit e487593 did this with a graph rewrite of the compiled decode step ((W @ x^T)^T at 16-63 rows).
The rewrite could not fire once the step had recompiled with a symbolic row count, which a server
reaches as its batch grows, and it left prefill and eager decoding alone; this covers all three,
and measured faster than the rewrite at every row count from 2 to 32.
"""

from __future__ import annotations

import torch
from torch import nn

from shardwise.models.common.decoder import TiedHead


def store_linear_weights_transposed(model: nn.Module) -> int:
    """Give every fp32 2-D weight that multiplies rows from the right (each `nn.Linear`'s, and a
    tied head's embedding) transposed storage, in place, on CPU; how many weights changed.

    For inference only: an optimizer's state or a checkpoint writer that needs contiguous
    tensors (safetensors) would see the new strides. Parameters that are not plain tensors (a
    tensor-parallel shard's DTensor) are left alone."""
    weights = {id(m.weight): m.weight for m in model.modules() if isinstance(m, nn.Linear)}
    weights.update((id(m.embedding.weight), m.embedding.weight) for m in model.modules() if isinstance(m, TiedHead))
    changed = 0
    for weight in weights.values():
        data = weight.data
        if (type(data) is torch.Tensor and data.device.type == "cpu" and data.dtype == torch.float32
                and data.dim() == 2 and data.is_contiguous()):
            weight.data = data.t().contiguous().t()
            changed += 1
    return changed
