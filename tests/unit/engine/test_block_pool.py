"""Property and edge-case tests for engine.block_pool; CPU only, imports nothing but the pool."""

from __future__ import annotations

from collections import Counter

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from dspark_sglang.config import CacheConfig, ConfigError
from dspark_sglang.engine.block_pool import BlockPool, OutOfBlocks

NUM_BLOCKS = 16
PAGE_SIZE = 4


class BlockPoolMachine(RuleBasedStateMachine):
    """Model: (block_table, num_tokens) pairs; the pool must agree with it after every op."""

    order = "lowest"

    def __init__(self) -> None:
        super().__init__()
        self.pool = BlockPool(NUM_BLOCKS, PAGE_SIZE, self.order)
        self.tables: list[tuple[list[int], int]] = []

    def _pick(self, i: int) -> int:
        return i % len(self.tables)

    def _snapshot(self) -> tuple[list[int], list[int], list[list[int]]]:
        # Reads private state on purpose: the invariants are about the free list and ref counts.
        return self.pool.free_blocks(), list(self.pool._ref), [list(t) for t, _ in self.tables]

    @rule(tokens=st.integers(0, 3 * PAGE_SIZE))
    def create(self, tokens: int) -> None:
        table: list[int] = []
        if self.pool.can_grow(table, tokens):
            self.pool.grow(table, tokens)
            self.tables.append((table, tokens))
        else:
            before = self._snapshot()
            with pytest.raises(OutOfBlocks):
                self.pool.grow(table, tokens)
            assert table == [] and self._snapshot() == before

    @precondition(lambda self: self.tables)
    @rule(i=st.integers(0, 1000), extra=st.integers(0, 4 * PAGE_SIZE))
    def grow(self, i: int, extra: int) -> None:
        i = self._pick(i)
        table, tokens = self.tables[i]
        need = self.pool.num_new_blocks(table, tokens + extra)
        assert need == self.pool.blocks_for(tokens + extra) - len(table)
        if need <= self.pool.num_free_blocks:
            assert self.pool.can_grow(table, tokens + extra)
            self.pool.grow(table, tokens + extra)
            self.tables[i] = (table, tokens + extra)
        else:
            assert not self.pool.can_grow(table, tokens + extra)
            before = self._snapshot()
            with pytest.raises(OutOfBlocks):
                self.pool.grow(table, tokens + extra)
            assert self._snapshot() == before

    @precondition(lambda self: self.tables)
    @rule(i=st.integers(0, 1000), n=st.integers(0, 3 * PAGE_SIZE))
    def shrink(self, i: int, n: int) -> None:
        i = self._pick(i)
        table, tokens = self.tables[i]
        kept = max(0, tokens - n)
        prefix = table[: self.pool.blocks_for(kept)]
        self.pool.shrink(table, kept)
        assert table == prefix
        self.tables[i] = (table, kept)

    @precondition(lambda self: self.tables)
    @rule(i=st.integers(0, 1000))
    def fork(self, i: int) -> None:
        table, tokens = self.tables[self._pick(i)]
        child = self.pool.fork(table)
        assert child == table and child is not table
        self.tables.append((child, tokens))

    @precondition(lambda self: self.tables)
    @rule(i=st.integers(0, 1000))
    def release(self, i: int) -> None:
        table, _ = self.tables.pop(self._pick(i))
        self.pool.release(table)
        assert table == []

    @invariant()
    def pool_matches_model(self) -> None:
        pool = self.pool
        refs: Counter[int] = Counter()
        for table, tokens in self.tables:
            assert len(table) == pool.blocks_for(tokens)
            assert len(set(table)) == len(table), "block twice in one table"
            refs.update(table)
        free = pool.free_blocks()
        assert len(set(free)) == len(free), "block twice in free list"
        for block in range(NUM_BLOCKS):
            assert pool._ref[block] == refs[block]
            # Free and referenced are exact complements.
            assert (block in free) == (refs[block] == 0)
        assert pool.num_free_blocks + pool.num_used_blocks == NUM_BLOCKS
        assert pool.num_used_blocks == len(refs)

    def teardown(self) -> None:
        for table, _ in self.tables:
            self.pool.release(table)
        assert self.pool.num_free_blocks == NUM_BLOCKS
        assert all(r == 0 for r in self.pool._ref)


BlockPoolMachine.TestCase.settings = settings(
    max_examples=200,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestBlockPoolMachine = BlockPoolMachine.TestCase


class FifoBlockPoolMachine(BlockPoolMachine):
    order = "fifo"


FifoBlockPoolMachine.TestCase.settings = BlockPoolMachine.TestCase.settings
TestFifoBlockPoolMachine = FifoBlockPoolMachine.TestCase


@pytest.mark.parametrize(
    ("tokens", "blocks"), [(0, 0), (1, 1), (3, 1), (4, 1), (5, 2), (8, 2), (9, 3)]
)
def test_blocks_for(tokens: int, blocks: int) -> None:
    assert BlockPool(8, 4).blocks_for(tokens) == blocks


def test_blocks_for_page_size_one() -> None:
    assert BlockPool(8, 1).blocks_for(7) == 7


@pytest.mark.parametrize(("num_blocks", "page_size"), [(0, 4), (-1, 4), (4, 0), (4, -2)])
def test_bad_constructor_args(num_blocks: int, page_size: int) -> None:
    with pytest.raises(ConfigError):
        BlockPool(num_blocks, page_size)


def test_an_unknown_block_order_is_a_config_error_naming_the_choices() -> None:
    with pytest.raises(ConfigError, match="lowest"):
        BlockPool(4, 2, "random")
    with pytest.raises(ConfigError, match="--kv-block-order"):
        CacheConfig(block_order="lifo")


def test_lowest_order_refills_the_lowest_freed_blocks_before_untouched_ones() -> None:
    """The live blocks stay packed at the bottom of the pool however requests finish."""
    pool = BlockPool(8, 2)  # "lowest" is the default
    a: list[int] = []
    b: list[int] = []
    c: list[int] = []
    for t in (a, b, c):
        pool.grow(t, 4)
    assert (a, b, c) == ([0, 1], [2, 3], [4, 5])
    pool.release(c)
    pool.release(a)  # out of step: the first request finishes after the third
    d: list[int] = []
    pool.grow(d, 6)
    assert d == [0, 1, 4]  # not 6 and 7, which FIFO hands out first
    pool.grow(b, 6)
    assert b == [2, 3, 5]


def test_out_of_blocks_allocates_nothing() -> None:
    pool = BlockPool(4, 2)
    a: list[int] = []
    pool.grow(a, 5)  # 3 blocks
    b = [7]  # sentinel content must survive a failed grow
    with pytest.raises(OutOfBlocks):
        pool.grow(b, 2 * 2 + 1)  # needs 2 more, only 1 free
    assert b == [7] and pool.num_free_blocks == 1
    assert not pool.can_grow([], 3) and pool.can_grow([], 2)


def test_fifo_order_and_grow_is_idempotent() -> None:
    pool = BlockPool(4, 2, "fifo")
    t: list[int] = []
    pool.grow(t, 4)
    assert t == [0, 1]
    pool.grow(t, 3)  # already covered: no-op, never shrinks
    assert t == [0, 1]
    pool.release(t)
    u: list[int] = []
    pool.grow(u, 8)
    assert u == [2, 3, 0, 1]  # freed blocks go to the back of the queue


def test_fork_shares_until_last_release() -> None:
    pool = BlockPool(4, 2)
    a: list[int] = []
    pool.grow(a, 4)
    b = pool.fork(a)
    pool.release(a)
    assert pool.num_used_blocks == 2
    pool.shrink(b, 1)
    assert b == [0] and pool.num_used_blocks == 1
    pool.release(b)
    assert pool.num_free_blocks == 4


def test_double_free_detected() -> None:
    pool = BlockPool(4, 2)
    a: list[int] = []
    pool.grow(a, 4)
    stale = list(a)
    pool.release(a)
    with pytest.raises(RuntimeError, match="double free of block 0"):
        pool.release(stale)
    assert pool.num_free_blocks == 4


def test_double_free_within_one_table_frees_nothing() -> None:
    pool = BlockPool(4, 2)
    a: list[int] = []
    pool.grow(a, 4)
    with pytest.raises(RuntimeError, match="double free of block 1"):
        pool.release([1, 1])
    assert pool.num_used_blocks == 2


def test_fork_of_freed_blocks_rejected() -> None:
    pool = BlockPool(4, 2)
    with pytest.raises(RuntimeError, match="not allocated"):
        pool.fork([0])
    with pytest.raises(RuntimeError, match="out of range"):
        pool.fork([9])


@pytest.mark.parametrize(
    ("order", "granted"), [("fifo", [2, 3, 0, 1, 2]), ("lowest", [2, 0, 1, 2, 3])]
)
def test_granted_blocks_are_logged_only_when_tracked_and_handed_over_once(
    order: str, granted: list[int]
) -> None:
    pool = BlockPool(num_blocks=4, page_size=2, order=order)
    table: list[int] = []
    pool.grow(table, 3)
    assert pool.take_granted() == []  # untracked: nothing kept
    pool.track_grants()
    pool.grow(table, 5)  # one more block
    pool.release(table)
    other: list[int] = []
    pool.grow(other, 8)  # all four (FIFO: the never-used one first, then the freed ones)
    assert pool.take_granted() == granted
    assert pool.take_granted() == []
