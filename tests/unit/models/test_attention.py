"""Grouping a ragged batch for padded attention (models/attention.padding_groups)."""

from __future__ import annotations

from unittest.mock import patch

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dspark_sglang.models import attention
from dspark_sglang.models.attention import (
    MAX_GROUPS,
    MIN_GROUP_CELLS,
    PAD_RATIO,
    PREFILL_Q,
    VERIFY_Q_RATIO,
    padding_groups,
    ragged_metadata,
)

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


def test_decode_and_verify_rows_get_the_same_masks_and_layout_as_one_rule() -> None:
    """A group of decode rows (one new token each) takes a shorter path; its metadata is what
    the general rule gives: query 0 of row r sees keys j <= start_r, no padded queries. Checked
    against a group where one row verifies 3 tokens (the general path), row by row."""
    starts = [5, 9, 2]
    table = torch.arange(3 * 16).view(3, 16)
    dec = ragged_metadata(starts, [1, 1, 1], table, torch.zeros(3, dtype=torch.long), "cpu")
    mix = ragged_metadata(starts, [1, 3, 1], table, torch.zeros(5, dtype=torch.long), "cpu")
    assert len(dec.groups) == len(mix.groups) == 1
    d, g = dec.groups[0], mix.groups[0]
    assert d.max_q == 1 and g.max_q == 3
    assert d.q_seq.tolist() == [0, 1, 2] and d.q_off.tolist() == [0, 0, 0]
    assert d.mask.shape == (3, 1, 1, 10)
    for r, s in enumerate(starts):
        want = [j <= s for j in range(10)]
        assert d.mask[r, 0, 0].tolist() == want
        assert g.mask[r, 0, 0, :10].tolist() == want  # the general rule, query 0
        assert d.kv_slots[r, : s + 1].tolist() == table[r, : s + 1].tolist()


def test_verify_rows_pad_only_to_a_similar_query_count() -> None:
    """A ragged verify: 32 rows verifying 8 tokens, 32 verifying 3, 32 decode rows, one context
    length. Each class runs apart: padding every row to 8 queries made it cost verify-all."""
    q = [8] * 32 + [3] * 32 + [1] * 32
    groups = padding_groups(q, [300] * 96)
    assert sorted(sorted({q[r] for r in g}) for g in groups) == [[1], [3], [8]]


@settings(max_examples=300, deadline=None)
@given(
    st.lists(st.tuples(st.integers(1, PREFILL_Q), st.integers(0, 4000)), min_size=1, max_size=16)
)
def test_verify_groups_pad_queries_and_keys_within_their_ratios(
    seqs: list[tuple[int, int]],
) -> None:
    # at most MAX_GROUPS rows and no merge floor: every group is one the ratios admitted
    with patch.object(attention, "MIN_GROUP_CELLS", 0):
        q = [n for n, _ in seqs]
        kv = [n + p for n, p in seqs]
        groups = padding_groups(q, kv)
    assert sorted(r for g in groups for r in g) == list(range(len(seqs)))
    for g in groups:
        assert max(q[r] for r in g) <= VERIFY_Q_RATIO * min(q[r] for r in g)
        assert max(kv[r] for r in g) <= PAD_RATIO * min(kv[r] for r in g)
