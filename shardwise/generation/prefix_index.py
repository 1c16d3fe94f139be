"""Which token prefixes the prefix cache holds, and where: the bookkeeping alone, without torch.

A prompt is cut into whole blocks of `block_size` tokens. A block is known by its parent block
(the one before it, None for the first) and its own tokens, so a block stands for the whole prefix
up to its end, as vLLM's hash chain does, with the tokens compared exactly rather than hashed
(no collision can ever return another prompt's keys). The blocks form a tree (a radix tree with one
block per edge, SGLang's RadixAttention at block granularity); each holds one block of the pool
(`id`, 0..num_blocks-1).

Eviction is least-recently-used among the leaves: a block with children is never evicted, so a
shared system prompt stays while any continuation of it is held, and a child's key (its parent's
id) always names a live parent. Using a block touches its whole chain, so a parent is never older
than its children.
"""

from __future__ import annotations

import heapq
import itertools
from dataclasses import dataclass
from typing import NamedTuple

RESTORE, STORE = 1, 2


class PrefixCopy(NamedTuple):
    """What the runner copies (on every rank): whole blocks between a slot and the pool, the slot's
    columns first_column.. (len(block_ids) blocks)."""

    op: int  # RESTORE: pool -> slot; STORE: slot -> pool
    slot: int
    first_column: int
    block_ids: list[int]


@dataclass(eq=False)
class Block:
    id: int  # the pool block holding its keys and values
    key: tuple  # (parent's id or -1, its tokens)
    parent: "Block | None"
    num_children: int = 0
    last_used: int = 0


class PrefixIndex:
    def __init__(self, num_blocks: int, block_size: int):
        self.num_blocks, self.block_size = num_blocks, block_size
        self.free = list(range(num_blocks - 1, -1, -1))  # pop() hands out block 0 first
        self.blocks: dict[tuple, Block] = {}
        self.leaves: list[tuple[int, int, Block]] = []  # heap of (last_used, tie-break, leaf); stale entries skipped
        self.clock = 0
        self.ties = itertools.count()
        self.num_evicted = 0

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self.free)

    def chain(self, tokens: list[int]) -> list[Block]:
        """The held blocks of the longest run of whole blocks from the start of `tokens`."""
        found, parent, size = [], None, self.block_size
        for start in range(0, len(tokens) - size + 1, size):
            block = self.blocks.get((parent.id if parent else -1, tuple(tokens[start:start + size])))
            if block is None:
                break
            found.append(block)
            parent = block
        return found

    def match(self, tokens: list[int]) -> list[int]:
        """Pool ids of the longest held prefix of `tokens` in whole blocks; they become the most recent."""
        found = self.chain(tokens)
        self.touch(found)
        return [block.id for block in found]

    def insert(self, tokens: list[int]) -> tuple[int, list[int]]:
        """Hold every whole block of `tokens`: (index of the first block that was not held, the pool
        ids given to it and the blocks after it, which the caller fills). Fewer ids when the pool has
        no evictable block left."""
        found = self.chain(tokens)
        self.touch(found)
        parent, size, new = (found[-1] if found else None), self.block_size, []
        for start in range(len(found) * size, len(tokens) - size + 1, size):
            block_id = self.take_free_block(keep=parent)
            if block_id is None:
                break
            block = Block(block_id, (parent.id if parent else -1, tuple(tokens[start:start + size])), parent)
            self.blocks[block.key] = block
            if parent is not None:
                parent.num_children += 1
            new.append(block)
            parent = block
        self.touch(found + new)
        return len(found), [block.id for block in new]

    def forget(self, tokens: list[int], first: int) -> None:
        """Undo an `insert` whose copy failed: its blocks from the `first` on hold nothing."""
        for block in reversed(self.chain(tokens)[first:]):
            self.remove(block)
            self.free.append(block.id)

    def touch(self, chain: list[Block]) -> None:
        if not chain:
            return
        self.clock += 1
        for block in chain:
            block.last_used = self.clock
        if chain[-1].num_children == 0:
            self.push_leaf(chain[-1])

    def push_leaf(self, block: Block) -> None:
        heapq.heappush(self.leaves, (block.last_used, next(self.ties), block))
        if len(self.leaves) > 2 * self.num_blocks + 64:  # drop stale entries now and then
            self.leaves = [entry for entry in self.leaves if self.is_current_leaf(*entry)]
            heapq.heapify(self.leaves)

    def is_current_leaf(self, last_used: int, tie: int, block: Block) -> bool:
        return self.blocks.get(block.key) is block and block.num_children == 0 and block.last_used == last_used

    def take_free_block(self, keep: Block | None) -> int | None:
        """A free pool block, else the least recently used leaf's (never `keep`'s); None: none left."""
        if self.free:
            return self.free.pop()
        while self.leaves:
            entry = heapq.heappop(self.leaves)
            if not self.is_current_leaf(*entry):
                continue
            block = entry[2]
            if block is keep:  # the block being extended: the newest leaf, so no other is left
                heapq.heappush(self.leaves, entry)
                return None
            self.evict(block)
            return block.id
        return None

    def evict(self, block: Block) -> None:
        self.remove(block)
        self.num_evicted += 1

    def remove(self, block: Block) -> None:
        del self.blocks[block.key]
        parent = block.parent
        if parent is not None:
            parent.num_children -= 1
            if parent.num_children == 0:
                self.push_leaf(parent)
