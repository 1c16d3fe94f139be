"""Reading DCP checkpoint metadata without running code: the restricted unpickler, the
storage-file check, and a reader and a load planner that take only tensors (see the
"Nothing is unpickled" paragraph of checkpoint.py for why)."""

from __future__ import annotations

import pickle
from pathlib import Path, PurePosixPath, PureWindowsPath

import torch
from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemReader
from torch.distributed.checkpoint import filesystem as dcp_filesystem
from torch.distributed.checkpoint import metadata as dcp_metadata

from shardwise.core.run_files import METADATA_FILE

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
