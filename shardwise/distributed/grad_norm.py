"""The global gradient norm and clipping, one function for every gradient-sync strategy.

A strategy knows where its gradients live; this module only adds them up:

    ‖g‖² = Σ_groups Σ_ranks ‖g_rank‖²

`total_norm` is this rank's part: the norm of its gradients as `torch.nn.utils.get_total_norm`
computes it (so one process clips exactly as `clip_grad_norm_` would), per DTensor mesh (each
mesh's norm reduced over that mesh by DTensor: tensor parallel, FSDP, expert parallel), the
meshes' norms then combined. The caller names the process groups over which the per-rank
parts still have to be added (ZeRO's row shards: the data-parallel group; pipeline stages,
which hold disjoint parameters: the pp group). Clipping then scales every gradient by
min(1, max_norm / (‖g‖ + 1e-6)), as `torch.nn.utils.clip_grads_with_norm_` does.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor


def total_norm(grads) -> torch.Tensor:
    """‖g‖ over `grads` on this rank, each DTensor's part reduced over its own mesh."""
    grads = list(grads)
    if not grads:
        return torch.zeros(())
    by_mesh: dict[int, list[torch.Tensor]] = {}
    for grad in grads:
        by_mesh.setdefault(id(getattr(grad, "device_mesh", None)), []).append(grad)
    norms = []
    for group in by_mesh.values():
        norm = torch.nn.utils.get_total_norm(group)
        norms.append(norm.full_tensor() if isinstance(norm, DTensor) else norm)
    if len(norms) == 1:
        return norms[0]
    return torch.linalg.vector_norm(torch.stack([n.to(norms[0].device) for n in norms]))


def clip_grad_norm_(grads, max_norm: float, *, counted=None, extra_squared=None, sum_over=()) -> float:
    """Scale `grads` in place by min(1, max_norm / (‖g‖ + 1e-6)) and return ‖g‖, where ‖g‖² is
    the squared norm of `counted` (default: `grads`; leave out copies counted elsewhere) plus
    `extra_squared`, summed over each group in `sum_over` (None entries are skipped)."""
    grads = list(grads)
    norm = total_norm(grads if counted is None else counted)
    groups = [group for group in sum_over if group is not None]
    if groups or extra_squared is not None:
        squared = norm.float() ** 2 + (0.0 if extra_squared is None else extra_squared)
        for group in groups:
            dist.all_reduce(squared, group=group)
        norm = squared.sqrt()
    coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
    plain = [g for g in grads if not isinstance(g, DTensor)]
    if plain:
        torch._foreach_mul_(plain, coef.to(plain[0].device))
    for grad in grads:
        if isinstance(grad, DTensor):
            grad.mul_(float(coef))
    return float(norm)
