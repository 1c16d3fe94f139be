"""Sharded, reshardable, atomic checkpoints on `torch.distributed.checkpoint` (DCP).

Every rank writes its own part of the tensors (DCP's `FileSystemWriter`: one `__<rank>_0.distcp`
file per rank, replicated tensors written once), rank 0 writes DCP's `.metadata` (global shape
and the chunks of every tensor) and `state.json` (the JSON-serialisable rest). Because the
metadata records global shapes and chunk offsets, DCP's load planner reads whatever overlaps the
chunks a loader needs: a checkpoint saved as DTensors sharded over 4 ranks loads into DTensors
over 2, or into plain tensors in one process without any process group. Saving is collective
whenever a process group exists; loading is collective only for DTensors, since plain tensors
are read whole by each process (so one process of a group can load weights on its own).

Atomic: all ranks write into `checkpoints/.step_00000100.partial/`; rank 0 renames it to
`step_00000100/` only after DCP's save returned (its metadata is written after every rank's
data), state.json is in place and the manifest of every file's size and hash is written
(`checkpoint_integrity.py`), then removes all but the newest `keep`. Resuming checks the
manifest and falls back to the previous checkpoint when the newest is corrupt or incomplete. A crash mid-save
leaves the earlier checkpoints and a dot-named directory that `checkpoint_dirs` never returns
and the next save removes. The directory must be on a file system every rank sees. A save that
fails for want of space (ENOSPC or EDQUOT, or less free space than the state's size when it began:
torch's zip writer reports a full disk with no errno) removes its partial directory and raises
`CheckpointDiskFull`, one line naming the checkpoint, the bytes it needs and the checkpoint a rerun
resumes from.

Nothing is unpickled that could run code. DCP's `FileSystemReader.read_metadata` calls plain
`pickle.load` on `.metadata`; here it is read by `MetadataUnpickler`, which resolves only the
globals a DCP metadata file holds (its dataclasses, torch.Size, dtypes, layouts, paths) and
refuses everything else, the stdlib's documented way of restricting pickle and the same idea as
`torch.load(weights_only=True)` (whose unpickler is private). Tensor data is read by
`FileSystemReader.read_data` with `torch.load(weights_only=True)` (torch 2.13,
filesystem.py). DCP's planner unpickles non-tensor ("bytes") entries with
`torch.load(weights_only=False)`, so a requested key that the metadata calls bytes is refused
before DCP runs, and `TensorOnlyLoadPlanner` refuses bytes entries as a second guard.

Why not DCP's Hugging Face safetensors storage, which needs no pickle at all: its reader
rebuilds each tensor's global shape as the largest extent of the chunks found in whatever
`.safetensors` files are in the directory, so a missing shard file goes unnoticed instead of
failing, and with `save_distributed=True` it writes no index. The default format keeps one
coordinator-written record of every chunk, and is what DCP's own tools (`format_utils`) and
torchtitan read.
"""

from __future__ import annotations

import base64
import errno
import json
import os
import shutil
import sys
import warnings
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint import metadata as dcp_metadata
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.tensor import DTensor

from shardwise.core.run_files import (CHECKPOINT_DIR, STATE_FILE, STEP_PREFIX, finished_step_dirs, step_dir_name,
                                      step_dirs)
from shardwise.core.units import MIB
from shardwise.distributed.pipeline_parallel import parts_of
from shardwise.models.common.lora import trained_state
from shardwise.runtime.faults import FaultPlan
from shardwise.checkpoint.integrity import newest_ok, write_manifest
from shardwise.checkpoint.safe_read import (
    PreparedMetadataReader,
    TensorOnlyLoadPlanner,
    read_checkpoint_metadata,
)

PARTIAL_SUFFIX = ".partial"
REPLACED_SUFFIX = ".replaced"
MODEL_PREFIX = "model/"


def write_json_atomic(path: Path, data: dict) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(data, indent=2, sort_keys=True))
    os.replace(tmp, path)


def checkpoint_dirs(run_dir: Path) -> list[Path]:
    """Complete checkpoints, oldest first."""
    return [p for _, p in finished_step_dirs(run_dir)]


def latest_checkpoint(run_dir: Path) -> Path | None:
    """The newest checkpoint directory, unchecked (see `newest_valid_checkpoint`)."""
    found = checkpoint_dirs(run_dir)
    return found[-1] if found else None


def newest_valid_checkpoint(run_dir: Path, *, when_none: str = "starting from step 0") -> Path | None:
    """The newest checkpoint whose files match its manifest (collective when a process group
    exists); each newer one is skipped with a one-line warning naming it and why, a step directory
    missing .metadata or state.json included (`checkpoint_dirs` would pass over it without a word)."""
    def warn(line: str) -> None:
        if is_leader():
            print(line, file=sys.stderr, flush=True)

    return newest_ok([path for _, path in step_dirs(run_dir)], warn=warn, when_none=when_none)


# ------------------------------------------------------------------------------------- processes

def is_distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


@contextmanager
def dcp_errors_as_exceptions(what: str):
    """Quiets DCP's single-process warning and turns its CheckpointException into a RuntimeError.

    DCP warns on every save/load without a process group, a supported case here. Its
    CheckpointException (the same on every rank) derives from BaseException, which callers'
    `except Exception` would miss.
    """
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
        try:
            yield
        except CheckpointException as failure:
            ranks = sorted(failure.failures)
            first, _ = failure.failures[ranks[0]]
            raise RuntimeError(f"{what} failed on rank(s) {ranks}: {type(first).__name__}: {first}") from failure


def is_leader() -> bool:
    return not is_distributed() or dist.get_rank() == 0


# ---------------------------------------------------------------------------------------- saving

def on_leader_then_all(what: str, action) -> None:
    """Run `action` on rank 0 while the other ranks wait; all raise if it failed there.

    A plain barrier would leave the other ranks waiting forever when rank 0 raises.
    """
    error, failure = None, None
    if is_leader():
        try:
            action()
        except Exception as exc:
            error, failure = exc, f"{type(exc).__name__}: {exc}"
    if is_distributed():
        outcome = [failure]
        dist.broadcast_object_list(outcome, src=0)
        failure = outcome[0]
    if error is not None:
        raise error
    if failure is not None:
        raise RuntimeError(f"rank 0 failed to {what}: {failure}")


def remove_unfinished(root: Path) -> None:
    """Directories left by a save that crashed (only one trainer writes a run directory)."""
    for path in root.glob(f".{STEP_PREFIX}*"):
        if path.is_dir() and path.name.endswith((PARTIAL_SUFFIX, REPLACED_SUFFIX)):
            shutil.rmtree(path, ignore_errors=True)


def move_into_place(partial: Path, final: Path) -> None:
    if final.exists():  # a step saved again (e.g. after resuming from an older checkpoint)
        replaced = final.with_name(f".{final.name}{REPLACED_SUFFIX}")
        os.replace(final, replaced)
        os.replace(partial, final)
        shutil.rmtree(replaced, ignore_errors=True)
    else:
        os.replace(partial, final)


def remove_all_but_newest(run_dir: Path, keep: int) -> None:
    for old in checkpoint_dirs(run_dir)[:-keep]:
        shutil.rmtree(old, ignore_errors=True)


def save_checkpoint(run_dir: Path, step: int, *, tensors: dict[str, torch.Tensor], state: dict, keep: int,
                    faults: FaultPlan | None = None) -> Path:
    """Write checkpoint `step` (collectively when a process group exists); keep the newest `keep`.

    Each rank passes its own `tensors`: DTensors, or plain tensors equal on every rank (each is
    written once). `state` must be the same on all ranks; state.json holds it plus `step`.
    `faults`: the run's injected faults (runtime/faults.py), for drills.
    """
    save = PendingSave.begin(run_dir, step, state, keep, faults, needed_bytes=checkpoint_bytes(tensors))
    try:
        with dcp_errors_as_exceptions(f"saving checkpoint {save.final}"):
            dcp.save(tensors, storage_writer=FileSystemWriter(save.partial), no_dist=not is_distributed())
    except BaseException as error:
        save.abandon()
        save.raise_if_disk_full(error)
        raise
    return save.complete()


def save_checkpoint_async(run_dir: Path, step: int, *, tensors: dict[str, torch.Tensor], state: dict, keep: int,
                          process_group: dist.ProcessGroup | None, faults: FaultPlan | None = None) -> PendingSave:
    """Start writing checkpoint `step` in the background (checkpoint.async_save); `finish()` it later.

    Returns once the tensors are copied to host memory (training may change them from then on);
    a thread writes the files. Until `finish()` (collective: every rank at the same point) the
    checkpoint has no manifest, so a crash meanwhile leaves an incomplete directory that resume
    skips. The writer runs its own collectives on `process_group`: with a process group, a gloo group
    of all ranks made for it (the run context's), never the one the training step uses; else None.
    """
    save = PendingSave.begin(run_dir, step, state, keep, faults, needed_bytes=checkpoint_bytes(tensors))
    try:
        with dcp_errors_as_exceptions(f"saving checkpoint {save.final}"):
            save.future = dcp.async_save(tensors, storage_writer=FileSystemWriter(save.partial),
                                         process_group=process_group, no_dist=not is_distributed())
        if faults is not None:
            faults.during_async_save(step)
    except BaseException as error:
        save.abandon()
        save.raise_if_disk_full(error)
        raise
    return save


# DCP warns on every save without a process group (a supported case here); the background writer
# of an asynchronous save warns from its thread, outside dcp_errors_as_exceptions' reach.
warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")


@dataclass
class PendingSave:
    """A checkpoint being written into `partial`; `complete()` makes it `final`."""

    run_dir: Path
    step: int
    state: dict
    keep: int
    partial: Path
    final: Path
    faults: FaultPlan | None = None
    future: object = None
    """The background write of an asynchronous save (None: written already)."""
    needed_bytes: int = 0
    """About what the checkpoint's files take (`checkpoint_bytes`), for the message of a full disk."""
    free_bytes: int | None = None
    """Free space where it is written, when the save began (None: unknown)."""

    @classmethod
    def begin(cls, run_dir: Path, step: int, state: dict, keep: int, faults: FaultPlan | None = None, *,
              needed_bytes: int = 0) -> PendingSave:
        if keep < 1:
            raise ValueError(f"keep = {keep} is invalid: keep at least 1 checkpoint")
        if step < 0:
            raise ValueError(f"step = {step} is invalid: use the number of optimizer steps done (>= 0)")
        root = Path(run_dir) / CHECKPOINT_DIR
        final = root / step_dir_name(step)
        partial = root / f".{final.name}{PARTIAL_SUFFIX}"

        def prepare() -> None:
            root.mkdir(parents=True, exist_ok=True)
            remove_unfinished(root)
            partial.mkdir()

        on_leader_then_all(f"create {partial}", prepare)
        return cls(Path(run_dir), step, state, keep, partial, final, faults, needed_bytes=needed_bytes,
                   free_bytes=free_space(root))

    def finish(self) -> Path:
        """Wait for the background write, then complete the checkpoint (collective)."""
        try:
            with dcp_errors_as_exceptions(f"saving checkpoint {self.final}"):
                self.future.result()
        except BaseException as error:
            self.abandon()
            self.raise_if_disk_full(error)
            raise
        return self.complete()

    def complete(self) -> Path:
        """state.json, then the manifest (last: a checkpoint whose manifest checks out is whole), then the
        rename into place and the pruning of old checkpoints."""
        def finish() -> None:
            move_into_place(self.partial, self.final)
            remove_all_but_newest(self.run_dir, self.keep)

        try:
            # DCP's save returns on rank 0 after every rank's data and the metadata are written.
            on_leader_then_all(f"write {self.partial / STATE_FILE}",
                               lambda: write_json_atomic(self.partial / STATE_FILE, {**self.state, "step": self.step}))
            if self.faults is not None:
                self.faults.during_save(self.step)
            write_manifest(self.partial, self.step)
            on_leader_then_all(f"finish checkpoint {self.final}", finish)
        except BaseException as error:
            self.abandon()
            self.raise_if_disk_full(error)
            raise
        return self.final

    def abandon(self) -> None:
        if is_leader():
            shutil.rmtree(self.partial, ignore_errors=True)

    def raise_if_disk_full(self, error: BaseException) -> None:
        """The one-line `CheckpointDiskFull` in place of `error` when the save failed for want of space:
        the disk said so (ENOSPC, EDQUOT), or had less free space than the checkpoint needs when the save
        began (torch's zip writer reports a full disk as a RuntimeError with no errno)."""
        if not isinstance(error, Exception):  # Ctrl-C, SystemExit: not this
            return
        short = self.free_bytes is not None and self.free_bytes < self.needed_bytes
        if not (short or ran_out_of_space(error)):
            return
        older = latest_checkpoint(self.run_dir)
        free = f"{self.free_bytes:,} bytes were free when it began" if self.free_bytes is not None else "free unknown"
        raise CheckpointDiskFull(
            f"checkpoint {self.final} could not be saved: the disk is full (it needs about {self.needed_bytes:,} "
            f"bytes, {self.needed_bytes / MIB:.1f} MiB; {free}); the partial checkpoint was removed. Free space "
            f"or use a run.dir on a larger disk, then rerun the same command: it resumes from "
            f"{older.name if older else 'step 0 (no checkpoint yet)'}") from error


class CheckpointDiskFull(ValueError):
    """A save that failed for want of space: one line (the CLI's `shardwise: error:`, exit status 2, not
    restarted: a restart would meet the same full disk) naming the checkpoint, the bytes and the fix."""


DISK_FULL_ERRNOS = (errno.ENOSPC, errno.EDQUOT)


def checkpoint_bytes(tensors: dict[str, torch.Tensor]) -> int:
    """What a checkpoint of `tensors` holds: each once at its global size (a DTensor's whole shape)."""
    return sum(tensor.numel() * tensor.element_size() for tensor in tensors.values())


def free_space(directory: Path) -> int | None:
    try:
        return shutil.disk_usage(directory).free
    except OSError:
        return None


def ran_out_of_space(error: BaseException) -> bool:
    """ENOSPC or EDQUOT anywhere in `error`'s chain, DCP's per-rank failures included, or in the text of
    a peer's failure that `on_leader_then_all` passed on."""
    pending, seen = [error], set()
    while pending:
        exc = pending.pop()
        if exc is None or id(exc) in seen:
            continue
        seen.add(id(exc))
        if isinstance(exc, OSError) and exc.errno in DISK_FULL_ERRNOS or os.strerror(errno.ENOSPC) in str(exc):
            return True
        if isinstance(exc, CheckpointException):
            pending.extend(failure for failure, _ in exc.failures.values())
        pending.extend((exc.__cause__, exc.__context__))
    return False


# --------------------------------------------------------------------------------------- loading

def checkpoint_tensor_shapes(checkpoint: Path) -> dict[str, tuple[int, ...]]:
    """Global shape of every tensor in the checkpoint, by key."""
    entries = read_checkpoint_metadata(checkpoint).state_dict_metadata
    return {key: tuple(md.size) for key, md in entries.items()
            if isinstance(md, dcp_metadata.TensorStorageMetadata)}


def check_requested_tensors(checkpoint: Path, metadata: dcp_metadata.Metadata, tensors: dict) -> None:
    entries = metadata.state_dict_metadata
    missing = sorted(key for key in tensors if key not in entries)
    if missing:
        raise ValueError(f"checkpoint {str(checkpoint)!r} lacks {len(missing)} requested tensors "
                         f"(e.g. {missing[:3]}); request only keys it has (see checkpoint_tensor_shapes) "
                         "or use the config it was saved with")
    for key, tensor in tensors.items():
        if not isinstance(entries[key], dcp_metadata.TensorStorageMetadata):
            raise ValueError(f"checkpoint {str(checkpoint)!r} stores {key!r} as a pickled object, not a tensor; "
                             "shardwise checkpoints hold tensors only: load one written by shardwise")
        saved = tuple(entries[key].size)
        if saved != tuple(tensor.shape):
            raise ValueError(f"checkpoint {str(checkpoint)!r} has {key!r} of shape {saved}, requested {tuple(tensor.shape)}; "
                             "build the model with the config the checkpoint was saved with")


def load_checkpoint(checkpoint: Path, *, tensors: dict[str, torch.Tensor]) -> dict:
    """Fill `tensors` in place (plain or DTensors, any layout); returns the JSON state.

    Collective when `tensors` holds DTensors; checkpoint keys not in `tensors` are ignored.
    """
    checkpoint = Path(checkpoint)
    metadata = read_checkpoint_metadata(checkpoint)
    check_requested_tensors(checkpoint, metadata, tensors)
    state_path = checkpoint / STATE_FILE
    if not state_path.is_file():
        raise ValueError(f"checkpoint {str(checkpoint)!r} has no {STATE_FILE}; "
                         "pass a complete checkpoint directory (checkpoints/step_NNNNNNNN)")
    state = json.loads(state_path.read_text())
    # Plain tensors are read whole by each process, so only DTensors need the ranks to plan together;
    # that lets one process (a generation server under torchrun, say) load weights on its own.
    collective = is_distributed() and any(isinstance(t, DTensor) for t in tensors.values())
    with dcp_errors_as_exceptions(f"loading checkpoint {checkpoint}"):
        dcp.load(tensors, storage_reader=PreparedMetadataReader(checkpoint, metadata),
                 planner=TensorOnlyLoadPlanner(), no_dist=not collective)
    return state


def load_model_weights(checkpoint: Path, model: torch.nn.Module, device=None) -> None:
    """Load the checkpoint's `model/...` tensors into `model`'s own tensors, in place (a model with
    LoRA adapters: the adapters, its base being loaded apart, as a LoRA run's checkpoints hold no base).

    They land on the device the model's tensors are on; `device` is only accepted for callers of
    the old helper.
    """
    tensors = {f"{MODEL_PREFIX}{name}": value for name, value in trained_state(model).items()}
    saved = {key for key in checkpoint_tensor_shapes(checkpoint) if key.startswith(MODEL_PREFIX)}
    unexpected = sorted(saved - tensors.keys())
    if unexpected:
        raise ValueError(f"checkpoint {str(checkpoint)!r} has weights the model lacks (e.g. {unexpected[:3]}); "
                         "use the model config it was saved with")
    load_checkpoint(checkpoint, tensors=tensors)


# -- a run's state: what is saved, resumed and gathered ----------------------------------------


def checkpoint_tensors(pm, optimizer) -> dict[str, torch.Tensor]:
    """model/<name> and optim/<name>/<state> tensors of a laid-out model (`ParallelModel`):
    replicated tensors plain, sharded ones DTensors (ZeRO's row shards included), so a
    checkpoint written under one layout loads under any other. Optimizer state is created
    (zeros) first if still empty, so a checkpoint can be loaded into it. A LoRA run's model/
    tensors are its adapters (and buffers), not the frozen base its train.init_from names."""
    init_adam_state(optimizer)
    tensors = {f"model/{name}": t for name, t in trained_state(pm.model).items()}
    for name, param, as_saved in pm.sync.named_optimizer_params():
        for key, value in optimizer.state[param].items():
            tensors[f"optim/{name}/{key}"] = as_saved(value) if value.dim() > 0 else value  # `step`: a scalar
    return tensors


def resume(run_dir: Path, pm, optimizer, loader) -> tuple[int, Path | None]:
    """Restore model, optimizer, data position and RNG from the newest checkpoint: (steps done, path)."""
    found = newest_valid_checkpoint(run_dir)
    if found is None:
        return 0, None
    tensors = checkpoint_tensors(pm, optimizer)
    if not any(key.startswith("optim/") for key in checkpoint_tensor_shapes(found)):
        # An imported checkpoint (`shardwise convert --from-hf`): weights only, a fresh optimizer.
        tensors = {key: value for key, value in tensors.items() if key.startswith("model/")}
    state = load_checkpoint(found, tensors=tensors)
    if state.get("loader"):
        loader.load_state_dict(state["loader"])
    if state.get("rng"):
        restore_rng(state["rng"])
    return state["step"], found


def rng_state() -> dict:
    """The torch RNG state, JSON-friendly. Training itself draws no random numbers (no dropout),
    but anything added later that does (and the closing sample) continues as it would have."""
    state = {"cpu": base64.b64encode(torch.get_rng_state().numpy().tobytes()).decode()}
    if torch.cuda.is_available():
        state["cuda"] = base64.b64encode(torch.cuda.get_rng_state().numpy().tobytes()).decode()
    return state


def restore_rng(state: dict) -> None:
    def as_tensor(text: str) -> torch.Tensor:
        return torch.frombuffer(bytearray(base64.b64decode(text)), dtype=torch.uint8)

    torch.set_rng_state(as_tensor(state["cpu"]))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(as_tensor(state["cuda"]))


def gather_full_state(pm, is_main: bool) -> dict[str, torch.Tensor] | None:
    """The whole model's tensors on rank 0 (None elsewhere), from any layout: DTensors (ZeRO-3,
    tensor parallel) are gathered by DCP, pipeline stages sent to rank 0 by one rank of each."""
    pp = pm.dims.pp
    full = {}
    for part in parts_of(pm.model):
        # Rank 0 alone gets the tensors with cpu_offload, so pipeline stages elsewhere need them all.
        full.update(get_model_state_dict(part, options=StateDictOptions(full_state_dict=True, cpu_offload=pp == 1)))
    if pp > 1:
        world = pm.meshes.world
        sends = pm.dims.dp_rank(pm.meshes) == 0 and world["tp"].get_local_rank() == 0 \
            and world["cp"].get_local_rank() == 0
        mine = {name: t.detach().cpu() for name, t in full.items()} if sends else {}
        gathered = [None] * pm.dims.world_size if is_main else None
        dist.gather_object(mine, gathered, dst=0)
        full = {name: t for part in gathered for name, t in part.items()} if is_main else None
    return full if is_main else None


def init_adam_state(optimizer: torch.optim.Optimizer) -> None:
    """Create AdamW's state (zeros) before the first step, so a checkpoint can be loaded into it."""
    for group in optimizer.param_groups:
        for p in group["params"]:
            if not optimizer.state.get(p):
                optimizer.state[p] = {
                    "step": torch.tensor(0.0, dtype=torch.float32),
                    "exp_avg": torch.zeros_like(p, memory_format=torch.preserve_format),
                    "exp_avg_sq": torch.zeros_like(p, memory_format=torch.preserve_format),
                }
