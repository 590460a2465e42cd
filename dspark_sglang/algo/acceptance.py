"""Lossless verification of draft blocks (speculative sampling; paper §2, deepspec_spec.md §4.2c-d).

Token i of a block is accepted with probability min(1, p_i(d_i) / q_i(d_i)); the accepted count n
is the all-ones prefix (capped at the verify length l); the bonus token comes from the residual
norm(max(0, p_n - q_n)) after a rejection, or from p_l when the whole block is accepted. Greedy
rows (one-hot p and q) reduce to exact match with the target's argmax as bonus. Pure tensor math:
randomness arrives as explicit uniforms; imports nothing from the package.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

RESIDUAL_EPS = 1e-8  # residual mass below this falls back to p (DeepSpec does the same)


@dataclass(frozen=True)
class Verdict:
    num_accepted: torch.Tensor  # [N] n_r in [0, l_r]
    bonus: torch.Tensor  # [N] token committed after the n accepted drafts


def acceptance_probs(p: torch.Tensor, q: torch.Tensor, drafts: torch.Tensor) -> torch.Tensor:
    """alpha[r, i] = min(1, p[r, i, d] / q[r, i, d]) for d = drafts[r, i].

    p: [N, g, V] target probabilities at the draft rows; q: [N, g, V] draft distributions.
    """
    d = drafts.unsqueeze(-1)
    pd = p.gather(-1, d).squeeze(-1)
    qd = q.gather(-1, d).squeeze(-1)
    # q(d) > 0 for any token actually drawn from q; the clamp only guards padding rows.
    return torch.clamp(pd / qd.clamp_min(1e-20), max=1.0)


def residual(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """norm(max(0, p - q)) row-wise, falling back to p where the residual mass vanishes."""
    r = (p - q).clamp_min(0.0)
    mass = r.sum(-1, keepdim=True)
    return torch.where(mass > RESIDUAL_EPS, r / mass.clamp_min(RESIDUAL_EPS), p)


def bonus_distribution(
    p: torch.Tensor, q: torch.Tensor, num_accepted: torch.Tensor, lengths: torch.Tensor
) -> torch.Tensor:
    """The distribution the bonus token is drawn from, per request: [N, V].

    p: [N, g+1, V] (row l_r is the target's prediction after the last draft); q: [N, g, V].
    """
    n = num_accepted
    rows = torch.arange(p.shape[0], device=p.device)
    p_n = p[rows, n]  # [N, V]
    q_pad = torch.cat([q, q.new_zeros(q.shape[0], 1, q.shape[2])], dim=1)  # row g: never used
    rejected = (n < lengths)[:, None]
    return torch.where(rejected, residual(p_n, q_pad[rows, n]), p_n)


def inverse_cdf(dist: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Row-wise draws from unnormalised distributions by inverse transform: [N, V], [N] U[0, 1)
    -> [N] int64, the first token whose cumulative mass exceeds u times the row's mass.

    One uniform per draw where the exponential race (argmax dist / E) needs V: on the CPU engine
    a 64-row bonus draw over a 4096 vocabulary, softmax included, took 0.77 ms against 2.47
    (2026-12-07, docs/engine.md "Sampling and reproducibility"). The sums are float64, so the
    draw is exact to ~1e-13 of a token's probability; a token of mass 0 is never drawn (its
    cumulative mass equals its predecessor's, and u < 1 keeps the draw below the row's total).
    """
    cdf = dist.double().cumsum(dim=-1)
    x = u.double() * cdf[:, -1]
    idx = torch.searchsorted(cdf, x[:, None], right=True).squeeze(-1)
    return idx.clamp_max(dist.shape[-1] - 1)


def verify(
    p: torch.Tensor,
    q: torch.Tensor,
    drafts: torch.Tensor,
    lengths: torch.Tensor,
    uniforms: torch.Tensor,
    bonus_uniforms: torch.Tensor,
) -> Verdict:
    """Rejection-sample every request's block in one shot (no host sync).

    p: [N, g+1, V] processed target probs for rows [anchor, d_1..d_g] (rows past l_r unused);
    q: [N, g, V]; drafts: [N, g]; lengths: [N] verify lengths l_r in [0, g];
    uniforms: [N, g] U(0,1) for the acceptance tests; bonus_uniforms: [N] U[0, 1) for the
    bonus draw (inverse_cdf).
    """
    g = drafts.shape[1]
    if g == 0:
        n = torch.zeros_like(lengths)
    else:
        alpha = acceptance_probs(p[:, :g], q, drafts)
        ok = uniforms < alpha
        ok &= torch.arange(g, device=ok.device)[None, :] < lengths[:, None]
        n = ok.long().cumprod(dim=1).sum(dim=1)  # length of the all-accepted prefix
    dist = bonus_distribution(p, q, n, lengths)
    return Verdict(num_accepted=n, bonus=inverse_cdf(dist, bonus_uniforms))
