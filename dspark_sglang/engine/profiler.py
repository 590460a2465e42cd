"""Step timing on the live runner: forward seconds for synthetic decode / verify batch shapes.

Used by `python -m dspark_sglang.profile` and by start-up capacity profiling; owns no policy.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import torch

from dspark_sglang.algo.capacity import Curve, ExpertParallelTerm
from dspark_sglang.engine.batch import build_batch
from dspark_sglang.engine.block_pool import BlockPool
from dspark_sglang.engine.runner import ModelRunner
from dspark_sglang.engine.sequence import Sequence, Status
from dspark_sglang.engine.speculative import build_draft_batch
from dspark_sglang.models.moe import SparseMoeBlock
from dspark_sglang.types import SamplingParams, ScheduledSeq, StepPlan


@dataclass(frozen=True, slots=True)
class GridPoint:
    kind: str  # "decode" | "verify"
    num_reqs: int  # R
    tokens_per_req: int  # 1 for decode, 1 + l for verify
    ctx: int  # tokens already in KV per request

    @property
    def num_tokens(self) -> int:  # B
        return self.num_reqs * self.tokens_per_req


def blocks_needed(points: list[GridPoint], page_size: int) -> int:
    return max(p.num_reqs * -(-(p.ctx + p.tokens_per_req) // page_size) for p in points)


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


# Untimed forwards of the first grid point before any timing: on the 2-core VM the first point
# measured 3.9 ms against 2.6 ms for the identical shape timed later in the same run (allocator,
# caches and lazy initialisation warm up on it), and a fit weighs that point like any other.
GLOBAL_WARMUP = 10


def warm_up(runner: ModelRunner, pool: BlockPool, point: GridPoint, gen: torch.Generator) -> None:
    time_point(runner, pool, point, repeats=1, warmup=GLOBAL_WARMUP, gen=gen)


def time_point(
    runner: ModelRunner,
    pool: BlockPool,
    point: GridPoint,
    repeats: int,
    warmup: int,
    gen: torch.Generator,
) -> dict[str, Any]:
    """Median / p10 / p90 wall time of runner.forward (+ logits) for one batch shape."""
    total = point.ctx + point.tokens_per_req
    seqs: dict[int, Sequence] = {}
    try:
        for i in range(point.num_reqs):
            ids = torch.randint(0, runner.arch.vocab_size, (total,), generator=gen).tolist()
            seq = Sequence(i, ids, SamplingParams(), arrival=i, num_cached=point.ctx)
            seq.status = Status.RUNNING
            pool.grow(seq.block_table, total)
            seqs[i] = seq
        plan = StepPlan(
            tuple(ScheduledSeq(i, point.ctx, point.tokens_per_req, sample=True) for i in seqs)
        )
        batch = build_batch(plan, seqs, runner.page_size, runner.device)
        # Verification scores every one of the 1+l rows, so the target computes logits for all B
        # rows; for decode this is already the case (one row per request).
        rows = torch.arange(batch.num_tokens, device=runner.device)
        batch = replace(batch, sample_rows=rows)
        times = []
        for k in range(warmup + repeats):
            _sync(runner.device)
            t0 = time.perf_counter()
            runner.forward(batch)
            _sync(runner.device)
            if k >= warmup:
                times.append(time.perf_counter() - t0)
    finally:
        for seq in seqs.values():
            pool.release(seq.block_table)
    p10, median, p90 = np.percentile(times, [10, 50, 90]).tolist()
    return {
        "kind": point.kind,
        "R": point.num_reqs,
        "B": point.num_tokens,
        "tokens_per_req": point.tokens_per_req,
        "ctx": point.ctx,
        "median_s": median,
        "p10_s": p10,
        "p90_s": p90,
        "repeats": repeats,
    }


def time_draft(
    runner: ModelRunner,
    pool: BlockPool,
    num_reqs: int,
    ctx: int,
    repeats: int,
    warmup: int,
    gen: torch.Generator,
    sampled: bool = False,
) -> float:
    """Median wall seconds of one drafting pass (block forward + sequential head) for
    `num_reqs` requests with `ctx` context tokens each: the capacity model's draft term. The
    draft context K/V holds whatever the pool's slots hold; only the time matters.

    Greedy unless `sampled` (T = 1, one generator per request, CPU only): on the CPU engine
    sampling costs 1.6-2x greedy at R = 16-64 (R = 64: 120-126 vs 71 ms), and the cheaper price
    is the one to start from. The live estimator corrects a drafter priced too low from the first
    drafting steps, which time it; one priced too high is never corrected, since lagged then
    drafts no whole batch (probes price nothing): a start-up at T = 1 priced R = 64 at 154 ms
    where a greedy drafting step added 80 ms, and lagged served c = 64 without drafting."""
    assert runner.drafter is not None
    seqs = []
    try:
        for i in range(num_reqs):
            ids = torch.randint(0, runner.arch.vocab_size, (ctx + 1,), generator=gen).tolist()
            seq = Sequence(i, ids[:-1], SamplingParams(), arrival=i, num_cached=ctx)
            seq.output_ids.append(ids[-1])
            seq.status = Status.RUNNING
            pool.grow(seq.block_table, ctx + 1)
            seqs.append(seq)
        batch = build_draft_batch(seqs, runner.page_size, runner.device)
        sampled = sampled and runner.device == "cpu"  # a CPU generator cannot drive a GPU
        temps = torch.full((num_reqs,), 1.0 if sampled else 0.0, device=runner.device)
        gens = [gen if sampled else None] * num_reqs
        times = []
        for k in range(warmup + repeats):
            _sync(runner.device)
            t0 = time.perf_counter()
            prop = runner.draft(batch, temps, gens)
            if prop.conf_logits is not None:
                prop.conf_logits.cpu()  # the engine reads them on the host to plan
            _sync(runner.device)
            if k >= warmup:
                times.append(time.perf_counter() - t0)
    finally:
        for seq in seqs:
            pool.release(seq.block_table)
    return float(np.median(times))


def startup_grid(
    max_reqs: int, gamma: int, pool_tokens: int, page_size: int, max_model_len: int
) -> list[GridPoint]:
    """The bounded (R, tokens per request, ctx) grid profiled at engine start, smallest first
    so a time budget cuts the expensive corner. Two context lengths let the fit separate the
    per-context-token cost from R and B."""
    reqs = [r for r in (1, 2, 4, 8, 16, 32, 64) if r <= max_reqs]
    per_req = sorted({1, 1 + gamma // 2, 1 + gamma})
    ctxs = [c for c in (64, 256) if c + 1 + gamma <= max_model_len] or [0]
    points = [
        GridPoint("verify", r, t, c)
        for r in reqs
        for t in per_req
        for c in ctxs
        if r * -(-(c + t) // page_size) * page_size <= pool_tokens
    ]
    return sorted(points, key=lambda p: (p.num_reqs * (p.ctx + p.tokens_per_req), p.num_tokens))


def expert_seconds(runner: ModelRunner, pairs: list[int], repeats: int) -> list[float]:
    """The EP load curve: seconds of this rank's experts in one MoE layer for n routed pairs
    spread uniformly over them (CPU time on CPU; min over repeats), times the MoE layers."""
    blocks = [m for m in runner.model.modules() if isinstance(m, SparseMoeBlock)]
    experts = blocks[0].experts
    gen = torch.Generator().manual_seed(0)
    clock = time.perf_counter if runner.device.startswith("cuda") else time.thread_time
    out = []
    for n in pairs:
        x = torch.randn(n, runner.arch.hidden_size, generator=gen).to(runner.device, runner.dtype)
        ids = torch.randint(0, experts.num_experts, (n, 1), generator=gen).to(runner.device)
        w = torch.ones(n, 1, dtype=runner.dtype, device=runner.device)
        times = []
        with torch.inference_mode():
            for _ in range(repeats + 1):
                t0 = clock()
                experts(x, ids, w)
                _sync(runner.device)
                times.append(clock() - t0)
        out.append(min(times[1:]) * len(blocks))
    return out


def ep_load_term(runner: ModelRunner, ep_size: int, max_tokens: int) -> ExpertParallelTerm:
    """The capacity model's EP term (docs/capacity.md §2) with a measured load curve up to
    max_tokens·top_k pairs per layer and uniform popularity (the live estimator refines it)."""
    arch = runner.arch
    top = max(1, max_tokens * arch.num_experts_per_tok)
    pairs = [0, *np.unique(np.geomspace(1, top, 12).astype(int)).tolist()]
    secs = expert_seconds(runner, pairs, repeats=5)
    curve = Curve(tuple(float(p) for p in pairs), tuple(np.maximum.accumulate(secs).tolist()))
    return ExpertParallelTerm(arch.num_experts, arch.num_experts_per_tok, ep_size, curve)
