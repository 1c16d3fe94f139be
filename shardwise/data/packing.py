"""Examples into train.seq_len rows: packed several to a row (data.packing), or one to a row, padded.

Example k of n tokens contributes n - 1 positions: inputs tokens[:-1], targets tokens[1:] where its
loss flags say so, else -100, so no target crosses from one example into the next.

Packing is best-fit, greedy, in a seeded order: the examples are visited in a permutation drawn
from (train.seed, PACK_STREAM), and each goes into the open row with the least room that still
holds it, else a new row; an example is never split (data.overlong has made each fit a row).
Every rank computes the same rows. A packed row holds its examples in the order they were placed,
example j of the row with document id j; the padding after them has inputs end-of-text, targets
-100 and document id one past the last example (the micro-batch contract in
tools/post_training_contract.md). An unpacked row is one example, padded the same way, and no
document ids: the padding comes after the example, so causal attention already keeps it out.
"""

from __future__ import annotations

import bisect

import numpy as np

from shardwise.data.example_store import ExampleStore
from shardwise.data.objectives import IGNORE_INDEX

PACK_STREAM = 0x7061636B
"""Separates the packing order's draws from the loader's permutations, seeded by (seed, epoch)."""


def pack_examples(positions: np.ndarray, capacity: int, seed: int) -> list[np.ndarray]:
    """Rows of example indices: best-fit of examples of `positions` positions each into rows of
    `capacity`, visiting them in a seeded order (module docstring)."""
    order = np.random.default_rng([seed, PACK_STREAM]).permutation(len(positions))
    rows: list[list[int]] = []
    rows_by_room: dict[int, list[int]] = {}  # room left -> the rows with that much (the newest last)
    rooms: list[int] = []  # the keys of rows_by_room, sorted
    for example in order.tolist():
        need = int(positions[example])
        place = bisect.bisect_left(rooms, need)
        if place == len(rooms):
            row, room = len(rows), capacity
            rows.append([])
        else:
            room = rooms[place]
            row = rows_by_room[room].pop()
            if not rows_by_room[room]:
                del rows_by_room[room]
                rooms.pop(place)
        rows[row].append(example)
        room -= need
        if room > 0:
            if room not in rows_by_room:
                bisect.insort(rooms, room)
            rows_by_room.setdefault(room, []).append(row)
    return [np.asarray(row, dtype=np.int64) for row in rows]


def packed_row(store: ExampleStore, examples: np.ndarray, seq_len: int,
               pad_id: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(inputs, targets, document ids), int64 [seq_len] each, of the examples `examples` in one row."""
    inputs = np.full(seq_len, pad_id, dtype=np.int64)
    targets = np.full(seq_len, IGNORE_INDEX, dtype=np.int64)
    document_ids = np.full(seq_len, len(examples), dtype=np.int64)
    at = 0
    for document, example in enumerate(examples):
        ids, loss = store.example(int(example))
        span = slice(at, at + len(ids) - 1)
        inputs[span] = ids[:-1]
        targets[span] = np.where(loss[1:], ids[1:], IGNORE_INDEX)
        document_ids[span] = document
        at = span.stop
    return inputs, targets, document_ids


def padding_fraction(store: ExampleStore, num_rows: int, seq_len: int) -> float:
    """The share of the rows' positions that hold padding."""
    return 1.0 - float((store.lengths - 1).sum()) / (num_rows * seq_len) if num_rows else 0.0
