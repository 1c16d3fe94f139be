"""Activation memory: the bytes autograd saves for backward while a forward pass runs.

    output, num_bytes = saved_activation_bytes(model, tokens)

This counts what the graph holds, not what an allocator reports, so it works the same on
CPU and accelerators and is exact for comparing layouts (sequence parallel, activation
recomputation) against a formula.

Counting rules:
- A tensor is counted when autograd packs it (``torch.autograd.graph.saved_tensors_hooks``)
  and the graph still holds it when ``fn`` returns; a graph that ``fn`` built and dropped
  (a discarded side computation) counts nothing.
- Storage shared by several saved tensors counts once (``memory.unique_bytes``): a ReLU's
  output that the next Linear saves as its input, or two views of one tensor. A DTensor
  counts its local shard, the memory on this rank.
- Parameters are not activations and are left out: a saved leaf that requires grad, or a
  view of one (``F.linear`` saves ``weight.t()``). A leaf input made with
  ``requires_grad=True`` falls under the same rule; in a model, inputs that need grad are
  activations of an earlier layer, not leaves.
- Only the innermost pair of saved-tensor hooks runs, so inside a region that sets its own
  (``torch.utils.checkpoint`` without reentrancy, CPU offloading) what that region keeps is
  not seen: for a checkpointed module, only its inputs are counted, which is what it holds.
"""

import weakref
from collections.abc import Callable

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode

from shardwise.observe.memory import local_tensor, unique_bytes


def _is_parameter_memory(t: torch.Tensor) -> bool:
    """A leaf that requires grad (a parameter), or a view of one."""
    base = t._base if t._base is not None else t
    return base.is_leaf and base.requires_grad


class LiveSavedTensors:
    """Within the context, what autograd saves for backward (by the counting rules above);
    `sample()` gives the bytes still held at that moment and keeps the largest in `peak`.
    Saved tensors are only added in forward (and the loss) and freed in backward, so sampling
    before each backward finds the peak of a pipeline schedule."""

    def __init__(self, *, parameters_of=None):
        self.refs: list[weakref.ref] = []
        self.peak = 0
        self.model = parameters_of
        """A model whose parameters' storages are not activations: their local tensors may reach
        autograd as plain tensors (a DTensor's `to_local()`), not as leaves. Looked up at each
        save, because FSDP swaps in all-gathered (unsharded) parameters during forward."""

    def __enter__(self) -> "LiveSavedTensors":
        self.hooks = torch.autograd.graph.saved_tensors_hooks(self.pack, _unpack)
        self.hooks.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self.hooks.__exit__(*exc)

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        # The graph keeps what pack returns; returning ``t`` itself would make a reference
        # cycle for saved outputs (see saved_tensors_hooks). A weak reference lets a graph
        # dropped (or run backward) free its tensors, and then they are not counted.
        packed = t.detach()
        if not _is_parameter_memory(t) and not self.is_excluded(t):
            self.refs.append(weakref.ref(packed))
        return packed

    def is_excluded(self, t: torch.Tensor) -> bool:
        if self.model is None:
            return False
        try:
            pointer = local_tensor(t).untyped_storage().data_ptr()
        except RuntimeError:  # a wrapper with no storage of its own (an async collective's result)
            return False
        return pointer in parameter_storages(self.model)

    def sample(self) -> int:
        alive = [t for ref in self.refs if (t := ref()) is not None]
        self.refs = [weakref.ref(t) for t in alive]
        now = unique_bytes(alive)
        self.peak = max(self.peak, now)
        return now


def saved_activation_bytes(fn: Callable, *args, **kwargs) -> tuple[object, int]:
    """Runs ``fn(*args, **kwargs)`` and returns (its output, the bytes autograd saved for
    backward during it that the graph still holds at return), each storage counted once,
    parameters (leaf tensors that require grad, and views of them) excluded, DTensors by
    their local shard. Backward through the output works as without this function."""
    with LiveSavedTensors() as live:
        output = fn(*args, **kwargs)
    return output, live.sample()


class LiveOutputBytes(TorchDispatchMode):
    """Within the context, the plain tensors that ops create; `sample()` gives the bytes of
    those still alive (each storage once). Sampled after a forward pass it is what the pass
    leaves behind for backward whoever holds it — autograd's saved tensors, or the cache of a
    recomputation region, which saved-tensor hooks cannot see — as an allocator would count it
    (torch keeps no allocation statistics on CPU). A DTensor output counts by its local tensor;
    the ops a DTensor op runs on local tensors run below this mode, so what they make and free
    within it is not seen."""

    def __init__(self):
        super().__init__()
        self.storages: dict[int, tuple[StorageWeakRef, int]] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.record(out)
        return out

    def record(self, out, skip: frozenset = frozenset()) -> None:
        """Track the storages of `out`'s plain tensors, but those whose data pointer is in `skip`."""
        for t in map(local_tensor, torch.utils._pytree.tree_leaves(out)):
            if type(t) is torch.Tensor and t.device.type != "meta":
                storage = t.untyped_storage()
                if storage.data_ptr() not in skip:
                    self.storages[storage.data_ptr()] = (StorageWeakRef(storage), storage.nbytes())

    def sample(self) -> int:
        self.storages = {ptr: (ref, n) for ptr, (ref, n) in self.storages.items() if not ref.expired()}
        return sum(n for _, n in self.storages.values())


class PeakLiveBytes(LiveOutputBytes):
    """The most bytes that tensors made within the context held at once (an allocator's
    high-water mark, which torch does not keep on CPU), sampled after every op: `peak`. Memory
    that existed before the context is not counted, even when an op inside returns it (a view of
    an input, an in-place op, `out=` into an older buffer)."""

    def __init__(self):
        super().__init__()
        self.peak = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        inputs = frozenset(local_tensor(t).untyped_storage().data_ptr()
                           for t in torch.utils._pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor))
        self.record(out, skip=inputs)
        self.peak = max(self.peak, self.sample())
        return out


def _unpack(packed: torch.Tensor) -> torch.Tensor:
    return packed


def parameter_storages(model) -> frozenset[int]:
    """The storages of a model's parameters (their local shards) on this rank."""
    return frozenset(local_tensor(p).untyped_storage().data_ptr() for p in model.parameters())


def random_micro_batch(cfg, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Random (inputs, targets) of one micro-batch: tokens, or a classifier's images and labels."""
    from shardwise.models.families import spec_of

    batch, model = cfg.train.micro_batch_size, cfg.model
    if spec_of(model.family).image_input:
        images = torch.randn(batch, model.n_channels, model.image_size, model.image_size, generator=gen)
        return images, torch.randint(0, model.n_classes, (batch,), generator=gen)
    shape = (batch, cfg.train.seq_len)
    return tuple(torch.randint(0, model.vocab_size, shape, generator=gen) for _ in range(2))


def layout_activation_bytes(cfg, *, seed: int = 0) -> int:
    """This rank's activation bytes for one forward + loss of a random micro-batch under the
    config's layout (call on every rank of the process group, or in a single process)."""
    import torch.distributed as dist

    from shardwise.distributed.dims import ParallelDims
    from shardwise.distributed.parallelize import parallelize_config
    from shardwise.models.common.loss import loss_of

    world = dist.get_world_size() if dist.is_initialized() else 1
    dims = ParallelDims.from_config(cfg.parallel, world)
    device = torch.device("cpu")
    dp = parallelize_config(cfg, dims, device=device)
    gen = torch.Generator().manual_seed(seed)
    inputs, targets = random_micro_batch(cfg, gen)
    if dp.context is not None:  # this rank's share of the sequence
        inputs, targets = dp.context.split(inputs), dp.context.split(targets)

    with LiveSavedTensors(parameters_of=dp.model) as live, dp.loss_context():
        loss = loss_of(dp.module, inputs, targets, autocast_dtype=cfg.train.autocast_dtype, device=device,
                       targets_kwarg=dp.targets_kwarg(cfg))
    held = live.sample()
    del loss
    return held


def pipeline_peak_activation_bytes(cfg, *, seed: int = 0) -> dict:
    """This rank's peak of saved activations during one pipeline step (call on every rank),
    with the step's computations: {"peak_bytes": int, "events": [(kind, stage, mb, start, end)]}."""
    import torch.distributed as dist

    from shardwise.distributed.dims import ParallelDims
    from shardwise.distributed.parallelize import parallelize_config

    dims = ParallelDims.from_config(cfg.parallel, dist.get_world_size())
    device = torch.device("cpu")
    dp = parallelize_config(cfg, dims, device=device)
    gen = torch.Generator().manual_seed(seed)
    shape = (cfg.train.micro_batch_size, cfg.train.seq_len)
    micro_batches = [tuple(torch.randint(0, cfg.model.vocab_size, shape, generator=gen) for _ in range(2))
                     for _ in range(dims.num_micro_batches(cfg))]
    with LiveSavedTensors(parameters_of=dp.model) as live:
        for stage in dp.pipeline.stages:
            stage.memory_probe = live.sample
        dp.pipeline.step(micro_batches, device)
    return {"peak_bytes": live.peak, "events": dp.pipeline.events()}
