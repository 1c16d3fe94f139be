"""A checkpoint's manifest: every file with its size and SHA-256, written last; and the check
that a checkpoint on disk is what was written.

    ok          every file the manifest lists is there with its size and hash
    incomplete  no manifest (the save never finished) or a listed file is missing
    corrupt     the manifest is unreadable, or a file's size or hash differs from it

The manifest is written after DCP's save returned on every rank and after state.json, just
before the directory is renamed into place, so a checkpoint whose manifest checks out holds
everything its save wrote. Each rank hashes the files it wrote itself (DCP names them
`__<rank>_<n>.distcp`) and rank 0 gathers the digests, so saving hashes in parallel; checking
splits the files over the ranks the same way. Resuming takes the newest checkpoint that is ok
and names each newer one it skips and why, in one line.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import torch.distributed as dist

MANIFEST_FILE = "manifest.json"
STATUSES = ("ok", "incomplete", "corrupt")


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def file_digest(path: Path) -> dict:
    with open(path, "rb") as handle:
        digest = hashlib.file_digest(handle, "sha256").hexdigest()
    return {"size": path.stat().st_size, "sha256": digest}


def written_by(directory: Path, rank: int, world_size: int) -> list[Path]:
    """The files of `directory` rank `rank` accounts for: its own DCP data files; rank 0 also
    every file no rank's prefix claims (.metadata, state.json)."""
    files = sorted(p for p in directory.iterdir()
                   if p.is_file() and p.name != MANIFEST_FILE and not p.name.endswith(".tmp"))

    def owner(path: Path) -> int:
        parts = path.name.split("_")
        if path.name.startswith("__") and len(parts) > 2 and parts[2].isdigit() and int(parts[2]) < world_size:
            return int(parts[2])
        return 0
    return [p for p in files if owner(p) == rank]


def write_manifest(directory: Path, step: int) -> None:
    """Collective when a process group exists: each rank hashes its own files, rank 0 writes
    manifest.json (atomically) listing all of them."""
    rank, world = (dist.get_rank(), dist.get_world_size()) if _distributed() else (0, 1)
    mine = {p.name: file_digest(p) for p in written_by(directory, rank, world)}
    if world > 1:
        gathered = [None] * world if rank == 0 else None
        dist.gather_object(mine, gathered, dst=0)
        mine = {name: entry for part in (gathered or []) for name, entry in part.items()}
    if rank == 0:
        tmp = directory / f".{MANIFEST_FILE}.tmp"
        tmp.write_text(json.dumps({"step": step, "files": mine}, indent=1, sort_keys=True))
        os.replace(tmp, directory / MANIFEST_FILE)


def read_manifest(directory: Path) -> tuple[dict | None, str]:
    """(the manifest's file table, "") or (None, why it cannot be used)."""
    path = directory / MANIFEST_FILE
    if not path.is_file():
        return None, f"no {MANIFEST_FILE}: its save did not finish"
    try:
        files = json.loads(path.read_text())["files"]
        if not isinstance(files, dict) or not all({"size", "sha256"} <= set(e) for e in files.values()):
            raise ValueError("bad entries")
    except (OSError, ValueError, KeyError, TypeError) as exc:
        return None, f"{MANIFEST_FILE} is unreadable ({type(exc).__name__})"
    return files, ""


def check_files(directory: Path, entries: dict) -> tuple[str, str]:
    """(status, reason) of the listed files; the first problem found."""
    for name, entry in sorted(entries.items()):
        path = directory / name
        if not path.is_file():
            return "incomplete", f"{name} is missing"
        size = path.stat().st_size
        if size != entry["size"]:
            return "corrupt", f"{name} has {size} bytes, its manifest says {entry['size']}"
        if file_digest(path)["sha256"] != entry["sha256"]:
            return "corrupt", f"{name} does not match its SHA-256 in the manifest"
    return "ok", ""


def checkpoint_status(directory: Path, *, share: tuple[int, int] = (0, 1)) -> tuple[str, str]:
    """(status, reason) of one checkpoint directory; with `share` = (i, n) only every n-th
    listed file from the i-th is hashed (the manifest itself is read whole)."""
    entries, why = read_manifest(directory)
    if entries is None:
        return ("incomplete" if why.startswith("no ") else "corrupt"), why
    index, count = share
    names = sorted(entries)[index::count]
    return check_files(directory, {name: entries[name] for name in names})


def status_everywhere(directory: Path) -> tuple[str, str]:
    """`checkpoint_status` with the hashing split over the ranks (collective when a process
    group exists): the worst status any rank found, the same on every rank."""
    if not _distributed():
        return checkpoint_status(directory)
    found = checkpoint_status(directory, share=(dist.get_rank(), dist.get_world_size()))
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, found)
    return max(every, key=lambda item: STATUSES.index(item[0]))


def newest_ok(directories: list[Path], *, warn, when_none: str = "starting from step 0") -> Path | None:
    """The newest directory (the list is oldest first) whose status is ok; `warn(line)` for each
    newer one skipped, the oldest's line ending with what the caller does then (`when_none`)."""
    for directory in reversed(directories):
        status, why = status_everywhere(directory)
        if status == "ok":
            return directory
        then = "trying an older checkpoint" if directory != directories[0] else f"none older: {when_none}"
        warn(f"shardwise: warning: skipping checkpoint {directory}: {status} ({why}); {then}")
    return None


def checkpoints_table(run_dir: Path, found: list[tuple[int, Path]]) -> str:
    """`shardwise checkpoints RUN`: each (step, directory) of `found` (oldest first) with its
    status, and which one a resume would load."""
    if not found:
        return f"{run_dir}: no checkpoints"
    rows = [(step, path, *checkpoint_status(path)) for step, path in found]
    resume_from = next((p for _, p, status, _ in reversed(rows) if status == "ok"), None)
    lines = [f"{'step':>8}  {'status':<10}  checkpoint"]
    for step, path, status, why in rows:
        note = f"  ({why})" if why else ("  <- resume loads this" if path == resume_from else "")
        lines.append(f"{step:>8}  {status:<10}  {path}{note}")
    return "\n".join(lines)
