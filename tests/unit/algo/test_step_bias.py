"""algo/step_bias.py: the capacity model's error on drafting steps over plain ones, per R bin."""

from __future__ import annotations

import math

import pytest

from dspark_sglang.algo.step_bias import (
    BIAS_CLIP,
    BIAS_MAX,
    BIAS_PRIOR,
    BIAS_RATE,
    PARTIAL,
    PLAIN,
    WHOLE,
    StepKindBias,
    bias_bin,
)


def test_bins_are_powers_of_two() -> None:
    rs = (1, 2, 3, 4, 5, 8, 9, 16, 17, 32, 33, 64)
    assert [bias_bin(r) for r in rs] == [0, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6]


def test_the_factor_is_the_kinds_difference_shrunk_by_each_kinds_evidence() -> None:
    b = StepKindBias()
    for _ in range(8):
        b.observe(20, WHOLE, 1.1, 1.0)  # whole-batch drafting steps 10 % over
        b.observe(24, PARTIAL, 1.2, 1.0)  # selective ones 20 % over
        b.observe(30, PLAIN, 0.98, 1.0)  # plain steps 2 % under, the same bin
    w = 8 / (8 + BIAS_PRIOR)
    assert b.log_factor(32, WHOLE) == pytest.approx(w * w * (math.log(1.1) - math.log(0.98)))
    # the rarer selective kind: its mean shrunk toward the whole-batch one, both kinds' evidence
    partial = (8 * math.log(1.2) + BIAS_PRIOR * math.log(1.1)) / (8 + BIAS_PRIOR)
    both = 16 / (16 + BIAS_PRIOR)
    assert b.log_factor(32, PARTIAL) == pytest.approx(both * w * (partial - math.log(0.98)))
    assert b.log_factor(33) == 0.0 and b.log_factor(16) == 0.0  # other bins know nothing
    for _ in range(2000):
        b.observe(20, WHOLE, 1.1, 1.0)
        b.observe(30, PLAIN, 0.98, 1.0)
    assert b.log_factor(17) == pytest.approx(math.log(1.1 / 0.98), rel=0.02)
    json_ready = b.state()["17"]
    assert json_ready["whole_factor"] == pytest.approx(math.exp(b.log_factor(17, WHOLE)))
    assert json_ready["partial_factor"] == pytest.approx(math.exp(b.log_factor(17, PARTIAL)))
    assert json_ready["whole_steps"] == 2008 and json_ready["plain_steps"] == 2008
    assert json_ready["partial_steps"] == 8


def test_one_kind_alone_tells_nothing() -> None:
    """A common error (a slower host) moves neither K nor the factor; a bin with drafting steps
    only (low load) keeps factor 1."""
    b = StepKindBias()
    for _ in range(100):
        b.observe(2, WHOLE, 1.3, 1.0)
    assert b.log_factor(2) == 0.0
    for _ in range(100):
        b.observe(2, PLAIN, 1.3, 1.0)
    assert b.log_factor(2) == pytest.approx(0.0, abs=1e-12)
    assert b.log_factor(2, PARTIAL) == 0.0  # no selective step seen


def test_a_stall_counts_at_most_the_clip_and_the_factor_is_capped() -> None:
    b = StepKindBias()
    b.observe(4, WHOLE, 100.0, 1.0)
    assert b.bins[2][0] == BIAS_CLIP
    for _ in range(5000):
        b.observe(4, WHOLE, 2.0, 1.0)
        b.observe(4, PLAIN, 1.0, 1.0)
    assert b.log_factor(4) == BIAS_MAX
    b.observe(4, WHOLE, float("nan"), 1.0)  # nothing learned from an untimed or unpredicted step
    b.observe(4, PLAIN, 1.0, float("nan"))
    b.observe(4, PLAIN, 1.0, 0.0)
    assert b.bins[2][1] == 5001 and b.bins[2][5] == 5000


def test_the_mean_runs_exact_then_moves_at_the_rate() -> None:
    b = StepKindBias()
    for x in (1.0, 1.1, 1.2):
        b.observe(1, WHOLE, x, 1.0)
    assert b.bins[0][0] == pytest.approx((0.0 + math.log(1.1) + math.log(1.2)) / 3)
    b.bins[0][1] = 1e6
    before = b.bins[0][0]
    b.observe(1, WHOLE, 1.0, 1.0)
    assert b.bins[0][0] == pytest.approx(before * (1 - BIAS_RATE))
