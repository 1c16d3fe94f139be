"""Per-rank bytes held by parameters, gradients and optimizer states, measured and by formula.

``state_memory`` measures what this rank holds; ``zero_formula_bytes`` gives what the ZeRO
paper predicts; ``format_memory_report`` prints the two side by side (``--report memory``).

Counting rules:
- A DTensor counts its local shard only: the memory on this rank. FSDP2 pads a shard so
  every rank's is equally long, and the padding is not in the shard's numel, so measured
  bytes match the formula "up to padding" (at most one row per parameter per rank).
- ``unique_bytes`` de-duplicates by storage: each tensor covers the byte range of its
  storage from its first element to its last; overlapping ranges of one storage are merged.
  So views of one flat buffer (a ZeRO gradient buffer, tied weights) count once, and
  disjoint slices of it count each. A non-contiguous view covers the gaps between its
  elements too: it keeps them alive.
- Optimizer memory is every tensor in ``optimizer.state``, including Adam(W)'s per-parameter
  ``step`` scalar (a 4-byte fp32 tensor on this rank, not sharded by FSDP2). The ZeRO
  formula's 8 bytes per parameter (two moments) leaves those scalars out, so measured
  optimizer bytes = formula + 4 * (number of parameter tensors), up to padding.
"""

from collections.abc import Iterable, Iterator

import torch
from torch import nn
from torch.distributed.tensor import DTensor

STATES = ("params", "grads", "optimizer")


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """The part of ``t`` held on this rank: a DTensor's local shard, else ``t`` itself."""
    if isinstance(t, DTensor):
        with torch.no_grad():
            return t.to_local()
    return t


def tensor_bytes(t: torch.Tensor) -> int:
    """Bytes of this rank's part of ``t``: numel * element_size of its local shard."""
    local = local_tensor(t)
    return local.numel() * local.element_size()


def _storage_key(t: torch.Tensor) -> tuple:
    storage = t.untyped_storage()
    try:
        address = storage.data_ptr()
    except RuntimeError:  # a wrapper subclass (e.g. an in-flight collective's result) has no storage of its own
        return (t.device, "wrapper", id(t))
    if address == 0:  # meta or empty storages share address 0; tell them apart
        return (t.device, "storage", storage._cdata)
    return (t.device, address)


def _byte_range(t: torch.Tensor) -> tuple[int, int]:
    """Bytes [start, end) of its storage that ``t`` covers, first element to last."""
    last_element = sum((size - 1) * stride for size, stride in zip(t.shape, t.stride()))
    start = t.storage_offset() * t.element_size()
    return start, start + (last_element + 1) * t.element_size()


def _merged_length(ranges: list[tuple[int, int]]) -> int:
    total, covered_to = 0, None
    for start, end in sorted(ranges):
        if covered_to is None or start >= covered_to:
            total += end - start
            covered_to = end
        elif end > covered_to:
            total += end - covered_to
            covered_to = end
    return total


def unique_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes of the local parts of ``tensors``, counting memory shared by views once."""
    ranges_by_storage: dict[tuple, list[tuple[int, int]]] = {}
    for t in tensors:
        local = local_tensor(t)
        if local.numel() == 0:
            continue
        ranges_by_storage.setdefault(_storage_key(local), []).append(_byte_range(local))
    return sum(_merged_length(ranges) for ranges in ranges_by_storage.values())


def _tensors_in(state: object) -> Iterator[torch.Tensor]:
    """Every tensor in an optimizer's state, however its values are nested."""
    if isinstance(state, torch.Tensor):
        yield state
    elif isinstance(state, dict):
        for value in state.values():
            yield from _tensors_in(value)
    elif isinstance(state, (list, tuple)):
        for value in state:
            yield from _tensors_in(value)


def state_memory(
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None,
    *,
    extra_grads: Iterable[torch.Tensor] = (),
) -> dict[str, int]:
    """This rank's bytes of parameters, gradients and optimizer states, each de-duplicated.

    ``extra_grads`` are gradient shards a ZeRO implementation keeps outside ``p.grad``.
    """
    params = list(model.parameters())
    grads = [p.grad for p in params if p.grad is not None]
    optimizer_state = optimizer.state if optimizer is not None else {}
    return {
        "params": unique_bytes(params),
        "grads": unique_bytes([*grads, *extra_grads]),
        "optimizer": unique_bytes(_tensors_in(dict(optimizer_state))),
    }


def zero_formula_bytes(
    num_params: int,
    zero: int,
    dp: int,
    *,
    param_bytes: int = 4,
    grad_bytes: int = 4,
    optim_bytes: int = 8,
) -> dict[str, float]:
    """Per-rank bytes by the ZeRO paper (Rajbhandari et al. 2020, fig. 1), for ``dp`` ranks.

    Stage 1 shards optimizer states, stage 2 also gradients, stage 3 also parameters.
    Defaults are Adam in fp32 (two fp32 moments); for mixed precision with fp32 master
    weights pass ``param_bytes=2, grad_bytes=2, optim_bytes=12``.
    """
    if zero not in (0, 1, 2, 3):
        raise ValueError(f"zero={zero!r}: expected a ZeRO stage 0, 1, 2 or 3")
    if dp < 1:
        raise ValueError(f"dp={dp!r}: the data-parallel degree must be at least 1")
    if num_params < 0:
        raise ValueError(f"num_params={num_params!r}: must be zero or more")
    return {
        "params": num_params * param_bytes / (dp if zero >= 3 else 1),
        "grads": num_params * grad_bytes / (dp if zero >= 2 else 1),
        "optimizer": num_params * optim_bytes / (dp if zero >= 1 else 1),
    }


def format_bytes(num_bytes: float) -> str:
    """``num_bytes`` in the largest binary unit that keeps it at least 1 (B .. GiB)."""
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(num_bytes) >= size:
            return f"{num_bytes / size:.2f} {unit}"
    return f"{num_bytes:.0f} B"


def format_memory_report(measured: dict, formula: dict | None = None) -> str:
    """A small table of measured (and, if given, formula) bytes per state, with a total."""
    header = f"{'state':<10} {'measured':>12}"
    if formula is not None:
        header += f" {'formula':>12} {'ratio':>7}"
    lines = [header, "-" * len(header)]
    for state in [*STATES, "total"]:
        value = sum(measured[s] for s in STATES) if state == "total" else measured[state]
        line = f"{state:<10} {format_bytes(value):>12}"
        if formula is not None:
            expected = sum(formula[s] for s in STATES) if state == "total" else formula[state]
            ratio = f"{value / expected:.3f}" if expected else "-"
            line += f" {format_bytes(expected):>12} {ratio:>7}"
        lines.append(line)
    return "\n".join(lines)
