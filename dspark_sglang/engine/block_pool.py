"""Paged KV block allocator on ints: a free list (lowest block first, or FIFO), ref counts,
grow/shrink/fork of block tables.

Stdlib only; imports nothing but `config` (no torch: the runner owns the KV tensors).
"""

from __future__ import annotations

import heapq
from collections import Counter, deque
from collections.abc import Iterable

from dspark_sglang.config import BLOCK_ORDERS, ConfigError


class OutOfBlocks(RuntimeError):
    """Not enough free blocks for a grow; nothing was allocated."""


class BlockPool:
    """Hands out block ids in `[0, num_blocks)`; a block is free again when its ref count hits 0."""

    def __init__(self, num_blocks: int, page_size: int, order: str = "lowest") -> None:
        if num_blocks <= 0:
            raise ConfigError(f"num_blocks must be positive, got {num_blocks}")
        if page_size <= 0:
            raise ConfigError(f"page_size must be positive, got {page_size}")
        if order not in BLOCK_ORDERS:
            raise ConfigError(f"block order must be one of {BLOCK_ORDERS}, got {order!r}")
        self.num_blocks = num_blocks
        self.page_size = page_size
        self.order = order
        # "lowest" (a heap): the live blocks stay packed at the bottom of the pool. With FIFO,
        # requests that finish out of step (speculative decoding's, or of unequal lengths) leave
        # every block handed out in turn, and a batch's KV ends up scattered over the whole pool:
        # a CPU decode step at R = 64 then gathered its context 4.7 % slower (free list shuffled
        # against in order; docs/engine.md). "fifo": a freed block is reused last, so its KV
        # survives longest (what a prefix cache on top of this pool would want). Both orders
        # are deterministic.
        self._heap: list[int] = list(range(num_blocks)) if order == "lowest" else []
        self._fifo: deque[int] = deque() if order == "lowest" else deque(range(num_blocks))
        self._ref: list[int] = [0] * num_blocks
        self._granted: list[int] | None = None  # blocks grow() handed out, when tracked

    def track_grants(self) -> None:
        """Log the blocks grow() hands out until take_granted(): for state kept per slot
        outside this pool, which goes stale when a block gets a new owner."""
        if self._granted is None:
            self._granted = []

    def take_granted(self) -> list[int]:
        """Blocks handed out since the last call (none unless track_grants())."""
        if not self._granted:
            return []
        got, self._granted = self._granted, []
        return got

    @property
    def num_free_blocks(self) -> int:
        return len(self._heap) + len(self._fifo)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.num_free_blocks

    def blocks_for(self, num_tokens: int) -> int:
        if num_tokens < 0:
            raise ValueError(f"num_tokens must be >= 0, got {num_tokens}")
        return -(-num_tokens // self.page_size)

    def num_new_blocks(self, block_table: list[int], num_tokens: int) -> int:
        return max(0, self.blocks_for(num_tokens) - len(block_table))

    def can_grow(self, block_table: list[int], num_tokens: int) -> bool:
        return self.num_new_blocks(block_table, num_tokens) <= self.num_free_blocks

    def grow(self, block_table: list[int], num_tokens: int) -> None:
        need = self.num_new_blocks(block_table, num_tokens)
        # Check before popping anything so a failed grow leaves the pool and table untouched.
        if need > self.num_free_blocks:
            raise OutOfBlocks(
                f"need {need} blocks for {num_tokens} tokens, {self.num_free_blocks} free"
            )
        for _ in range(need):
            block = self._take()
            self._ref[block] = 1
            block_table.append(block)
            if self._granted is not None:
                self._granted.append(block)

    def shrink(self, block_table: list[int], num_tokens: int) -> None:
        keep = self.blocks_for(num_tokens)
        if keep >= len(block_table):
            return
        self._decref(block_table[keep:])
        del block_table[keep:]

    def release(self, block_table: list[int]) -> None:
        self._decref(block_table)
        block_table.clear()

    def fork(self, block_table: list[int]) -> list[int]:
        for block in block_table:
            self._check_live(block)
        for block in block_table:
            self._ref[block] += 1
        return list(block_table)

    def _check_live(self, block: int) -> None:
        if not 0 <= block < self.num_blocks:
            raise RuntimeError(f"block {block} out of range [0, {self.num_blocks})")
        if self._ref[block] == 0:
            raise RuntimeError(f"block {block} is not allocated")

    def _decref(self, blocks: Iterable[int]) -> None:
        counts = Counter(blocks)
        # Validate everything first: a half-applied free would leave ref counts unrecoverable.
        for block, n in counts.items():
            if not 0 <= block < self.num_blocks:
                raise RuntimeError(f"block {block} out of range [0, {self.num_blocks})")
            if self._ref[block] < n:
                raise RuntimeError(f"double free of block {block}")
        for block, n in counts.items():
            self._ref[block] -= n
            if self._ref[block] == 0:
                self._give(block)

    def _take(self) -> int:
        return heapq.heappop(self._heap) if self.order == "lowest" else self._fifo.popleft()

    def _give(self, block: int) -> None:
        if self.order == "lowest":
            heapq.heappush(self._heap, block)
        else:
            self._fifo.append(block)

    def free_blocks(self) -> list[int]:
        """The free block ids, in no promised order (tests, debugging)."""
        return list(self._heap) + list(self._fifo)
