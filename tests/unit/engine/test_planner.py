"""engine/planner.py helpers that need no engine."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from dspark_sglang.engine.planner import ctx_bucket


@given(st.integers(0, 10**9), st.integers(0, 10**9))
def test_ctx_bucket_rounds_up_by_at_most_a_sixteenth_and_is_monotone(a: int, b: int) -> None:
    for x in (a, b):
        q = ctx_bucket(x)
        assert x <= q <= x + x / 16
    if a <= b:
        assert ctx_bucket(a) <= ctx_bucket(b)


def test_ctx_bucket_is_exact_for_small_contexts_and_coarse_for_large_ones() -> None:
    assert [ctx_bucket(x) for x in range(32)] == list(range(32))
    assert ctx_bucket(300) == 304 and ctx_bucket(9_600) == 9_728
    assert len({ctx_bucket(x) for x in range(8_192, 16_384)}) == 17
