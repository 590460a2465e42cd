"""Speculative decoding in the reference engine: greedy identity, distribution, KV hygiene."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import torch

from dspark_sglang import LLM, SamplingParams
from dspark_sglang.engine import engine as engine_mod
from dspark_sglang.engine.sequence import Sequence
from dspark_sglang.engine.speculative import (
    DraftBatch,
    Proposal,
    _verify_greedy,
    _verify_sampled,
    verify_step,
)
from dspark_sglang.types import StepRecord
from tests.conftest import VOCAB, hf_reference, write_drafter, write_hf_model

GREEDY = SamplingParams(temperature=0.0, max_tokens=24)
MODES = ["verify-all", "fixed:2", "mtp1", "threshold:0.3", "sync", "lagged"]


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("pair")
    target = write_hf_model(root / "target", moe=True)
    return target, write_drafter(root / "drafter", target, block_size=5)


def prompts(n: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [
        torch.randint(
            0, VOCAB, (int(torch.randint(2, 15, (1,), generator=g)),), generator=g
        ).tolist()
        for _ in range(n)
    ]


class ContinuationDrafter:
    """Proposes the known greedy continuation, corrupting each position with probability `bad`,
    so verification sees long accepted prefixes and realistic rejections."""

    def __init__(
        self,
        llm: LLM,
        want: dict[tuple[int, ...], list[int]],
        bad: float,
        conf_logit: float | None = None,
    ) -> None:
        self.llm, self.want, self.bad = llm, want, bad
        self.conf_logit = conf_logit  # a constant confidence instead of a calibrated one
        self.rng = np.random.default_rng(0)

    def __call__(
        self, batch: DraftBatch, temps: torch.Tensor, gens: list[torch.Generator | None]
    ) -> Proposal:
        g = self.llm.gamma
        toks = torch.zeros(len(batch.seq_ids), g, dtype=torch.long)
        # a calibrated confidence head: confidence-driven schedules (sync, lagged) must verify the
        # good prefixes whatever capacity curve the start-up profile measured on a noisy host
        conf = torch.zeros(len(batch.seq_ids), g)
        for i, sid in enumerate(batch.seq_ids):
            seq = self.llm.scheduler.seqs[sid]
            cont = self.want[tuple(seq.prompt_ids)][len(seq.output_ids) :] + [0] * g
            for k in range(g):
                ok = self.rng.random() > self.bad
                toks[i, k] = cont[k] if ok else (cont[k] + 1) % VOCAB
                conf[i, k] = (6.0 if ok else -6.0) if self.conf_logit is None else self.conf_logit
        q = torch.nn.functional.one_hot(toks, VOCAB).float()
        return Proposal(batch.seq_ids, toks, q, conf)


def test_greedy_exact_match_equals_the_rejection_sampler() -> None:
    """The all-greedy shortcut is the general sampler's answer: accepted prefix and bonus alike,
    on logits with ties (lowest id wins), drafts that match partly, wholly or not at all, rows
    without drafts, and a proposal with and without q."""
    rng = np.random.default_rng(0)
    vocab, g = 12, 4
    for trial in range(200):
        r = int(rng.integers(1, 6))
        lens = rng.integers(0, g + 1, r)
        counts = [int(x) + 1 for x in lens]
        # few distinct values: ties in most rows
        logits = torch.tensor(rng.integers(0, 3, (sum(counts), vocab)), dtype=torch.float32)
        best = logits.argmax(-1).tolist()
        seqs = [Sequence(i, [1], SamplingParams(temperature=0.0), i) for i in range(r)]
        toks = torch.zeros(r, g, dtype=torch.long)
        drafts, start = {}, 0
        for i, ell in enumerate(lens):
            agree = int(rng.integers(0, ell + 1))  # a prefix the target agrees with
            d = [best[start + k] if k < agree else int(rng.integers(0, vocab)) for k in range(ell)]
            toks[i, :ell] = torch.tensor(d, dtype=torch.long)
            if ell:
                drafts[i] = d
            start += counts[i]
        q = torch.nn.functional.one_hot(toks, vocab).float() if trial % 2 else None
        prop = Proposal(list(range(r)), toks, q, None)
        gens: list[torch.Generator | None] = [None] * r
        fast = _verify_greedy(logits, seqs, counts, drafts)
        slow = _verify_sampled(logits, seqs, counts, drafts, prop, gens)
        assert fast == slow, (trial, fast, slow)
        assert verify_step(logits, seqs, counts, drafts, prop, gens) == fast


@pytest.mark.parametrize("mode", MODES)
def test_greedy_identity_with_the_real_drafter(pair: tuple[Path, Path], mode: str) -> None:
    target, drafter = pair
    ps = prompts(7)
    base = LLM(str(target), num_blocks=128, page_size=4).generate(ps, GREEDY)
    spec = LLM(
        str(target),
        draft_model=str(drafter),
        schedule_mode=mode,
        num_blocks=128,
        page_size=4,
        startup_profile_seconds=1.0,
    )
    outs = spec.generate(ps, GREEDY)
    assert [o.output_ids for o in outs] == [o.output_ids for o in base]
    assert spec.stats.rounds > 0 and spec.pool.num_free_blocks == spec.pool.num_blocks


@pytest.mark.parametrize("num_blocks", [256, 14])  # 14 blocks x 4 tokens forces preemption
def test_greedy_identity_with_long_accepted_prefixes(
    pair: tuple[Path, Path], num_blocks: int
) -> None:
    target, drafter = pair
    ps = prompts(8, seed=3)
    base = LLM(str(target), num_blocks=256, page_size=4).generate(ps, GREEDY)
    want = {tuple(p): o.output_ids for p, o in zip(ps, base, strict=True)}
    spec = LLM(
        str(target),
        draft_model=str(drafter),
        num_blocks=num_blocks,
        page_size=4,
        chunked_prefill_size=6,
    )
    spec.runner.draft = ContinuationDrafter(spec, want, bad=0.25)
    outs = spec.generate(ps, GREEDY)
    assert [o.output_ids for o in outs] == [o.output_ids for o in base]
    # Long prefixes really were accepted and committed (expected ~3.3 at 25% corruption; less
    # when a short KV pool cuts verification down before preempting).
    assert spec.stats.tau > (2.5 if num_blocks == 256 else 1.5)
    assert spec.pool.num_free_blocks == spec.pool.num_blocks
    if num_blocks == 14:
        assert sum(o.num_preemptions for o in outs) > 0


def test_stats_follow_deepspec_definitions(pair: tuple[Path, Path]) -> None:
    target, drafter = pair
    ps = prompts(4, seed=5)
    base = LLM(str(target)).generate(ps, GREEDY)
    want = {tuple(p): o.output_ids for p, o in zip(ps, base, strict=True)}
    spec = LLM(str(target), draft_model=str(drafter))
    spec.runner.draft = ContinuationDrafter(spec, want, bad=0.0)  # everything is accepted
    outs = spec.generate(ps, SamplingParams(temperature=0.0, max_tokens=19))
    # 19 tokens = 1 from prefill + 3 rounds of 6 (5 drafts + bonus): tau = 6 per request.
    assert [o.spec_rounds for o in outs] == [3] * 4
    assert all(o.accept_length == 6.0 for o in outs)
    assert spec.stats.tau == 6.0
    assert spec.stats.conditional_acceptance() == [1.0] * 5


def test_draft_context_equals_full_recompute(pair: tuple[Path, Path]) -> None:
    """After speculative generation (with rejections), the drafter's context K/V for every
    position before the anchor equals the projection of a full-recompute target forward."""
    target, drafter = pair
    # float32 drafter: the check is of bookkeeping, at fp32 tolerance
    spec = LLM(
        str(target), draft_model=str(drafter), num_blocks=64, page_size=4, draft_dtype="float32"
    )
    sid = spec.add_request([5, 9, 13, 2], SamplingParams(temperature=1.0, seed=3, max_tokens=40))
    for _ in range(6):
        spec.step()
    spec._flush_draft_context()  # what the next draft sees: the last step's rows are deferred
    seq = spec.scheduler.seqs[sid]
    tokens = seq.tokens(0, seq.num_tokens - 1)  # positions before the anchor
    hf = hf_reference(target)
    with torch.no_grad():
        hs = hf(input_ids=torch.tensor([tokens]), output_hidden_states=True).hidden_states
        taps = torch.cat([hs[i + 1][0] for i in spec.runner.drafter.cfg.target_layer_ids], -1)
        c = spec.runner.drafter.project_context(taps)
        want = spec.runner.drafter.context_kv(c, torch.arange(len(tokens)))
    page = spec.runner.page_size
    slots = [seq.block_table[p // page] * page + p % page for p in range(len(tokens))]
    for (k_cache, v_cache), (k, v) in zip(spec.runner.draft_kv, want, strict=True):
        torch.testing.assert_close(k_cache[slots], k, atol=2e-4, rtol=1e-4)
        torch.testing.assert_close(v_cache[slots], v, atol=2e-4, rtol=1e-4)
    assert spec.stats.rounds >= 5


def _context_matches_recompute(spec: LLM, hf: torch.nn.Module, seq: Sequence) -> None:
    """The drafter's context K/V at every position before seq's anchor equals the projection
    of a full-recompute target forward of those tokens."""
    tokens = seq.tokens(0, seq.num_tokens - 1)
    drafter = spec.runner.drafter
    with torch.no_grad():
        hs = hf(input_ids=torch.tensor([tokens]), output_hidden_states=True).hidden_states
        taps = torch.cat([hs[i + 1][0] for i in drafter.cfg.target_layer_ids], -1)
        want = drafter.context_kv(drafter.project_context(taps), torch.arange(len(tokens)))
    page = spec.runner.page_size
    slots = [seq.block_table[p // page] * page + p % page for p in range(len(tokens))]
    for (k_cache, v_cache), (k, v) in zip(spec.runner.draft_kv, want, strict=True):
        torch.testing.assert_close(k_cache[slots], k, atol=2e-4, rtol=1e-4)
        torch.testing.assert_close(v_cache[slots], v, atol=2e-4, rtol=1e-4)


def check_context_before_drafts(spec: LLM, hf: torch.nn.Module) -> list[int]:
    """Before every drafter call, each drafted request's context equals a full recompute's;
    -> the list the checked request ids are appended to."""
    checked: list[int] = []
    inner = spec.runner.draft

    def check(batch, temps, gens):  # type: ignore[no-untyped-def]
        for sid in batch.seq_ids:
            _context_matches_recompute(spec, hf, spec.scheduler.seqs[sid])
            checked.append(sid)
        return inner(batch, temps, gens)

    spec.runner.draft = check  # type: ignore[method-assign]
    return checked


@pytest.mark.parametrize("cap_rows", [None, 6])
def test_deferred_context_of_requests_drafted_a_few_at_a_time_equals_full_recompute(
    pair: tuple[Path, Path], tmp_path: Path, monkeypatch, cap_rows: int | None
) -> None:
    """Stretches of plain lagged steps, steps that draft one request of several, requests that
    finish and free their blocks for others, handoffs adopted into reused blocks: whenever the
    drafter runs on a request, that request's context is exactly a full recompute's (rows of
    finished requests and rows a handoff supersedes are dropped, the rest of the batch's rows
    wait). With a cap of a few rows the queue is compacted, and its live rows projected, every
    few steps."""
    if cap_rows is not None:
        monkeypatch.setattr(engine_mod, "_MIN_PENDING_CTX_ROWS", cap_rows)
        monkeypatch.setattr(engine_mod, "_MAX_PENDING_CTX_BYTES", 0)
    target, drafter = pair
    spec = lagged_on_fixed_curve(pair, tmp_path, 0.0, num_blocks=20, draft_dtype="float32")
    prefill = LLM(str(target), draft_model=str(drafter), page_size=4, draft_dtype="float32")
    hf = hf_reference(target)
    compactions = [0]
    real_compact = spec._pending.compact

    def counted(live):  # type: ignore[no-untyped-def]
        compactions[0] += 1
        real_compact(live)

    spec._pending.compact = counted  # type: ignore[method-assign]
    n = [0]
    assert spec.planner is not None
    spec.planner.budget = lambda ids, max_len, ctx: 2 if n[0] % 4 == 3 else 0  # type: ignore
    spec.planner.should_probe = lambda: False  # type: ignore[method-assign]
    spec.planner.draft_rows = lambda ids, k, max_len: np.array([n[0] % len(ids)])  # type: ignore
    checked = check_context_before_drafts(spec, hf)
    ps = prompts(9, seed=21)
    for i, p in enumerate(ps[:4]):
        spec.add_request(p, SamplingParams(temperature=0.0, max_tokens=6 + 5 * i))
    handoffs = []
    for p in ps[4:]:
        prefill.add_request(p, SamplingParams(temperature=0.0, max_tokens=14), prefill_only=True)
    while prefill.has_unfinished():
        handoffs += [o.handoff for o in prefill.step() if o.finished]
    adopted = 0
    while spec.has_unfinished() or handoffs:
        if handoffs and n[0] % 5 == 4 and spec.try_adopt(handoffs[0]) is not None:
            handoffs.pop(0)
            adopted += 1
        if spec.has_unfinished():
            spec.step()
        n[0] += 1
        # what each request has queued (the resume charge) is what the queue holds for it
        live = [b for s in spec.scheduler.seqs.values() for b in s.block_table]
        real_compact(live)
        queued = {sid: st.queued_ctx for sid, st in spec._state.items()}
        # (a preempted request holds no blocks: its rows went with them, and it starts over)
        holding = [sid for sid, q in spec.scheduler.seqs.items() if q.block_table]
        assert spec._pending.rows == sum(queued[sid] for sid in holding)
    assert adopted == 5 and len(set(checked)) >= 6
    assert (compactions[0] > 0) == (cap_rows is not None)
    # blocks were handed out again while rows of their last owner were still pending
    assert spec.pool.num_free_blocks == spec.pool.num_blocks


def test_an_adopted_prompts_drafter_context_waits_until_the_drafter_runs_on_it(
    pair: tuple[Path, Path], tmp_path: Path
) -> None:
    """A decode worker queues a handoff's C instead of writing the drafter's K/V of every
    prompt row at adoption (1.2 ms a 400-token prompt on the CPU engine): requests that finish
    without drafting never pay it, and one that drafts gets it before its first draft."""
    target, drafter = pair
    spec = lagged_on_fixed_curve(pair, tmp_path, 0.0, draft_dtype="float32")
    prefill = LLM(str(target), draft_model=str(drafter), page_size=4, draft_dtype="float32")
    written: list[int] = []
    inner_write = spec.runner.write_draft_context

    def count(c, pos, slot_ids):  # type: ignore[no-untyped-def]
        written.append(int(slot_ids.shape[0]))
        inner_write(c, pos, slot_ids)

    spec.runner.write_draft_context = count  # type: ignore[method-assign]
    assert spec.planner is not None
    drafting = [False]
    spec.planner.budget = lambda ids, max_len, ctx: 2 if drafting[0] else 0  # type: ignore
    spec.planner.should_probe = lambda: False  # type: ignore[method-assign]
    ps = prompts(4, seed=5)
    for p in ps:
        prefill.add_request(p, SamplingParams(temperature=0.0, max_tokens=6), prefill_only=True)
    handoffs = []
    while prefill.has_unfinished():
        handoffs += [o.handoff for o in prefill.step() if o.finished]
    sids = [spec.try_adopt(h) for h in handoffs[:2]]
    assert None not in sids and not written
    assert spec._pending.rows == sum(len(h.prompt_ids) for h in handoffs[:2])
    assert [spec._state[s].queued_ctx for s in sids] == [len(h.prompt_ids) for h in handoffs[:2]]
    while spec.has_unfinished():
        spec.step()
    assert not written  # they finished on plain steps: no prompt row was ever projected
    checked = check_context_before_drafts(spec, hf_reference(target))
    drafting[0] = True
    sids = [spec.try_adopt(h) for h in handoffs[2:]]  # into the blocks the first two freed
    assert None not in sids and not written
    while spec.has_unfinished():
        spec.step()
    assert set(checked) == set(sids)
    assert sum(written) >= sum(len(h.prompt_ids) for h in handoffs[2:])


class BigramDrafter:
    """q(x | prev) = softmax(W[prev] / t): a cheap drafter with a known distribution."""

    def __init__(self, llm: LLM, vocab: int, sample_t: float = 1.0) -> None:
        g = torch.Generator().manual_seed(7)
        self.llm, self.w = llm, torch.randn(vocab, vocab, generator=g) * 1.5
        self.conf_w = torch.randn(vocab, generator=g) * 2.0
        self.sample_t = sample_t  # != 1 makes q lie about what was sampled (negative control)

    def __call__(
        self, batch: DraftBatch, temps: torch.Tensor, gens: list[torch.Generator | None]
    ) -> Proposal:
        n, g = len(batch.seq_ids), self.llm.gamma
        toks = torch.zeros(n, g, dtype=torch.long)
        q = torch.zeros(n, g, self.w.shape[0])
        for i in range(n):
            prev = int(batch.anchors[i])
            for k in range(g):
                q[i, k] = torch.softmax(self.w[prev], -1)
                draw = torch.softmax(self.w[prev] / self.sample_t, -1)
                prev = int(torch.multinomial(draw, 1, generator=gens[i]))
                toks[i, k] = prev
        # Confidence of draft k reads the token at k-1, like the real head: schedulers that
        # peek at a draft's own value would show up as bias here.
        prev = torch.cat([batch.anchors[:, None], toks[:, :-1]], dim=1)
        return Proposal(batch.seq_ids, toks, q, self.conf_w[prev])


def write_capacity_profile(path: Path, gamma: int, draft_s: float | None = None) -> Path:
    """A GPU-like curve (a flat base plus a small per-token cost): extra drafts pay only when
    they are likely to be accepted, so sync and lagged verify some drafts and skip others.
    `draft_s` adds a flat drafter cost per step."""
    from dspark_sglang.algo.capacity import CapacityModel, Curve, TableModel
    from dspark_sglang.capacity_profile import (
        EngineProfile,
        Parallelism,
        Provenance,
        save_profile,
    )

    buckets = tuple(range(16, 4097, 16))
    draft = None if draft_s is None else Curve((1.0,), (draft_s,))
    model = CapacityModel(
        TableModel(buckets, tuple(0.010 + 1e-5 * b for b in buckets)), draft=draft
    )
    prov = Provenance("analytic", "tests/unit/engine/test_speculative.py", "2026-11-30", "test")
    profile = EngineProfile(
        "test", "reference", "test", "random", "random", Parallelism(), gamma, buckets, model, prov
    )
    save_profile(profile, path)
    return path


def lagged_on_fixed_curve(
    pair: tuple[Path, Path], tmp_path: Path, draft_s: float, num_blocks: int = 128, **kw: object
) -> LLM:
    """Lagged on a fixed capacity curve (live refit off) whose drafter costs `draft_s` seconds
    (a forward costs about 10 ms)."""
    target, drafter = pair
    return LLM(
        str(target),
        draft_model=str(drafter),
        schedule_mode="lagged",
        live_capacity=False,
        capacity_profile=str(write_capacity_profile(tmp_path / "cap.yaml", 5, draft_s)),
        num_blocks=num_blocks,
        page_size=4,
        **kw,
    )


def watch_drafts(spec: LLM) -> tuple[list[list[int]], list[StepRecord]]:
    """(request ids of each drafter call, every step's record), filled as `spec` runs."""
    drafted: list[list[int]] = []
    recs: list[StepRecord] = []
    inner = spec.runner.draft

    def spy(batch, temps, gens):  # type: ignore[no-untyped-def]
        drafted.append(list(batch.seq_ids))
        return inner(batch, temps, gens)

    spec.runner.draft = spy  # type: ignore[method-assign]
    spec.on_step = recs.append
    return drafted, recs


def test_fixed_zero_never_runs_the_drafter(pair: tuple[Path, Path]) -> None:
    """`fixed:0` verifies no draft, so it drafts none: plain decoding with the drafter loaded
    (its context kept as in any speculative deployment), the same tokens as no-spec, and no
    drafter call or drafter time in any step. `fixed:1` on the same engine does draft."""
    ps = prompts(5, seed=4)
    base = LLM(str(pair[0]), num_blocks=128, page_size=4).generate(ps, GREEDY)
    for mode, drafts in (("fixed:0", False), ("fixed:1", True)):
        spec = LLM(
            str(pair[0]), draft_model=str(pair[1]), schedule_mode=mode, num_blocks=128, page_size=4
        )
        drafted, recs = watch_drafts(spec)
        outs = spec.generate(ps, GREEDY)
        assert [o.output_ids for o in outs] == [o.output_ids for o in base]
        assert bool(drafted) == drafts
        assert any(r.draft_seconds > 0.0 for r in recs) == drafts
        assert (spec.stats.drafted > 0) == drafts
        assert spec.pool.num_free_blocks == spec.pool.num_blocks


@pytest.mark.parametrize("draft_s", [1.0, 0.0])
def test_lagged_skips_the_drafter_when_drafting_cannot_pay(
    pair: tuple[Path, Path], tmp_path: Path, draft_s: float
) -> None:
    """A drafter that costs 100 forwards per step never pays: lagged K is 0 every step and the
    drafter runs only on the sparse probing steps (plain decode, same tokens). A free drafter is
    used as before."""

    ps = prompts(4, seed=3)
    base = LLM(str(pair[0]), num_blocks=128, page_size=4).generate(ps, GREEDY)
    spec = lagged_on_fixed_curve(pair, tmp_path, draft_s)
    recs: list[StepRecord] = []
    spec.on_step = recs.append
    outs = spec.generate(ps, GREEDY)
    assert [o.output_ids for o in outs] == [o.output_ids for o in base]
    planned = [r for r in recs if r.verify_budget_k >= 0]
    assert planned and spec.stats.rounds > 0
    if draft_s > 0:
        probes = [r for r in planned if r.draft_seconds > 0.0]
        skipped = [r for r in planned if r.draft_seconds == 0.0]
        assert 0 < len(probes) <= len(planned) // 8  # probes back off from every 8th step
        assert all(r.verify_budget_k == 0 for r in skipped)
        assert all(abs(r.predicted_seconds - 0.010 - 1e-5 * 16) < 1e-9 for r in skipped)
        # probes verify their drafts (acceptance evidence); no other step verifies anything
        assert spec.stats.verified == sum(r.verify_budget_k for r in probes) > 0
        # drafting every row (R <= PROBE_ROWS) still makes it a probe, after plain steps
        assert all(r.probe and r.draft_resumed for r in probes)
    else:
        assert spec.stats.drafted > 0 and spec.stats.verified > 0
        assert any(r.draft_seconds > 0.0 for r in planned)
    spec.close()


def test_lagged_probe_drafts_a_few_rows_in_rotation(
    pair: tuple[Path, Path], tmp_path: Path
) -> None:
    """With more requests than PROBE_ROWS, a probe drafts (and verifies) PROBE_ROWS of them,
    a different few each time, and the rest decode plainly in the same step."""
    from dspark_sglang.engine.planner import PROBE_ROWS

    ps = prompts(3 * PROBE_ROWS, seed=4)
    long = SamplingParams(temperature=0.0, max_tokens=40)  # probes at steps 8 and 24
    base = LLM(str(pair[0]), num_blocks=512, page_size=4).generate(ps, long)
    spec = lagged_on_fixed_curve(pair, tmp_path, 1.0, num_blocks=512)
    drafted, recs = watch_drafts(spec)
    outs = spec.generate(ps, long)
    assert [o.output_ids for o in outs] == [o.output_ids for o in base]
    assert drafted and all(len(d) <= PROBE_ROWS for d in drafted)
    # each record names the rows its drafter ran on (the capacity model prices them, not R)
    probes = [r for r in recs if r.draft_seconds > 0.0]
    assert [r.num_draft_reqs for r in probes] == [len(d) for d in drafted]
    assert any(r.num_draft_reqs < r.num_decode_reqs for r in probes)
    assert all(r.num_draft_reqs == 0 for r in recs if r.draft_seconds == 0.0)
    # every drafting step here is a probe (K stays 0 on this curve); each follows plain steps
    assert all(r.probe == (r.num_draft_reqs > 0) for r in recs)
    assert all(r.draft_resumed for r in recs if r.probe and r.step > 1)
    assert len({sid for d in drafted for sid in d}) > PROBE_ROWS  # the probes rotate
    assert spec.stats.verified > 0
    spec.close()


def test_selective_lagged_drafts_only_the_rows_the_planner_names(
    pair: tuple[Path, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A K > 0 step drafts the rows VerifyPlanner.draft_rows names (here: every other row) and
    verifies only them, the rest decoding plainly in the same step: same greedy tokens, records
    that name the drafted rows, and no such step counted as a probe."""
    from dspark_sglang.engine.planner import VerifyPlanner

    def every_other(self, ids, k, max_len):  # type: ignore[no-untyped-def]
        return np.arange(0, len(ids), 2) if k > 0 and len(ids) > 1 else None

    monkeypatch.setattr(VerifyPlanner, "draft_rows", every_other)
    ps = prompts(6, seed=8)
    base = LLM(str(pair[0]), num_blocks=256, page_size=4).generate(ps, GREEDY)
    spec = lagged_on_fixed_curve(pair, tmp_path, 0.0, num_blocks=256)  # a free drafter: K > 0
    drafted, recs = watch_drafts(spec)
    outs = spec.generate(ps, GREEDY)
    assert [o.output_ids for o in outs] == [o.output_ids for o in base]
    ran = [r for r in recs if r.draft_seconds > 0.0]
    assert [r.num_draft_reqs for r in ran] == [len(d) for d in drafted]
    subset = [r for r in ran if r.num_decode_reqs > 1 and r.num_draft_reqs < r.num_decode_reqs]
    assert subset and not any(r.probe for r in subset)
    assert all(r.num_draft_reqs == -(-r.num_decode_reqs // 2) for r in subset)
    assert all(0 < r.verify_budget_k <= r.num_draft_reqs * spec.gamma for r in subset)
    spec.close()


@pytest.mark.parametrize("scenario", ["never-pays", "probes-out", "free-drafter"])
def test_lagged_k_memo_changes_no_decision(
    pair: tuple[Path, Path], tmp_path: Path, scenario: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The planner reuses the last K while nothing it depends on changed (same lagged snapshot,
    prior, SPS curve, requests and caps). Run for run, every step's K and every token are those
    of a planner that recomputes K each step (including when a probe moves K off 0), and the
    memo does skip most recomputations in K = 0 stretches. A search every step
    (`replan_every` = 1): the pins (K = 0 ones included) skip searches the memo would see. The
    inputs K learns from wall-clock step times (the step-kind bias, the resume charge's
    projection price, the resumed drafter's excess) are off: with them the two runs see
    different inputs whatever the memo does (a clean-clone run, 2026-12-06: K 0 against 4 at
    one free-drafter step)."""
    from dspark_sglang.engine.planner import VerifyPlanner

    untimed = {"replan_every": 1, "step_bias": False, "resume_charge": False}
    monkeypatch.setattr(VerifyPlanner, "_learn_resume", lambda self, rows, seconds: None)

    target, _ = pair
    ps = prompts(3, seed=5)
    ref = LLM(str(target), num_blocks=128, page_size=4).generate(ps, GREEDY)
    want = {tuple(p): o.output_ids for p, o in zip(ps, ref, strict=True)}
    runs = []
    for memo in (True, False):
        hits = [0]
        inner = VerifyPlanner._memo_k

        def counted(self, key, inner=inner, hits=hits, memo=memo):  # type: ignore[no-untyped-def]
            k = inner(self, key) if memo else None
            hits[0] += k is not None
            return k

        monkeypatch.setattr(VerifyPlanner, "_memo_k", counted)
        if scenario == "probes-out":  # K = 0 until probes see the drafter is always right
            spec = lagged_with_costly_drafter(pair, tmp_path, **untimed)
            spec.runner.draft = ContinuationDrafter(spec, want, bad=0.0)  # type: ignore[method-assign]
        else:
            draft_s = 1.0 if scenario == "never-pays" else 0.0
            spec = lagged_on_fixed_curve(pair, tmp_path, draft_s, max_running_requests=3, **untimed)
        recs: list[StepRecord] = []
        spec.on_step = recs.append
        outs = spec.generate(ps, GREEDY)
        spec.close()
        runs.append(([o.output_ids for o in outs], [r.verify_budget_k for r in recs], hits[0]))
    (out_m, k_m, hits_m), (out_r, k_r, hits_r) = runs
    assert out_m == out_r == [o.output_ids for o in ref]
    assert k_m == k_r
    assert hits_r == 0
    if scenario == "probes-out":
        assert 0 in k_m and max(k_m) > 0
    if scenario != "free-drafter":  # K = 0 stretches (a free drafter drafts anew every step)
        assert hits_m > len(k_m) // 4


@pytest.mark.parametrize("scenario", ["probes-out", "free-drafter"])
def test_lagged_overlap_thread_plans_the_k_inline_planning_would(
    pair: tuple[Path, Path], tmp_path: Path, scenario: str
) -> None:
    """Overlap (the next K planned on a worker thread during the forward) is off by default on
    the CPU and on for CUDA. Forced on here it runs the thread (only its first step has no plan
    from the step before) and stays lossless; its K may differ from inline planning's only in
    that the thread cannot see the acceptance of the step it overlaps. The default on the CPU
    plans exactly as overlap off does."""

    target, _ = pair
    ps = prompts(3, seed=5)
    ref = LLM(str(target), num_blocks=128, page_size=4).generate(ps, GREEDY)
    want = {tuple(p): o.output_ids for p, o in zip(ps, ref, strict=True)}
    runs = []
    for overlap in (None, True, False):
        kw = {} if overlap is None else {"overlap": overlap}
        if scenario == "probes-out":  # K = 0 until probes see the drafter is always right
            spec = lagged_on_fixed_curve(pair, tmp_path, 0.02, max_running_requests=1, **kw)
            spec.runner.draft = ContinuationDrafter(spec, want, bad=0.0)  # type: ignore[method-assign]
        else:
            spec = lagged_on_fixed_curve(pair, tmp_path, 0.0, max_running_requests=3, **kw)
        assert spec.planner is not None
        assert (spec.planner._worker is not None) == bool(overlap)  # None on CPU: off
        recs: list[StepRecord] = []
        spec.on_step = recs.append
        outs = spec.generate(ps, GREEDY)
        fallbacks = dict(spec.planner.fallbacks)
        spec.close()
        runs.append(([o.output_ids for o in outs], [r.verify_budget_k for r in recs], fallbacks))
    (out_d, k_d, fb_d), (out_on, k_on, fb_on), (out_off, k_off, fb_off) = runs
    assert out_d == out_on == out_off == [o.output_ids for o in ref]
    assert k_d == k_off and max(k_on) > 0 and max(k_off) > 0
    if scenario == "probes-out":
        assert 0 in k_on and 0 in k_off
    # only the thread's first step has no plan from the step before it
    assert fb_on == {"no_overlap_plan": 1} and fb_off == fb_d == {}


def test_lagged_pinned_at_verify_all_is_lossless_and_searches_every_fourth_step(
    pair: tuple[Path, Path], tmp_path: Path
) -> None:
    """A drafter that is always right on a cheap curve: every K search verifies every draft, so
    the default pins (engine/planner.py PIN_PLANS): steps marked `pinned` verify every draft,
    no more than three in a row, and the outputs are greedy's, as with a search every step."""
    target, _ = pair
    ps = prompts(2, seed=9)
    long = SamplingParams(temperature=0.0, max_tokens=120)  # 20 always-right steps a request
    ref = LLM(str(target), num_blocks=128, page_size=4).generate(ps, long)
    want = {tuple(p): o.output_ids for p, o in zip(ps, ref, strict=True)}
    runs = {}
    for every in (1, 4):
        spec = lagged_on_fixed_curve(
            pair, tmp_path, 0.0, max_running_requests=1, replan_every=every
        )
        spec.runner.draft = ContinuationDrafter(spec, want, bad=0.0)  # type: ignore[method-assign]
        recs: list[StepRecord] = []
        spec.on_step = recs.append
        outs = spec.generate(ps, long)
        assert spec.planner is not None
        runs[every] = ([o.output_ids for o in outs], recs, spec.planner.pinned_steps)
        spec.close()
    assert runs[1][0] == runs[4][0] == [o.output_ids for o in ref]
    assert runs[1][2] == 0 and not any(r.pinned for r in runs[1][1])
    pinned = [r for r in runs[4][1] if r.pinned]
    assert len(pinned) == runs[4][2] >= 10
    gamma = max(r.verify_budget_k for r in runs[1][1])
    for r in pinned:  # every draft verified (a request's last steps cap it; none here)
        assert r.verify_budget_k == gamma and r.num_tokens == 1 + gamma
    flags = "".join("p" if r.pinned else "." for r in runs[4][1])
    assert "pppp" not in flags


def test_lagged_records_the_tokens_each_k_was_planned_on(
    pair: tuple[Path, Path], tmp_path: Path
) -> None:
    """A lagged step with K > 0 records the tokens its K was planned on: the R rows plus at most
    K drafts' survival; plain steps and probes plan nothing (nan), and neither do other modes.
    With a drafter that is always right, every planned draft is accepted, so the step emits at
    least what it was planned on."""
    target, drafter = pair
    ps = prompts(3, seed=7)
    ref = LLM(str(target), num_blocks=128, page_size=4).generate(ps, GREEDY)
    want = {tuple(p): o.output_ids for p, o in zip(ps, ref, strict=True)}
    spec = lagged_on_fixed_curve(pair, tmp_path, 0.0, max_running_requests=3)
    spec.runner.draft = ContinuationDrafter(spec, want, bad=0.0)  # type: ignore[method-assign]
    recs: list[StepRecord] = []
    spec.on_step = recs.append
    spec.generate(ps, GREEDY)
    spec.close()
    decode = [r for r in recs if r.num_prefill_tokens == 0]
    planned = [r for r in decode if math.isfinite(r.planned_tokens)]
    assert planned, "no lagged step with K > 0"
    for r in decode:  # K is planned inline on the CPU, always for the step's own batch
        assert math.isfinite(r.planned_tokens) == (r.verify_budget_k > 0 and not r.probe)
    for r in planned:
        assert r.num_reqs <= r.planned_tokens <= r.num_reqs + r.verify_budget_k + 1e-9
        assert r.num_decode_reqs + r.num_accepted >= r.planned_tokens - 1e-9
    fixed = LLM(str(target), draft_model=str(drafter), schedule_mode="fixed:2", num_blocks=128)
    frecs: list[StepRecord] = []
    fixed.on_step = frecs.append
    fixed.generate(ps[:1], GREEDY)
    fixed.close()
    assert all(math.isnan(r.planned_tokens) for r in frecs)


def lagged_with_costly_drafter(pair: tuple[Path, Path], tmp_path: Path, **kw: object) -> LLM:
    """Lagged, one request at a time, a fixed curve (live refit off) whose drafter costs two
    forwards: drafting pays only when most drafts are accepted."""
    return lagged_on_fixed_curve(pair, tmp_path, 0.02, max_running_requests=1, **kw)


def test_lagged_probes_its_way_out_of_a_pessimistic_prior(
    pair: tuple[Path, Path], tmp_path: Path
) -> None:
    """The fresh-request prior (acceptance 0.5) says a drafter costing two forwards does not pay,
    so lagged starts at K = 0 and skips the drafter; its probes see confidences near 1 (and
    they are right: the drafter proposes the target's own continuation), and K follows."""
    target, _ = pair
    ps = prompts(3, seed=5)
    ref = LLM(str(target), num_blocks=128, page_size=4).generate(ps, GREEDY)
    want = {tuple(p): o.output_ids for p, o in zip(ps, ref, strict=True)}
    spec = lagged_with_costly_drafter(pair, tmp_path)
    spec.runner.draft = ContinuationDrafter(spec, want, bad=0.0)  # type: ignore[method-assign]
    outs = spec.generate(ps, GREEDY)
    assert [o.output_ids for o in outs] == [o.output_ids for o in ref]
    assert spec.stats.verified > 0 and spec.stats.accepted == spec.stats.verified
    spec.close()


def test_lagged_corrects_a_confidence_head_that_underestimates(
    pair: tuple[Path, Path], tmp_path: Path
) -> None:
    """Every draft is right but the head says 0.5 (a head calibrated for another temperature):
    by those confidences a drafter costing two forwards never pays, so at first only the probes
    verify; their acceptance lifts the live correction and K follows."""
    target, _ = pair
    ps = prompts(1, seed=6)
    params = SamplingParams(temperature=0.0, max_tokens=120)
    ref = LLM(str(target), num_blocks=128, page_size=4).generate(ps, params)
    want = {tuple(p): o.output_ids for p, o in zip(ps, ref, strict=True)}
    spec = lagged_with_costly_drafter(pair, tmp_path)
    spec.runner.draft = ContinuationDrafter(spec, want, bad=0.0, conf_logit=0.0)  # type: ignore[method-assign]
    outs = spec.generate(ps, params)
    assert [o.output_ids for o in outs] == [o.output_ids for o in ref]
    assert spec.planner is not None and spec.planner.correction.ratios[0] > 1.3
    # most tokens came from accepted drafts (the probes alone: 3 blocks, 15 tokens)
    assert spec.stats.accepted == spec.stats.verified > 60
    spec.close()


def chi_square_pvalue(obs: np.ndarray, exp: np.ndarray) -> float:
    stat = float(((obs - exp) ** 2 / exp).sum())
    dof = len(obs) - 1  # survival function of chi2(dof) = regularised upper gamma
    return float(torch.special.gammaincc(torch.tensor(dof / 2.0), torch.tensor(stat / 2.0)))


def _joint_counts(llm: LLM, n: int, vocab: int) -> np.ndarray:
    params = [SamplingParams(temperature=1.0, seed=i, max_tokens=3) for i in range(n)]
    outs = llm.generate([[1, 2, 3]] * n, params)
    counts = np.zeros((vocab, vocab))
    for o in outs:
        counts[o.output_ids[1], o.output_ids[2]] += 1  # tokens 2-3 come from verify rounds
    return counts


def _target_joint(path: Path, vocab: int) -> np.ndarray:
    hf = hf_reference(path)
    with torch.no_grad():
        p1 = torch.softmax(hf(input_ids=torch.tensor([[1, 2, 3]])).logits[0, -1].double(), -1)
        ids = torch.tensor([[1, 2, 3, a] for a in range(vocab)])
        p2 = torch.softmax(hf(input_ids=ids).logits[:, -1].double(), -1)  # [a, b]
        seqs = torch.tensor([[1, 2, 3, a, b] for a in range(vocab) for b in range(vocab)])
        p3 = torch.softmax(hf(input_ids=seqs).logits[:, -1].double(), -1).view(vocab, vocab, -1)
    # P(x2 = b, x3 = c) = sum_a p1(a) p2(b | a) p3(c | a, b)
    return torch.einsum("a,ab,abc->bc", p1, p2, p3).numpy()


@pytest.mark.parametrize(
    ("mode", "sample_t", "lossless"),
    [
        ("verify-all", 1.0, True),
        ("sync", 1.0, True),
        ("lagged", 1.0, True),
        ("verify-all", 0.5, False),
    ],
)
def test_chi_square_speculative_equals_target(
    tmp_path: Path, mode: str, sample_t: float, lossless: bool
) -> None:
    vocab = 12
    target = write_hf_model(tmp_path / "t", moe=True, seed=4, vocab_size=vocab)
    drafter = write_drafter(tmp_path / "d", target, block_size=3, mask_token_id=vocab - 1)
    llm = LLM(
        str(target),
        draft_model=str(drafter),
        max_running_requests=512,
        max_num_batched_tokens=4096,
        schedule_mode=mode,
        capacity_profile=str(write_capacity_profile(tmp_path / "cap.yaml", 3)),
        live_capacity=False,  # the given curve, not this host's timing, decides the lengths
    )
    llm.runner.draft = BigramDrafter(llm, vocab, sample_t)
    n = 20_000
    counts = _joint_counts(llm, n, vocab)
    want = _target_joint(target, vocab) * n
    keep = want >= 5  # chi-square validity; pool the rest into one cell
    obs = np.append(counts[keep], counts[~keep].sum())
    exp = np.append(want[keep], want[~keep].sum())
    p_value = chi_square_pvalue(obs, exp)
    assert llm.stats.accepted > 0.2 * llm.stats.verified  # acceptance really happened
    if mode != "verify-all":  # the scheduler really varied the verify lengths
        assert 0 < llm.stats.verified < 0.95 * llm.stats.drafted
    if lossless:
        assert p_value > 1e-4, p_value
    else:
        assert p_value < 1e-6, p_value  # the test has power against a lying q


@pytest.mark.parametrize("with_drafter", [True, False])
def test_prefill_decode_handoff_continues_exactly(
    pair: tuple[Path, Path], with_drafter: bool
) -> None:
    """Prefill on one engine, adopt on another: same tokens as one engine, greedy and seeded.
    The drafter runs in fp32 throughout: at --draft-dtype auto its products of 16 rows or more
    run in bf16, so how many prompts' context one product projects (one engine's prefill step,
    a prefill worker's chunks, a decode worker's flush of adopted prompts) moves the drafts by
    bf16 rounding, and seeded sampling reads the drafts."""
    target, drafter = pair
    draft = str(drafter) if with_drafter else None
    ps = prompts(5, seed=9)
    params = [
        SamplingParams(temperature=0.0 if i % 2 else 0.8, seed=100 + i, max_tokens=16)
        for i in range(len(ps))
    ]
    kw = {"page_size": 4, "draft_dtype": "float32"}
    whole = LLM(str(target), draft_model=draft, **kw).generate(ps, params)
    prefill = LLM(str(target), draft_model=draft, chunked_prefill_size=5, **kw)
    decode = LLM(str(target), draft_model=draft, num_blocks=64, **kw)
    ids = [prefill.add_request(p, sp, prefill_only=True) for p, sp in zip(ps, params, strict=True)]
    handoffs = {}
    while prefill.has_unfinished():
        for o in prefill.step():
            if o.finished:
                assert o.finish_reason == "handoff" and o.handoff is not None
                handoffs[o.seq_id] = o.handoff
    assert prefill.pool.num_free_blocks == prefill.pool.num_blocks
    if with_drafter:
        assert all(h.draft_ctx is not None for h in handoffs.values())
        # the prefill engine projected C for the handoffs and wrote none into its own drafter
        assert all(not k.any() and not v.any() for k, v in prefill.runner.draft_kv)
    got = {}
    mapping = {decode.try_adopt(handoffs[i]): n for n, i in enumerate(ids)}
    assert None not in mapping
    while decode.has_unfinished():
        for o in decode.step():
            if o.finished:
                got[mapping[o.seq_id]] = o.output_ids
    assert [got[n] for n in range(len(ps))] == [o.output_ids for o in whole]
    assert decode.pool.num_free_blocks == decode.pool.num_blocks


def test_a_context_only_prefill_engine_hands_off_the_same_and_keeps_no_drafter_pool(
    pair: tuple[Path, Path],
) -> None:
    """The prefill worker's engine (`context_only`): the same handoffs (KV, first token, drafter
    context C) as an engine with a drafter pool, no drafter K/V pool, so the same KV budget
    holds more target blocks, and a clear error for what it cannot do."""
    from dspark_sglang.config import ConfigError

    target, drafter = pair
    ps = prompts(4, seed=13)
    sp = SamplingParams(temperature=0.0, max_tokens=8)
    kw = dict(draft_model=str(drafter), page_size=4, kv_cache_bytes=1 << 20)
    full, lean = LLM(str(target), **kw), LLM(str(target), context_only=True, **kw)
    assert lean.runner.draft_kv == [] and lean.pool.num_blocks > full.pool.num_blocks
    assert (
        lean.pool.num_blocks
        == LLM(str(target), page_size=4, kv_cache_bytes=1 << 20).pool.num_blocks
    )

    def handoffs(llm: LLM) -> list:
        ids = [llm.add_request(p, sp, prefill_only=True) for p in ps]
        got = {}
        while llm.has_unfinished():
            got |= {o.seq_id: o.handoff for o in llm.step() if o.finished}
        return [got[i] for i in ids]

    for a, b in zip(handoffs(full), handoffs(lean), strict=True):
        assert a.first_token == b.first_token
        torch.testing.assert_close(a.kv, b.kv)
        torch.testing.assert_close(a.draft_ctx, b.draft_ctx)
    with pytest.raises(ConfigError, match="only prefills for handoffs"):
        lean.add_request(ps[0], sp)
    with pytest.raises(ConfigError, match="only prefills for handoffs"):
        lean.try_adopt(handoffs(full)[0])
    with pytest.raises(ConfigError, match="never drafts"):
        LLM(str(target), context_only=True, schedule_mode="lagged", **kw)


def test_handoff_with_a_bad_rng_state_is_refused_before_it_takes_kv(
    pair: tuple[Path, Path],
) -> None:
    from dataclasses import replace

    from dspark_sglang.config import ConfigError

    target, drafter = pair
    prefill = LLM(str(target), draft_model=str(drafter), page_size=4)
    prefill.add_request([1, 2, 3, 4, 5], SamplingParams(max_tokens=8), prefill_only=True)
    handoff = None
    while prefill.has_unfinished():
        for o in prefill.step():
            handoff = o.handoff or handoff
    assert handoff is not None
    decode = LLM(str(target), draft_model=str(drafter), page_size=4, num_blocks=64)
    bad = replace(handoff, rng_state=torch.zeros(3, dtype=torch.uint8))
    with pytest.raises(ConfigError, match="RNG state"):
        decode.try_adopt(bad)
    assert decode.pool.num_free_blocks == decode.pool.num_blocks
    assert not decode.has_unfinished()
    assert decode.try_adopt(handoff) is not None  # the good one still goes through


def test_length_groups_is_the_cheapest_partition_of_the_sorted_rows() -> None:
    """Every row in exactly one pass; the passes' padded slots + per-pass cost equal the best
    split of the length-sorted rows (brute force over all cut sets); equal lengths stay one pass
    and one long prompt among short ones gets its own."""
    from itertools import combinations

    from dspark_sglang.engine.speculative import length_groups

    def cost(groups: list[list[int]], lens: list[int], room: int, call: int) -> int:
        return sum(len(g) * (max(lens[i] for i in g) + room) + call for g in groups)

    rng = np.random.default_rng(0)
    for _ in range(200):
        n = int(rng.integers(1, 9))
        lens = rng.integers(1, 600, n).tolist()
        room, call = int(rng.integers(0, 8)), int(rng.integers(0, 1500))
        groups = length_groups(lens, room, call)
        assert sorted(i for g in groups for i in g) == list(range(n))
        srt = sorted(lens)
        best = min(
            sum(
                (b - a) * (srt[b - 1] + room) + call
                for a, b in zip((0, *cuts), (*cuts, n), strict=True)
            )
            for k in range(n)
            for cuts in combinations(range(1, n), k)
        )
        assert cost(groups, lens, room, call) == best
    assert length_groups([200] * 30, 7) == [list(range(30))]
    split = length_groups([100] * 29 + [1000], 7)
    assert sorted(map(sorted, split)) == [list(range(29)), [29]]


def test_grouped_drafting_proposes_what_one_padded_pass_does(
    pair: tuple[Path, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Short and long prompts in one batch: the drafter run in passes of similar length makes
    the same drafts and confidences as one pass padded to the longest context, step by step."""
    import dspark_sglang.engine.speculative as spec_mod

    g = torch.Generator().manual_seed(9)
    ps = [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in (3, 4, 60, 5, 90, 6)]
    runs = []
    for call_slots in (0, 10**9):  # a pass per length class / always one pass
        monkeypatch.setattr(spec_mod, "GROUP_CALL_SLOTS", call_slots)
        llm = LLM(  # float32 drafter: bf16 sums depend on the padding, at 1e-2
            str(pair[0]),
            draft_model=str(pair[1]),
            num_blocks=256,
            page_size=4,
            draft_dtype="float32",
        )
        seen: list[tuple[torch.Tensor, torch.Tensor | None, int]] = []
        inner = llm.runner.draft

        def spy(batch, temps, gens, inner=inner, seen=seen):  # type: ignore[no-untyped-def]
            out = inner(batch, temps, gens)
            passes = len(spec_mod.length_groups(batch.anchor_pos.tolist(), 5))
            seen.append((out.tokens.clone(), out.conf_logits, passes))
            return out

        llm.runner.draft = spy  # type: ignore[method-assign]
        outs = llm.generate(ps, GREEDY)
        runs.append(([o.output_ids for o in outs], seen))
        llm.close()
    (ids_a, seen_a), (ids_b, seen_b) = runs
    assert ids_a == ids_b and len(seen_a) == len(seen_b) > 0
    assert any(p > 1 for _, _, p in seen_a) and all(p == 1 for _, _, p in seen_b)
    for (ta, ca, _), (tb, cb, _) in zip(seen_a, seen_b, strict=True):
        assert torch.equal(ta, tb)
        if ca is not None:
            torch.testing.assert_close(ca, cb, atol=1e-5, rtol=1e-4)


def test_draft_batch_slots_are_the_block_tables_positions() -> None:
    """The page-wise slot table equals kv_cache.slots position by position, padding 0, for
    random block tables, page sizes and context lengths (block tables longer than the context
    included)."""
    from types import SimpleNamespace

    from dspark_sglang.engine.kv_cache import slots
    from dspark_sglang.engine.speculative import build_draft_batch

    rng = np.random.default_rng(2)
    for _ in range(50):
        ps = int(rng.choice([1, 4, 16]))
        seqs = []
        for i in range(int(rng.integers(1, 6))):
            n = int(rng.integers(2, 70))
            pages = -(-n // ps) + int(rng.integers(0, 3))
            table = rng.permutation(200)[:pages].tolist()
            seqs.append(SimpleNamespace(num_tokens=n, block_table=table, output_ids=[i], seq_id=i))
        b = build_draft_batch(seqs, ps, "cpu")  # type: ignore[arg-type]
        lmax = max(s.num_tokens - 1 for s in seqs)
        for r, s in enumerate(seqs):
            n = s.num_tokens - 1
            want = slots(s.block_table, 0, n, ps) + [0] * (lmax - n)
            assert b.ctx_slots[r].tolist() == want
            assert b.ctx_mask[r].tolist() == [True] * n + [False] * (lmax - n)


def test_a_drafter_run_that_flushes_a_prompt_backlog_prices_no_step(
    pair: tuple[Path, Path], tmp_path: Path
) -> None:
    """The first drafting step after the prompts' prefill projects every prompt row into the
    drafter's context: its drafter time is the prompts', not a step's, so its record says so
    (`draft_resumed`, which the live estimator does not learn the draft price from); the
    drafting steps that follow, each flushing one step's verified rows, do not."""
    ps = prompts(3, seed=5)
    spec = lagged_on_fixed_curve(pair, tmp_path, 0.0)  # a free drafter: K > 0 every step
    recs: list[StepRecord] = []
    spec.on_step = recs.append
    spec.generate(ps, SamplingParams(temperature=0.0, max_tokens=12))
    drafting = [r for r in recs if r.draft_seconds > 0.0 and not r.num_prefill_tokens]
    assert len(drafting) >= 3 and not any(r.probe for r in drafting)
    assert drafting[0].draft_resumed  # the prompts' rows: more than 3 x (gamma + 1)
    assert not any(r.draft_resumed for r in drafting[1:])
    spec.close()


def test_every_step_record_is_stamped_with_its_start(pair: tuple[Path, Path]) -> None:
    """StepRecord.started_at: unix seconds at the step's start, in step order and no later than
    the previous step's start plus its time (bench.host_speed places steps in a sweep's cells)."""
    import itertools
    import time

    llm = LLM(str(pair[0]), draft_model=str(pair[1]), num_blocks=128, page_size=4)
    recs: list[StepRecord] = []
    llm.on_step = recs.append
    before = time.time()
    llm.generate(prompts(3, seed=5), GREEDY)
    after = time.time()
    assert len(recs) > 3
    starts = [r.started_at for r in recs]
    # started_at is wall-clock time, step_seconds perf_counter: 1 ms for the two clocks' slew
    assert before <= starts[0] and starts[-1] + recs[-1].step_seconds <= after + 1e-3
    for a, b in itertools.pairwise(recs):
        assert a.started_at + a.step_seconds <= b.started_at + 1e-3


def test_a_stall_is_placed_in_the_step_part_it_happened_in(
    pair: tuple[Path, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """StepRecord.plan_seconds (the planner's work before the forward) and context_seconds (the
    drafter-context queue after it): a 40 ms stall in either lands in that field of that step's
    record and no other, and the timed parts never add up to more than the step."""
    import time

    llm = LLM(
        str(pair[0]),
        draft_model=str(pair[1]),
        num_blocks=128,
        page_size=4,
        schedule_mode="lagged",
        startup_profile_seconds=0.2,
    )
    recs: list[StepRecord] = []
    llm.on_step = recs.append
    assert llm.planner is not None
    stall = {"ctx": 3, "plan": 6}  # the step numbers (1-based) that stall
    extend, budget = llm._extend_draft_context, llm.planner.budget

    def slow_extend(*a: object) -> None:
        if llm._step_no + 1 == stall["ctx"]:
            time.sleep(0.04)
        extend(*a)

    def slow_budget(*a: object) -> int:
        if llm._step_no + 1 == stall["plan"]:
            time.sleep(0.04)
        return budget(*a)

    monkeypatch.setattr(llm, "_extend_draft_context", slow_extend)
    monkeypatch.setattr(llm.planner, "budget", slow_budget)
    llm.generate(prompts(2, seed=9), GREEDY)
    assert len(recs) > stall["plan"]
    for r in recs:
        parts = r.forward_seconds + r.draft_seconds + r.plan_seconds + r.context_seconds
        assert math.isfinite(parts) and parts <= r.step_seconds + 1e-6
        assert (r.context_seconds >= 0.04) == (r.step == stall["ctx"])
        assert (r.plan_seconds >= 0.04) == (r.step == stall["plan"])
    plain = LLM(str(pair[0]), num_blocks=128, page_size=4)
    recs.clear()
    plain.on_step = recs.append
    plain.generate(prompts(1, seed=9), GREEDY)
    assert all(math.isnan(r.context_seconds) and 0.0 <= r.plan_seconds < 0.04 for r in recs)


def test_adoption_time_lands_in_the_next_step_record_only(pair: tuple[Path, Path]) -> None:
    """StepRecord.adopt_seconds: try_adopt's wall time since the previous record (the decode
    worker's work between steps that step_seconds leaves out), in the first record after the
    adoptions and in no other."""
    import time

    target, drafter = pair
    sp = SamplingParams(temperature=0.0, max_tokens=6)
    prefill = LLM(str(target), draft_model=str(drafter), page_size=4)
    for p in prompts(3, seed=21):
        prefill.add_request(p, sp, prefill_only=True)
    handoffs = []
    while prefill.has_unfinished():
        handoffs += [o.handoff for o in prefill.step() if o.finished]
    assert len(handoffs) == 3 and all(h.draft_ctx is not None for h in handoffs)
    decode = LLM(str(target), draft_model=str(drafter), page_size=4, num_blocks=64)
    recs: list[StepRecord] = []
    decode.on_step = recs.append
    t = time.perf_counter()
    assert all(decode.try_adopt(h) is not None for h in handoffs[:2])
    adopting = time.perf_counter() - t
    decode.step()
    assert 0.0 < recs[0].adopt_seconds <= adopting
    decode.step()
    assert recs[1].adopt_seconds == 0.0
    assert decode.try_adopt(handoffs[2]) is not None
    while decode.has_unfinished():
        decode.step()
    assert recs[2].adopt_seconds > 0.0
    assert all(r.adopt_seconds == 0.0 for r in recs[3:])
