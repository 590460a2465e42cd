"""algo/step_bias.py: the capacity model's error on drafting steps over plain ones, per R bin."""

from __future__ import annotations

import math

import pytest

from dspark_sglang.algo.step_bias import (
    BIAS_CLIP,
    BIAS_MAX,
    BIAS_PRIOR,
    BIAS_RATE,
    StepKindBias,
    bias_bin,
)


def test_bins_are_powers_of_two() -> None:
    assert [bias_bin(r) for r in (1, 2, 3, 4, 5, 8, 9, 16, 17, 32, 33, 64)] == [
        0,
        1,
        2,
        2,
        3,
        3,
        4,
        4,
        5,
        5,
        6,
        6,
    ]


def test_the_factor_is_the_kinds_difference_shrunk_by_each_kinds_evidence() -> None:
    b = StepKindBias()
    for _ in range(8):
        b.observe(20, True, 1.1, 1.0)  # drafting steps 10 % over
        b.observe(30, False, 0.98, 1.0)  # plain steps 2 % under, the same bin
    gap = math.log(1.1) - math.log(0.98)
    w = 8 / (8 + BIAS_PRIOR)
    assert b.log_factor(32) == pytest.approx(w * w * gap)
    assert b.log_factor(33) == 0.0 and b.log_factor(16) == 0.0  # other bins know nothing
    for _ in range(2000):
        b.observe(20, True, 1.1, 1.0)
        b.observe(30, False, 0.98, 1.0)
    assert b.log_factor(17) == pytest.approx(gap, rel=0.02)
    json_ready = b.state()["17"]
    assert json_ready["factor"] == pytest.approx(math.exp(b.log_factor(17)))
    assert json_ready["draft_steps"] == 2008 and json_ready["plain_steps"] == 2008


def test_one_kind_alone_tells_nothing() -> None:
    """A common error (a slower host) moves neither K nor the factor; a bin with drafting steps
    only (low load) keeps factor 1."""
    b = StepKindBias()
    for _ in range(100):
        b.observe(2, True, 1.3, 1.0)
    assert b.log_factor(2) == 0.0
    for _ in range(100):
        b.observe(2, False, 1.3, 1.0)
    assert b.log_factor(2) == pytest.approx(0.0, abs=1e-12)


def test_a_stall_counts_at_most_the_clip_and_the_factor_is_capped() -> None:
    b = StepKindBias()
    b.observe(4, True, 100.0, 1.0)
    assert b.bins[2][0] == BIAS_CLIP
    for _ in range(5000):
        b.observe(4, True, 2.0, 1.0)
        b.observe(4, False, 1.0, 1.0)
    assert b.log_factor(4) == BIAS_MAX
    b.observe(4, True, float("nan"), 1.0)  # nothing learned from an untimed or unpredicted step
    b.observe(4, False, 1.0, float("nan"))
    b.observe(4, False, 1.0, 0.0)
    assert b.bins[2][1] == 5001 and b.bins[2][3] == 5000


def test_the_mean_runs_exact_then_moves_at_the_rate() -> None:
    b = StepKindBias()
    for x in (1.0, 1.1, 1.2):
        b.observe(1, True, x, 1.0)
    assert b.bins[0][0] == pytest.approx((0.0 + math.log(1.1) + math.log(1.2)) / 3)
    b.bins[0][1] = 1e6
    before = b.bins[0][0]
    b.observe(1, True, 1.0, 1.0)
    assert b.bins[0][0] == pytest.approx(before * (1 - BIAS_RATE))


def test_a_bin_starts_from_the_prior_and_evidence_shrinks_it_away() -> None:
    """Until both kinds were measured at an R the factor is the prior; as they are, it moves to
    the measured difference, and a bin that has seen one kind only keeps the prior."""
    b = StepKindBias(prior=0.04)
    assert b.log_factor(40) == pytest.approx(math.log(1.04))
    for _ in range(100):
        b.observe(40, True, 1.0, 1.0)  # drafting steps only: nothing to compare yet
    assert b.log_factor(40) == pytest.approx(math.log(1.04))
    for _ in range(8):
        b.observe(40, False, 1.0, 1.0)  # plain ones on time too: the kinds agree
    w = 100 / (100 + BIAS_PRIOR) * 8 / (8 + BIAS_PRIOR)
    assert b.log_factor(40) == pytest.approx((1 - w) * math.log(1.04))
    for _ in range(5000):
        b.observe(40, True, 1.0, 1.0)
        b.observe(40, False, 1.0, 1.0)
    assert abs(b.log_factor(40)) < 0.01 * math.log(1.04)
    assert StepKindBias().log_factor(40) == 0.0  # no prior: the model's prices
    assert StepKindBias(prior=0.9).log_factor(2) == BIAS_MAX  # the cap holds for the prior too
    for bad in (1.0, -0.5, float("nan")):
        with pytest.raises(ValueError, match="prior"):
            StepKindBias(prior=bad)
