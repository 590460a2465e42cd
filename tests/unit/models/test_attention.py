"""Grouping a ragged batch for padded attention (models/attention.padding_groups)."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from dspark_sglang.models import attention
from dspark_sglang.models.attention import MAX_GROUPS, MIN_GROUP_CELLS, PREFILL_Q, padding_groups

seq = st.tuples(st.integers(1, 600), st.integers(0, 4000))  # (new tokens, cached prefix)


def _padded_keys(groups: list[list[int]], kv: list[int]) -> int:
    return sum(len(g) * max(kv[r] for r in g) for g in groups)


@settings(max_examples=300, deadline=None)
@given(st.lists(seq, min_size=1, max_size=96))
def test_groups_partition_the_batch(seqs: list[tuple[int, int]]) -> None:
    q = [n for n, _ in seqs]
    kv = [n + p for n, p in seqs]
    groups = padding_groups(q, kv)
    assert sorted(r for g in groups for r in g) == list(range(len(seqs)))
    assert 1 <= len(groups) <= MAX_GROUPS
    # Gathered keys stay within 2x the real ones, up to the small groups merged on purpose.
    assert _padded_keys(groups, kv) <= 2 * sum(kv) + len(groups) * MIN_GROUP_CELLS


def test_equal_lengths_make_one_group() -> None:
    assert [sorted(g) for g in padding_groups([1] * 32, [300] * 32)] == [list(range(32))]


def test_one_long_context_does_not_pad_the_short_ones() -> None:
    kv = [120] * 31 + [3000]
    groups = padding_groups([1] * 32, kv)
    assert [31] in groups
    assert _padded_keys(groups, kv) == sum(kv)  # the old single group gathered 32 * 3000


def test_prefill_chunk_runs_apart_from_decode_rows() -> None:
    q = [1] * 16 + [512]
    kv = [700] * 16 + [512]
    groups = padding_groups(q, kv)
    big = next(g for g in groups if 16 in g)
    assert all(q[r] > PREFILL_Q for r in big)  # decode rows are not padded to 512 queries


def test_merge_floor_and_cap(monkeypatch) -> None:
    monkeypatch.setattr(attention, "MIN_GROUP_CELLS", 0)
    kv = [3**i for i in range(2, 24)]  # each a third of the next: one group each, up to the cap
    groups = padding_groups([1] * len(kv), kv)
    assert len(groups) == MAX_GROUPS
    assert all(len(g) == 1 for g in groups[:-1])
