"""The speculative parts of a step: draft batch, padded verification, commit lists, statistics.

Region map of a verify step for R sampling sequences: sequence r owns 1 + l_r consecutive logits
rows (anchor row, then one row per verified draft); padded to [R, g+1, V] for the vectorised
rejection sampler, where rows past l_r are never read. Non-drafting sequences (prefill finishing,
plain decode) are the l_r = 0 case of the same code path.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from dspark_sglang.algo.acceptance import verify
from dspark_sglang.engine.batch import slot_table
from dspark_sglang.engine.sampler import processed_probs, sampling_tensors
from dspark_sglang.engine.sequence import Sequence


@dataclass
class DraftBatch:
    seq_ids: list[int]
    anchors: torch.Tensor  # [N] last committed token (not yet in the target KV)
    anchor_pos: torch.Tensor  # [N]
    ctx_slots: torch.Tensor  # [N, Lmax] draft-context KV slot of positions 0..a-1
    ctx_mask: torch.Tensor  # [N, Lmax]


@dataclass
class Proposal:
    seq_ids: list[int]
    tokens: torch.Tensor  # [N, g]
    q: torch.Tensor | None  # [N, g, V] fp32; None: every row greedy (q would be one-hot)
    conf_logits: torch.Tensor | None  # [N, g]

    def row_of(self) -> dict[int, int]:
        return {sid: i for i, sid in enumerate(self.seq_ids)}


# A drafter pass per group costs about this many padded context slots of gather and attention
# (CPU: ~1.5 ms a call against ~2 us a slot at 30 rows); splitting pays beyond it.
GROUP_CALL_SLOTS = 768


def length_groups(lens: list[int], room: int, call_slots: int | None = None) -> list[list[int]]:
    """Rows of a draft batch split into passes of similar context length. One padded pass gathers
    and attends R x (max context + room) slots: one long prompt among short ones tripled that at
    30 rows (drafter 32 -> 52 ms). Rows sorted by length, cut where the slots saved exceed
    `call_slots` per extra pass (an exact partition DP over the sorted order); row indices per
    pass, longest pass first."""
    n = len(lens)
    if n <= 1:
        return [list(range(n))]
    call = GROUP_CALL_SLOTS if call_slots is None else call_slots
    order = sorted(range(n), key=lambda i: lens[i])
    srt = [lens[i] for i in order]
    best = [0] * (n + 1)  # best[j]: cost of rows order[:j]; a pass over order[i:j] costs
    cut = [0] * (n + 1)  # (j - i) * (srt[j - 1] + room) + call_slots
    for j in range(1, n + 1):
        width = srt[j - 1] + room
        c_best, i_best = best[0] + j * width, 0
        for i in range(1, j):
            c = best[i] + (j - i) * width
            if c < c_best:
                c_best, i_best = c, i
        best[j], cut[j] = c_best + call, i_best
    groups, j = [], n
    while j > 0:
        groups.append([order[k] for k in range(cut[j], j)])
        j = cut[j]
    return groups


def build_draft_batch(seqs: list[Sequence], page_size: int, device: str) -> DraftBatch:
    lens = [s.num_tokens - 1 for s in seqs]  # context = every position before the anchor
    lmax = max(lens)
    # slots page by page (a per-position list was ~1 ms at 30 rows)
    mask = torch.arange(lmax)[None, :] < torch.tensor(lens)[:, None]
    ctx_slots = slot_table([s.block_table for s in seqs], lmax, page_size).masked_fill(~mask, 0)
    return DraftBatch(
        seq_ids=[s.seq_id for s in seqs],
        anchors=torch.tensor([s.output_ids[-1] for s in seqs], device=device),
        anchor_pos=torch.tensor(lens, device=device),
        ctx_slots=ctx_slots.to(device),
        ctx_mask=mask.to(device),
    )


@dataclass
class VerifyResult:
    tokens: dict[int, list[int]]  # committed tokens per sequence: accepted drafts + bonus
    num_accepted: dict[int, int]


def verify_step(
    logits: torch.Tensor,
    seqs: list[Sequence],
    row_counts: list[int],
    drafts: dict[int, list[int]],
    proposal: Proposal | None,
    generators: list[torch.Generator | None],
) -> VerifyResult:
    """Rejection-sample every sampling sequence's rows; logits [sum(row_counts), V]."""
    if not seqs:  # a step of prefill chunks only
        return VerifyResult({}, {})
    if all(s.params.greedy for s in seqs):
        return _verify_greedy(logits, seqs, row_counts, drafts)
    return _verify_sampled(logits, seqs, row_counts, drafts, proposal, generators)


def _verify_sampled(
    logits: torch.Tensor,
    seqs: list[Sequence],
    row_counts: list[int],
    drafts: dict[int, list[int]],
    proposal: Proposal | None,
    generators: list[torch.Generator | None],
) -> VerifyResult:
    """The general rejection sampler over padded [R, g+1, V] target and [R, g, V] draft probs."""
    n, vocab = len(seqs), logits.shape[-1]
    device = logits.device
    g = max(row_counts) - 1
    temps, top_ks, top_ps = sampling_tensors([s.params for s in seqs], device)
    counts = torch.tensor(row_counts, device=device)
    probs = processed_probs(
        logits,
        temps.repeat_interleave(counts),
        top_ks.repeat_interleave(counts),
        top_ps.repeat_interleave(counts),
        needs_filter=any(s.params.top_k > 0 or s.params.top_p < 1.0 for s in seqs),
        any_greedy=any(s.params.greedy for s in seqs),
    )  # [sum, V]
    seq_of = torch.repeat_interleave(torch.arange(n, device=device), counts)
    starts = torch.cumsum(counts, 0) - counts
    off = torch.arange(probs.shape[0], device=device) - starts[seq_of]
    p = probs.new_zeros(n, g + 1, vocab)
    p[seq_of, off] = probs
    q = probs.new_zeros(n, g, vocab)
    draft_ids = torch.zeros(n, g, dtype=torch.long, device=device)
    if proposal is not None and g > 0:
        rows = proposal.row_of()
        for i, s in enumerate(seqs):
            ell = len(drafts.get(s.seq_id, ()))
            if ell:
                j = rows[s.seq_id]
                if proposal.q is not None:
                    q[i, :ell] = proposal.q[j, :ell]
                else:  # an all-greedy proposal: its q is one-hot at each draft
                    q[i, :ell].scatter_(-1, proposal.tokens[j, :ell, None], 1.0)
                draft_ids[i, :ell] = proposal.tokens[j, :ell]
    # Row i's l_i acceptance uniforms, then its bonus draw's, in one call: exactly l_i + 1 draws,
    # so a request's random stream does not depend on its batch neighbours' verify lengths.
    # Greedy rows draw none: p and q are one-hot there, and any u picks the same tokens.
    drawn = torch.full((n, g + 1), 0.5, device=device)
    for i, gen in enumerate(generators):
        if gen is not None:
            drawn[i, : row_counts[i]].uniform_(generator=gen)
    lengths = counts - 1
    bonus_u = drawn.gather(1, lengths[:, None]).squeeze(1)
    verdict = verify(p, q, draft_ids, lengths, drawn[:, :g], bonus_u)
    n_acc = verdict.num_accepted.tolist()  # the step's one host sync
    bonus = verdict.bonus.tolist()
    tokens, accepted = {}, {}
    for i, s in enumerate(seqs):
        tokens[s.seq_id] = [*drafts.get(s.seq_id, [])[: n_acc[i]], bonus[i]]
        accepted[s.seq_id] = n_acc[i]
    return VerifyResult(tokens, accepted)


def _verify_greedy(
    logits: torch.Tensor,
    seqs: list[Sequence],
    row_counts: list[int],
    drafts: dict[int, list[int]],
) -> VerifyResult:
    """Every sequence greedy: p and q are one-hot, so rejection sampling reduces to exact match
    (a draft is accepted iff it is the target's argmax there; the bonus is the argmax after the
    accepted prefix), which needs no [R, g+1, V] probability tensors. Ties break toward the
    lower id, as processed_probs does."""
    # max's indices: argmax's first maximum, 3x faster on CPU (models/drafter.py propose)
    best = logits.max(dim=-1).indices.tolist()  # the step's one host sync
    tokens, accepted = {}, {}
    start = 0
    for s, count in zip(seqs, row_counts, strict=True):
        d = drafts.get(s.seq_id, [])[: count - 1]
        n = 0
        while n < len(d) and d[n] == best[start + n]:
            n += 1
        tokens[s.seq_id] = [*d[:n], best[start + n]]
        accepted[s.seq_id] = n
        start += count
    return VerifyResult(tokens, accepted)


@dataclass(frozen=True)
class RoundRecord:
    """One verify round of one request, for offline evaluation and STS calibration."""

    seq_id: int
    verify_len: int  # l: drafts sent to the target
    num_accepted: int  # n
    committed: int  # tokens committed (n + 1, or n when an EOS ended the round)
    conf_logits: tuple[float, ...]  # raw confidence-head logits for the gamma drafts ([] if none)


@dataclass
class SpecStats:
    """Aggregated speculation counters (DeepSpec definitions, deepspec_spec.md §4.3)."""

    gamma: int
    rounds: int = 0  # decode verify rounds (the first token from prefill is not a round)
    accept_length_sum: int = 0  # sum over rounds of committed tokens (n + 1; n on an EOS cut)
    drafted: int = 0  # draft tokens produced
    verified: int = 0  # draft tokens sent to the target
    accepted: int = 0  # draft tokens accepted
    verify_tokens: int = 0  # target rows of verify sequences (sum of 1 + l)
    steps: int = 0
    # Per position k: rounds that verified k with all earlier drafts accepted, and those of
    # them that accepted k too; their ratio is the conditional acceptance of paper Fig. 2.
    at_risk: list[int] = field(default_factory=list)
    passed: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.at_risk = [0] * self.gamma
        self.passed = [0] * self.gamma

    def add_round(self, verify_len: int, num_accepted: int, committed: int) -> None:
        self.rounds += 1
        self.accept_length_sum += committed
        self.verified += verify_len
        self.accepted += num_accepted
        self.verify_tokens += 1 + verify_len
        for k in range(min(verify_len, num_accepted + 1)):
            self.at_risk[k] += 1
            self.passed[k] += k < num_accepted

    def add_skipped_rounds(self, rounds: int, committed: int) -> None:
        """`rounds` rounds that verified nothing (a skipped draft), committing `committed`
        tokens in all: add_round(0, 0, c) for each, at once."""
        self.rounds += rounds
        self.accept_length_sum += committed
        self.verify_tokens += rounds

    @property
    def tau(self) -> float:
        return self.accept_length_sum / self.rounds if self.rounds else 0.0

    def conditional_acceptance(self) -> list[float | None]:
        """P(draft k accepted | drafts < k accepted and k verified), per position."""
        return [p / r if r else None for p, r in zip(self.passed, self.at_risk, strict=True)]

    def as_dict(self) -> dict[str, object]:
        return {
            "tau": self.tau,
            "rounds": self.rounds,
            "drafted": self.drafted,
            "verified": self.verified,
            "accepted": self.accepted,
            "verify_tokens_per_step": self.verify_tokens / self.steps if self.steps else 0.0,
            "conditional_acceptance": self.conditional_acceptance(),
        }
