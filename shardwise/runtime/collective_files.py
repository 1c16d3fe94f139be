"""Each rank's last collectives as files: where a rank's flight recorder (observe/flight_recorder.py)
leaves them (beside its heartbeat each beat, or in the run directory when a collective fails), and
the launcher's copy of every rank's into `RUN/collectives/` with a `summary.txt` that says which
rank is behind and which collective the others wait in, after a stall or a failure."""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
import time
from pathlib import Path

COLLECTIVES_DIR = "collectives"
"""`RUN/collectives/`: each rank's last collectives (`rank<R>.json`) and `summary.txt`, after a stall or a failure."""


def collectives_beat_file(directory: Path, rank: int) -> Path:
    """Where rank `rank`'s heartbeat thread leaves its last collectives, in the heartbeat directory."""
    return Path(directory) / f"collectives_rank{rank}.json"


def collectives_run_file(run_dir: Path, rank: int, node: str | None = None) -> Path:
    """`RUN/collectives/rank<R>.json`: rank `rank`'s last collectives, kept after the job (a job on several
    nodes: `RUN/collectives/<node>/rank<R>.json`)."""
    return Path(run_dir) / COLLECTIVES_DIR / (node or "") / f"rank{rank}.json"


def write_text_atomic(path: Path, text: str) -> None:
    """Write through a temporary file and a rename, so a reader never sees half a file (and two writers
    of one path, a rank and the launcher, never share a temporary file)."""
    handle, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(handle, "w") as file:
            file.write(text)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def save_collectives(beat_dir: Path, run_dir: Path, ranks: int | list[int], reason: str, *, since: float,
                     stopped: dict[int, str] | None = None, into: Path | None = None) -> Path | None:
    """Each rank's newest last collectives into `RUN/collectives/rank<R>.json`, and `summary.txt` beside
    them; the summary's path, or None when no rank left any (no flight recorder ran). `ranks`: the count of
    ranks (0 .. N-1), or which ranks (a node's, in a job on several); `into`: another directory for the copies
    and the summary (a node's own, `RUN/collectives/<node>/`).

    A rank's newest is its heartbeat's copy, or the file it wrote itself when one of its collectives
    raised, whichever was written later; files older than `since` (an earlier launch) are not used.
    `stopped` names the ranks that stopped without a word (frozen, killed) and how: the summary says their
    records end at their last heartbeat.
    """
    ranks = list(range(ranks)) if isinstance(ranks, int) else sorted(ranks)
    into = Path(into) if into is not None else Path(run_dir) / COLLECTIVES_DIR
    newest: dict[int, dict] = {}
    for rank in ranks:
        from_beat = read_json(collectives_beat_file(beat_dir, rank))
        own = read_json(into / f"rank{rank}.json")
        found = [body for body in (own, from_beat) if body and body.get("time", 0) >= since]
        if not found:
            continue
        newest[rank] = max(found, key=lambda body: body["time"])
        if newest[rank] is from_beat:
            newest[rank] = {**from_beat, "reason": reason}
            into.mkdir(parents=True, exist_ok=True)
            write_text_atomic(into / f"rank{rank}.json", json.dumps(newest[rank], indent=1))
    if not newest:
        return None
    into.mkdir(parents=True, exist_ok=True)
    summary = into / "summary.txt"
    write_text_atomic(summary, summarize_collectives(newest, ranks, reason, stopped or {}, time.time()))
    return summary


def read_json(path: Path) -> dict | None:
    try:
        return json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return None


def summarize_collectives(files: dict[int, dict], ranks: list[int], reason: str, stopped: dict[int, str],
                          now: float) -> str:
    """A few lines: each rank's last collective and sequence numbers, then per process group which rank is
    behind and which collective the others wait in."""
    lines = [f"Each rank's last collectives (rank<R>.json beside this file), {reason}", ""]
    for rank in ranks:
        body = files.get(rank)
        if body is None:
            lines.append(f"rank {rank}: no records (no flight recorder ran there, or it stopped before writing any)")
            continue
        last = body["records"][-1] if body["records"] else None
        what = f"last {describe_record(last, now)}" if last else "no collective yet"
        seqs = ", ".join(f"group {group['name']} #{group['seq']}" for group in body["groups"])
        source = (f"from its heartbeat, last changed {now - body['time']:.1f} s earlier"
                  if body.get("source") == "heartbeat" else f"written by the rank itself: {shorten(body['reason'])}")
        frozen = f"; {stopped[rank]}: later collectives are unseen" if rank in stopped else ""
        lines.append(f"rank {rank}: {what}; last sequence numbers: {seqs or 'none'} ({source}{frozen})")
    lines.append("")
    lines.extend(compare_groups(files, set(stopped), now))
    return "\n".join(lines) + "\n"


def describe_record(record: dict, now: float) -> str:
    number = f"#{record['seq']}" if record.get("seq") is not None else f"p2p #{record.get('p2p_seq')}"
    return (f"{record['op']} {number} on group {record['group']} ({record.get('group_desc')}) at step "
            f"{record.get('step')}: {describe_state(record, now)}")


def describe_state(record: dict, now: float) -> str:
    if record["state"] == "issued":
        return f"issued {now - record['start_time']:.1f} s ago, not finished"
    if record["state"] == "failed":
        return f"failed: {shorten(record.get('error') or '')}"
    return record["state"]


def compare_groups(files: dict[int, dict], stopped: set[int], now: float) -> list[str]:
    """Per process group (its name and member ranks): the ranks behind, and where the ranks ahead are.
    A `stopped` (frozen, killed) rank may have gone further than its last heartbeat shows."""
    groups = {(group["name"], tuple(group["ranks"])): group for body in files.values() for group in body["groups"]}
    lines = []
    for key, group in sorted(groups.items()):
        seq = {rank: last_seq(files[rank], key) for rank in key[1] if rank in files}
        ahead = max(seq.values(), default=0)
        leaders = [rank for rank in seq if seq[rank] == ahead]
        behind = [rank for rank in seq if seq[rank] < ahead]
        record = next((r for r in files[leaders[0]]["records"]
                       if (r["group"], tuple(r["group_ranks"])) == key and r.get("seq") == ahead), None)
        if record is None:
            where = f"at #{ahead}"
        elif record["state"] == "issued":
            where = f"waiting in {record['op']} #{ahead} (step {record.get('step')}, {describe_state(record, now)})"
        else:
            where = f"at {record['op']} #{ahead} ({describe_state(record, now)})"
        line = f"group {key[0]} ({group.get('desc')}, ranks {', '.join(map(str, key[1]))}): "
        if behind:
            at = ", ".join(f"#{seq[rank]}" + (" at its last heartbeat" if rank in stopped else "") for rank in behind)
            line += f"{ranks_named(behind)} behind at {at}; {ranks_named(leaders)} {where}"
        else:
            line += f"every rank {where}"
        unknown = [rank for rank in key[1] if rank not in files]
        lines.append(line + (f"; no records from {ranks_named(unknown)}" if unknown else ""))
    return lines


def last_seq(body: dict, key: tuple[str, tuple[int, ...]]) -> int:
    """A rank's last collective sequence number on the group `key` (0: it issued none there)."""
    return next((group["seq"] for group in body["groups"] if (group["name"], tuple(group["ranks"])) == key), 0)


def shorten(text: str, limit: int = 100) -> str:
    return text if len(text) <= limit else text[:limit - 1] + "…"


def ranks_named(ranks: list[int]) -> str:
    return f"rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))}"
