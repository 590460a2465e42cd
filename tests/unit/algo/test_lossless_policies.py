"""Exact-enumeration losslessness of every verify-length policy (paper Appendix A).

Confidences depend on the drafted tokens the way the real head's do (c_k reads the token at
k-1), so a policy that lets d_k's own value decide whether d_k is verified is caught: the
retrospective scheduler must fail, Algorithm 1 and the lagged top-K must pass.
"""

from __future__ import annotations

import numpy as np
import pytest

from dspark_sglang.algo import verify_budget as vb
from tests.unit.algo.test_acceptance import (
    GAMMA,
    Policy,
    V,
    speculative_sequence_probs,
    target_sequence_probs,
)

# Theta(0) = 1 beats Theta(1) unless a1 > 2/3, while Theta(2) wins when a1 + a2 is large:
# a non-unimodal curve where early stop and the global argmax disagree.
SPS = np.array([0.0, 1.0, 0.6, 0.55])
W = np.array([0.4, 2.5, -1.0])  # confidence logit of the next draft given the previous token


def confidences(prefix: tuple[int, ...], drafts: tuple[int, ...]) -> np.ndarray:
    prev = (prefix[-1] if prefix else 0, *drafts[: GAMMA - 1])
    return 1.0 / (1.0 + np.exp(-W[list(prev)]))[None, :]  # [1, GAMMA]; c_k reads d_{k-1}


def surv(prefix: tuple[int, ...], drafts: tuple[int, ...]) -> np.ndarray:
    return np.cumprod(confidences(prefix, drafts), axis=1)


PRIOR = np.array([[0.7, 0.5]])  # what a lagged snapshot would hold: no current-step values

POLICIES: dict[str, Policy] = {
    "sync": lambda p, d: int(vb.early_stop(surv(p, d), SPS)[0]),
    "lagged": lambda p, d: int(vb.assign_top_k(surv(p, d), vb.lagged_global_k(PRIOR, SPS))[0]),
    "threshold": lambda p, d: int(vb.threshold(confidences(p, d), 0.6)[0]),
    "fixed": lambda p, d: int(vb.fixed(confidences(p, d), 1)[0]),
    "verify-all": lambda p, d: int(vb.verify_all(confidences(p, d))[0]),
}


@pytest.mark.parametrize("name", POLICIES)
def test_serving_policies_are_lossless(name: str) -> None:
    want = target_sequence_probs()
    got = speculative_sequence_probs(POLICIES[name])
    for seq, pr in want.items():
        assert got.get(seq, 0.0) == pytest.approx(pr, abs=1e-12), (name, seq)


def test_retrospective_is_biased() -> None:
    policy = lambda p, d: int(vb.retrospective(surv(p, d), SPS)[0])
    lens = {policy((), d) for d in np.ndindex(*(V,) * GAMMA)}
    assert lens == {0, 2}  # admission of d_1 depends on d_1 itself
    want = target_sequence_probs()
    got = speculative_sequence_probs(policy)
    assert max(abs(got.get(s, 0.0) - pr) for s, pr in want.items()) > 1e-3
