"""engine/batch.py: the forward batch's slots, page by page."""

from __future__ import annotations

import torch
from hypothesis import given
from hypothesis import strategies as st

from dspark_sglang.engine.batch import build_batch, slot_table
from dspark_sglang.engine.kv_cache import slots
from dspark_sglang.engine.sequence import Sequence
from dspark_sglang.types import SamplingParams, ScheduledSeq, StepPlan


@given(
    st.lists(st.lists(st.integers(0, 50), min_size=0, max_size=6), min_size=1, max_size=4),
    st.integers(1, 5),
    st.integers(0, 30),
)
def test_slot_table_is_the_per_position_slots_and_valid_past_each_table(
    tables: list[list[int]], page_size: int, length: int
) -> None:
    got = slot_table(tables, length, page_size)
    assert got.shape == (len(tables), length) and got.dtype == torch.long
    for row, t in zip(got.tolist(), tables, strict=True):
        n = min(length, len(t) * page_size)
        assert row[:n] == slots(t, 0, n, page_size)
        assert all(0 <= x < page_size for x in row[n:])  # block 0: a valid slot, masked


def test_build_batch_writes_each_new_token_to_its_slot_and_attends_its_context() -> None:
    """Two sequences of different lengths, one verifying drafts: slot_mapping is each new
    token's slot, each group's key slots are the sequence's context in order."""
    page = 4
    a = Sequence(1, list(range(9)), SamplingParams(max_tokens=8), 0, output_ids=[9])
    b = Sequence(2, list(range(3)), SamplingParams(max_tokens=8), 1)
    a.block_table, b.block_table = [7, 2, 9], [5]
    a.num_cached = 9
    plan = StepPlan(
        (
            ScheduledSeq(1, start_pos=9, num_new_tokens=3, sample=True, draft_ids=(11, 12)),
            ScheduledSeq(2, start_pos=0, num_new_tokens=3, sample=True),
        )
    )
    batch = build_batch(plan, {1: a, 2: b}, page, "cpu")
    assert batch.attn.slot_mapping.tolist() == slots([7, 2, 9], 9, 12, page) + slots(
        [5], 0, 3, page
    )
    assert batch.kv_tokens == 12 + 3 and batch.num_tokens == 6
    assert batch.input_ids.tolist() == [9, 11, 12, 0, 1, 2]
    # one group or two; a row may run past its context (masked there)
    contexts = [kv for g in batch.attn.groups for kv in g.kv_slots.tolist()]
    want = {12: slots([7, 2, 9], 0, 12, page), 3: slots([5], 0, 3, page)}
    assert len(contexts) == 2
    assert any(c[:12] == want[12] for c in contexts)
    assert any(c[:3] == want[3] for c in contexts)
