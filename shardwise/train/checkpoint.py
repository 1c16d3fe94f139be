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
data) and state.json is in place, then removes all but the newest `keep`. A crash mid-save
leaves the earlier checkpoints and a dot-named directory that `checkpoint_dirs` never returns
and the next save removes. The directory must be on a file system every rank sees.

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

import json
import os
import pickle
import shutil
import warnings
from contextlib import contextmanager
from pathlib import Path, PurePosixPath, PureWindowsPath

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint import filesystem as dcp_filesystem
from torch.distributed.checkpoint import metadata as dcp_metadata
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.tensor import DTensor

CHECKPOINT_DIR = "checkpoints"
STEP_PREFIX = "step_"
PARTIAL_SUFFIX = ".partial"
REPLACED_SUFFIX = ".replaced"
STATE_FILE = "state.json"
METADATA_FILE = ".metadata"  # DCP's name (filesystem._metadata_fn)
MODEL_PREFIX = "model/"


def write_json_atomic(path: Path, data: dict) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(data, indent=2, sort_keys=True))
    os.replace(tmp, path)


def checkpoint_dirs(run_dir: Path) -> list[Path]:
    """Complete checkpoints, oldest first (directories being written start with a dot)."""
    root = Path(run_dir) / CHECKPOINT_DIR
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir()
             if p.name.startswith(STEP_PREFIX) and p.name[len(STEP_PREFIX):].isdigit()
             and (p / STATE_FILE).is_file() and (p / METADATA_FILE).is_file()]
    return sorted(found, key=lambda p: int(p.name[len(STEP_PREFIX):]))


def latest_checkpoint(run_dir: Path) -> Path | None:
    found = checkpoint_dirs(run_dir)
    return found[-1] if found else None


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


def save_checkpoint(run_dir: Path, step: int, *, tensors: dict[str, torch.Tensor], state: dict, keep: int) -> Path:
    """Write checkpoint `step` (collectively when a process group exists); keep the newest `keep`.

    Each rank passes its own `tensors`: DTensors, or plain tensors equal on every rank (each is
    written once). `state` must be the same on all ranks; state.json holds it plus `step`.
    """
    if keep < 1:
        raise ValueError(f"keep = {keep} is invalid: keep at least 1 checkpoint")
    if step < 0:
        raise ValueError(f"step = {step} is invalid: use the number of optimizer steps done (>= 0)")
    root = Path(run_dir) / CHECKPOINT_DIR
    final = root / f"{STEP_PREFIX}{step:08d}"
    partial = root / f".{final.name}{PARTIAL_SUFFIX}"

    def prepare() -> None:
        root.mkdir(parents=True, exist_ok=True)
        remove_unfinished(root)
        partial.mkdir()

    def finish() -> None:
        write_json_atomic(partial / STATE_FILE, {**state, "step": step})
        move_into_place(partial, final)
        remove_all_but_newest(run_dir, keep)

    on_leader_then_all(f"create {partial}", prepare)
    try:
        with dcp_errors_as_exceptions(f"saving checkpoint {final}"):
            dcp.save(tensors, storage_writer=FileSystemWriter(partial), no_dist=not is_distributed())
        # DCP's save returns on rank 0 after every rank's data and the metadata are written.
        on_leader_then_all(f"finish checkpoint {final}", finish)
    except BaseException:
        if is_leader():
            shutil.rmtree(partial, ignore_errors=True)
        raise
    return final


# --------------------------------------------------------------------------------------- loading

class MetadataUnpickler(pickle.Unpickler):
    """Unpickles DCP's `.metadata` and nothing else: any other global is refused, never imported."""

    ALLOWED = {
        ("torch.distributed.checkpoint.metadata", name): getattr(dcp_metadata, name)
        for name in ("Metadata", "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata",
                     "TensorProperties", "StorageMeta", "MetadataIndex", "_MEM_FORMAT_ENCODING")
    } | {
        ("torch.distributed.checkpoint.filesystem", "_StorageInfo"): dcp_filesystem._StorageInfo,
        ("torch", "Size"): torch.Size,
        ("torch.serialization", "_get_layout"): torch.serialization._get_layout,
        # StorageMeta.checkpoint_id is the path it was saved to; pure paths never touch the disk.
        ("pathlib", "PosixPath"): PurePosixPath,
        ("pathlib", "WindowsPath"): PureWindowsPath,
        ("pathlib", "PurePosixPath"): PurePosixPath,
        ("pathlib", "PureWindowsPath"): PureWindowsPath,
    } | {("torch", name): value for name, value in vars(torch).items() if isinstance(value, torch.dtype)}

    def find_class(self, module: str, name: str):
        try:
            return self.ALLOWED[(module, name)]
        except KeyError:
            raise pickle.UnpicklingError(f"refers to {module}.{name}, which DCP metadata never does") from None


def check_storage_files(checkpoint: Path, metadata: dcp_metadata.Metadata) -> None:
    """Data files must be plain names inside the checkpoint, not paths to elsewhere."""
    for info in (metadata.storage_data or {}).values():
        name = getattr(info, "relative_path", None)
        if not isinstance(name, str) or Path(name).name != name or name in ("", ".", ".."):
            raise ValueError(f"checkpoint {str(checkpoint)!r} names data file {name!r} outside itself; "
                             "it is corrupt or malicious: load a checkpoint written by shardwise")


def read_checkpoint_metadata(checkpoint: Path) -> dcp_metadata.Metadata:
    path = Path(checkpoint) / METADATA_FILE
    if not path.is_file():
        raise ValueError(f"checkpoint {str(checkpoint)!r} has no {METADATA_FILE}; "
                         "pass a complete checkpoint directory (checkpoints/step_NNNNNNNN)")
    try:
        with open(path, "rb") as file:
            metadata = MetadataUnpickler(file).load()
    except Exception as exc:  # whatever a corrupt or hostile file makes the unpickler raise
        raise ValueError(f"checkpoint metadata {str(path)!r} was refused ({exc}); "
                         "load only checkpoints written by shardwise / torch.distributed.checkpoint") from None
    if not isinstance(metadata, dcp_metadata.Metadata):
        raise ValueError(f"checkpoint metadata {str(path)!r} holds a {type(metadata).__name__}, not DCP Metadata; "
                         "load only checkpoints written by shardwise / torch.distributed.checkpoint")
    check_storage_files(Path(checkpoint), metadata)
    return metadata


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


class PreparedMetadataReader(FileSystemReader):
    """Hands DCP the metadata already read safely and checked, instead of unpickling it again."""

    def __init__(self, checkpoint: Path, metadata: dcp_metadata.Metadata) -> None:
        super().__init__(checkpoint)
        self.metadata = metadata

    def read_metadata(self) -> dcp_metadata.Metadata:
        self.metadata.storage_meta = self.metadata.storage_meta or dcp_metadata.StorageMeta()
        self.metadata.storage_meta.load_id = self.load_id
        return self.metadata


class TensorOnlyLoadPlanner(DefaultLoadPlanner):
    def load_bytes(self, read_item, value) -> None:
        # DefaultLoadPlanner would call torch.load(weights_only=False) here.
        raise ValueError(f"checkpoint entry {read_item.dest_index.fqn!r} is a pickled object; "
                         "shardwise checkpoints hold tensors only: load one written by shardwise")


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
    """Load the checkpoint's `model/...` tensors into `model`'s own tensors, in place.

    They land on the device the model's tensors are on; `device` is only accepted for callers of
    the old helper.
    """
    tensors = {f"{MODEL_PREFIX}{name}": value for name, value in model.state_dict().items()}
    saved = {key for key in checkpoint_tensor_shapes(checkpoint) if key.startswith(MODEL_PREFIX)}
    unexpected = sorted(saved - tensors.keys())
    if unexpected:
        raise ValueError(f"checkpoint {str(checkpoint)!r} has weights the model lacks (e.g. {unexpected[:3]}); "
                         "use the model config it was saved with")
    load_checkpoint(checkpoint, tensors=tensors)
