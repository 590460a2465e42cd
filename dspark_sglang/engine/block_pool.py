"""Paged KV block allocator on ints: FIFO free list, ref counts, grow/shrink/fork of block tables.

Stdlib only; imports nothing but `config.ConfigError` (no torch: the runner owns the KV tensors).
"""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Iterable

from dspark_sglang.config import ConfigError


class OutOfBlocks(RuntimeError):
    """Not enough free blocks for a grow; nothing was allocated."""


class BlockPool:
    """Hands out block ids in `[0, num_blocks)`; a block is free again when its ref count hits 0."""

    def __init__(self, num_blocks: int, page_size: int) -> None:
        if num_blocks <= 0:
            raise ConfigError(f"num_blocks must be positive, got {num_blocks}")
        if page_size <= 0:
            raise ConfigError(f"page_size must be positive, got {page_size}")
        self.num_blocks = num_blocks
        self.page_size = page_size
        # FIFO, not LIFO: a freed block is reused last, so its KV survives longest (what a prefix
        # cache on top of this pool wants) and allocation order is deterministic for tests.
        self._free: deque[int] = deque(range(num_blocks))
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
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self._free)

    def blocks_for(self, num_tokens: int) -> int:
        if num_tokens < 0:
            raise ValueError(f"num_tokens must be >= 0, got {num_tokens}")
        return -(-num_tokens // self.page_size)

    def num_new_blocks(self, block_table: list[int], num_tokens: int) -> int:
        return max(0, self.blocks_for(num_tokens) - len(block_table))

    def can_grow(self, block_table: list[int], num_tokens: int) -> bool:
        return self.num_new_blocks(block_table, num_tokens) <= len(self._free)

    def grow(self, block_table: list[int], num_tokens: int) -> None:
        need = self.num_new_blocks(block_table, num_tokens)
        # Check before popping anything so a failed grow leaves the pool and table untouched.
        if need > len(self._free):
            raise OutOfBlocks(f"need {need} blocks for {num_tokens} tokens, {len(self._free)} free")
        for _ in range(need):
            block = self._free.popleft()
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
                self._free.append(block)
