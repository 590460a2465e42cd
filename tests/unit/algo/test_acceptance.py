"""Losslessness of verification, by exact enumeration on a toy vocabulary and by sampling."""

from __future__ import annotations

import itertools
from collections.abc import Callable

import pytest
import torch

from dspark_sglang.algo.acceptance import (
    acceptance_probs,
    bonus_distribution,
    residual,
    verify,
)

V = 3
GAMMA = 2
M = 3  # tokens generated per enumerated sequence


def _table(seed: int, sharp: float) -> Callable[[tuple[int, ...]], torch.Tensor]:
    cache: dict[tuple[int, ...], torch.Tensor] = {}

    def dist(prefix: tuple[int, ...]) -> torch.Tensor:
        if prefix not in cache:
            g = torch.Generator().manual_seed(hash((seed, prefix)) % 2**31)
            cache[prefix] = torch.softmax(
                sharp * torch.randn(V, generator=g, dtype=torch.float64), 0
            )
        return cache[prefix]

    return dist


TARGET = _table(1, 1.5)
DRAFT = _table(2, 2.0)  # deliberately different from the target
Policy = Callable[[tuple[int, ...], tuple[int, ...]], int]


def target_sequence_probs() -> dict[tuple[int, ...], float]:
    out = {}
    for seq in itertools.product(range(V), repeat=M):
        pr = 1.0
        for t in range(M):
            pr *= float(TARGET(seq[:t])[seq[t]])
        out[seq] = pr
    return out


def speculative_sequence_probs(policy: Policy) -> dict[tuple[int, ...], float]:
    """Exact output distribution of rounds (draft, verify l = policy(...), bonus) to M tokens."""
    out: dict[tuple[int, ...], float] = {}

    def rounds(prefix: tuple[int, ...], pr: float) -> None:
        if len(prefix) >= M:
            key = prefix[:M]
            out[key] = out.get(key, 0.0) + pr
            return
        for drafts in itertools.product(range(V), repeat=GAMMA):
            q_rows = [DRAFT(prefix + drafts[:i]) for i in range(GAMMA)]
            p_draft = 1.0
            for i, d in enumerate(drafts):
                p_draft *= float(q_rows[i][d])
            ell = policy(prefix, drafts)
            p = torch.stack([TARGET(prefix + drafts[:i]) for i in range(GAMMA + 1)])[None]
            q = torch.stack(q_rows)[None]
            alpha = acceptance_probs(p[:, :GAMMA], q, torch.tensor([drafts]))[0]
            for n in range(ell + 1):
                pr_n = float(torch.prod(alpha[:n])) * (1.0 - float(alpha[n]) if n < ell else 1.0)
                if pr_n == 0.0:
                    continue
                bonus = bonus_distribution(p, q, torch.tensor([n]), torch.tensor([ell]))[0]
                for b in range(V):
                    if float(bonus[b]) > 0:
                        rounds(prefix + drafts[:n] + (b,), pr * p_draft * pr_n * float(bonus[b]))

    rounds((), 1.0)
    return out


POLICIES: dict[str, Policy] = {
    "plain-decode": lambda prefix, d: 0,
    "verify-all": lambda prefix, d: GAMMA,
    "fixed-1": lambda prefix, d: 1,
    "by-position": lambda prefix, d: len(prefix) % (GAMMA + 1),
}


@pytest.mark.parametrize("name", POLICIES)
def test_exact_enumeration_equals_target(name: str) -> None:
    want = target_sequence_probs()
    got = speculative_sequence_probs(POLICIES[name])
    assert set(got) <= set(want)
    for seq, pr in want.items():
        assert got.get(seq, 0.0) == pytest.approx(pr, abs=1e-12), seq


def test_enumeration_detects_a_wrong_residual(monkeypatch: pytest.MonkeyPatch) -> None:
    """The harness has power: resampling the bonus from p instead of the residual is biased."""
    import tests.unit.algo.test_acceptance as me

    def biased(
        p: torch.Tensor, q: torch.Tensor, n: torch.Tensor, lengths: torch.Tensor
    ) -> torch.Tensor:
        return p[torch.arange(p.shape[0]), n]

    monkeypatch.setattr(me, "bonus_distribution", biased)
    want = target_sequence_probs()
    got = speculative_sequence_probs(POLICIES["verify-all"])
    assert max(abs(got.get(s, 0.0) - pr) for s, pr in want.items()) > 1e-3


def test_verify_samples_match_branch_probabilities() -> None:
    """verify(): empirical (n, bonus) frequencies equal the analytic branch probabilities."""
    g = torch.Generator().manual_seed(0)
    n_draws = 40_000
    p = torch.softmax(torch.randn(1, GAMMA + 1, V, generator=g) * 1.5, -1).expand(n_draws, -1, -1)
    q = torch.softmax(torch.randn(1, GAMMA, V, generator=g) * 2, -1).expand(n_draws, -1, -1)
    drafts = torch.tensor([[0, 2]]).expand(n_draws, -1)
    lengths = torch.full((n_draws,), GAMMA)
    u = torch.rand(n_draws, GAMMA, generator=g)
    out = verify(p, q, drafts, lengths, u, torch.rand(n_draws, generator=g))
    alpha = acceptance_probs(p[:1, :GAMMA], q[:1], drafts[:1])[0]
    for n in range(GAMMA + 1):
        pr_n = float(torch.prod(alpha[:n])) * (1.0 - float(alpha[n]) if n < GAMMA else 1.0)
        bonus = bonus_distribution(p[:1], q[:1], torch.tensor([n]), torch.tensor([GAMMA]))[0]
        for b in range(V):
            want = pr_n * float(bonus[b])
            got = float(((out.num_accepted == n) & (out.bonus == b)).float().mean())
            sd = (want * (1 - want) / n_draws) ** 0.5
            assert abs(got - want) <= 5 * sd + 1e-4, (n, b, got, want)


def test_greedy_is_exact_match_with_argmax_bonus() -> None:
    p_tok = torch.tensor([[2, 0, 1, 1]])  # target argmax at each row
    p = torch.nn.functional.one_hot(p_tok, V).double()
    drafts = torch.tensor([[2, 0, 2]])  # third draft disagrees
    q = torch.nn.functional.one_hot(drafts, V).double()
    ones = torch.full((1,), 0.5)  # the bonus's uniform: any draws a one-hot row's token
    u = torch.full((1, 3), 0.999)
    out = verify(p, q, drafts, torch.tensor([3]), u, ones)
    assert out.num_accepted.tolist() == [2] and out.bonus.tolist() == [1]
    out = verify(p, q, drafts, torch.tensor([2]), u, ones)
    assert out.num_accepted.tolist() == [2] and out.bonus.tolist() == [1]  # bonus from p row 2
    out = verify(p, q, drafts, torch.tensor([0]), torch.zeros(1, 3), ones)
    assert out.num_accepted.tolist() == [0] and out.bonus.tolist() == [2]


def test_residual_falls_back_to_p_when_q_covers_p() -> None:
    p = torch.tensor([[0.5, 0.5, 0.0]])
    assert torch.equal(residual(p, p.clone()), p)
    r = residual(p, torch.tensor([[0.9, 0.1, 0.0]]))
    assert torch.allclose(r, torch.tensor([[0.0, 1.0, 0.0]]))
