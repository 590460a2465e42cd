"""engine/planner.py helpers that need no engine."""

from __future__ import annotations

import math
from dataclasses import replace

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from dspark_sglang.algo.capacity import CapacityModel
from dspark_sglang.algo.capacity_fit import LiveEstimator
from dspark_sglang.algo.survival import survival
from dspark_sglang.engine.planner import VerifyPlanner, _conditionals, ctx_bucket


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


def test_probe_gap_resets_only_after_sustained_drafting() -> None:
    """Each probe doubles the gap to the next one; K > 0 blips right after a probe (its own
    confidences, read at lag 2) do not reset it, PROBE_MIN drafting steps in a row do, and a
    skipped step breaks the run."""
    from dspark_sglang.algo.capacity import CapacityModel, TableModel
    from dspark_sglang.algo.verify_budget import parse_schedule_mode
    from dspark_sglang.engine.planner import PROBE_EVIDENCE, PROBE_MAX, PROBE_MIN, VerifyPlanner

    cap = CapacityModel(TableModel((1, 64), (0.01, 0.02)))
    p = VerifyPlanner(parse_schedule_mode("lagged"), 4, cap, None, False, 0.0, False)
    p.prior = replace(p.prior, trials=(float(PROBE_EVIDENCE),) * 4)  # enough evidence to back off
    ids, logits, max_len = [7], np.zeros((1, 4)), np.array([4])

    def step(k: int) -> None:
        p.plan(ids, logits, max_len, 10, k)

    step(0)
    assert p._probe_every == 2 * PROBE_MIN
    step(2)
    step(3)
    p.skip(ids, max_len, 10)
    step(0)
    assert p._probe_every == 4 * PROBE_MIN  # the blips did not reset it
    for _ in range(PROBE_MIN - 1):
        step(2)
    p.skip(ids, max_len, 10)
    step(2)
    assert p._probe_every == 4 * PROBE_MIN  # a skipped step broke the run
    for _ in range(PROBE_MIN):
        step(2)
    assert p._probe_every == PROBE_MIN
    for _ in range(10):
        step(0)
    assert p._probe_every == PROBE_MAX


def test_a_backed_off_whole_batch_probe_is_retimed_by_the_next_step() -> None:
    """After skipped steps a probe's drafter is resumed and prices nothing; once probes have backed
    off, a probe that drafted every row asks for one more drafting step (not resumed: it times
    the drafter at this R), which does not back the gap off again. A probe of a few rows of a
    larger batch, and a probe at PROBE_MIN, ask for none."""
    from dspark_sglang.algo.capacity import CapacityModel, TableModel
    from dspark_sglang.algo.verify_budget import parse_schedule_mode
    from dspark_sglang.engine.planner import PROBE_EVIDENCE, PROBE_MIN, VerifyPlanner

    cap = CapacityModel(TableModel((1, 64), (0.01, 0.02)))
    p = VerifyPlanner(parse_schedule_mode("lagged"), 4, cap, None, False, 0.0, False)
    ids, logits, max_len = [7], np.zeros((1, 4)), np.array([4])
    whole = (ids, max_len, 10)
    p.skip(ids, max_len, 10)
    p.plan(ids, logits, max_len, 10, 0, whole)  # too little evidence: the gap stays at PROBE_MIN
    assert p._probe_every == PROBE_MIN and not p.should_probe()
    p.prior = replace(p.prior, trials=(float(PROBE_EVIDENCE),) * 4)
    for _ in range(PROBE_MIN):
        p.skip(ids, max_len, 10)
    assert p.should_probe()
    plan = p.plan(ids, logits, max_len, 10, 0, whole)
    assert plan.probe and plan.resumed and p._probe_every == 2 * PROBE_MIN
    assert p.should_probe()  # the retime
    plan = p.plan(ids, logits, max_len, 10, 0, whole)
    assert plan.probe and not plan.resumed and p._probe_every == 2 * PROBE_MIN
    assert not p.should_probe()  # one retime per probe
    p.skip(ids, max_len, 10)
    assert not p.should_probe()
    # four rows of an eight-row batch: nothing retimes them at R = 8
    many, many_len = list(range(8)), np.full(8, 4)
    for _ in range(2 * PROBE_MIN):
        p.skip(many, many_len, 80)
    p.plan(many[:4], np.zeros((4, 4)), many_len[:4], 40, 0, (many, many_len, 80))
    assert p._probe_every == 2 * PROBE_MIN and not p.should_probe()  # (the load shift reset it)


def test_probes_do_not_back_off_before_enough_drafts_were_verified() -> None:
    """A few probes are a small sample: until PROBE_EVIDENCE first drafts were verified the gap
    stays at PROBE_MIN however often K came out 0; the verified drafts of probes count."""
    from dspark_sglang.algo.capacity import CapacityModel, TableModel
    from dspark_sglang.algo.verify_budget import parse_schedule_mode
    from dspark_sglang.engine.planner import PROBE_EVIDENCE, PROBE_MIN, VerifyPlanner

    cap = CapacityModel(TableModel((1, 64), (0.01, 0.02)))
    p = VerifyPlanner(parse_schedule_mode("lagged"), 4, cap, None, False, 0.0, False)
    ids, logits, max_len = [7], np.zeros((1, 4)), np.array([4])
    probes = 0
    while p._evidence() < PROBE_EVIDENCE:
        plan = p.plan(ids, logits, max_len, 10, 0)  # a probe: every draft verified
        assert p._probe_every == PROBE_MIN
        p.observe_acceptance(plan.lengths, np.array([1]), ids)
        probes += 1
    assert probes == PROBE_EVIDENCE
    p.plan(ids, logits, max_len, 10, 0)
    assert p._probe_every == 2 * PROBE_MIN


def test_skipped_steps_age_the_last_drafts_toward_the_prior() -> None:
    """After a drafting step, skipped steps push the last drafts' survival moved toward the
    prior's by STALE_DECAY per step (re-aged after 1, 2, 4, 8 skipped steps, the same snapshot
    repeated in between); once its weight is below STALE_FLOOR every request reads the prior."""
    from dspark_sglang.algo.capacity import CapacityModel, TableModel
    from dspark_sglang.algo.verify_budget import parse_schedule_mode
    from dspark_sglang.engine.planner import STALE_DECAY, STALE_FLOOR, VerifyPlanner

    cap = CapacityModel(TableModel((1, 64), (0.01, 0.02)))
    p = VerifyPlanner(parse_schedule_mode("lagged"), 4, cap, None, False, 0.0, False)
    ids, max_len = [7, 9], np.array([4, 4])
    logits = np.full((2, 4), -3.0)  # confident it fails: survival far below the prior's
    p.plan(ids, logits, max_len, 10, 0)
    drafted = p.history.snapshots[-1][1]
    base = p.prior.survival
    assert (drafted[:, 0] < base[0] - 0.3).all()
    n, aged = 0, 0
    while STALE_DECAY ** (n + 1) >= STALE_FLOOR:
        p.skip(ids, max_len, 10)
        n += 1
        if n & (n - 1) == 0:  # re-aged after 1, 2, 4, 8 … skipped steps, repeated in between
            aged = n
        got = p.history.lagged(np.array(ids), 1, p.prior)
        np.testing.assert_allclose(got, base + (drafted - base) * STALE_DECAY**aged)
    assert aged == 8
    p.skip(ids, max_len, 10)
    assert p.history.snapshots[-1][0].size == 0  # nobody: the prior's row for every request
    np.testing.assert_allclose(p.history.lagged(np.array(ids), 1, p.prior), [base, base])
    snap = p.history.snapshots[-1]
    p.skip(ids, max_len, 10)
    assert p.history.snapshots[-1] is snap  # pushed once, then repeated (the K memo holds)


def test_a_step_that_verified_nothing_keeps_the_k_memo() -> None:
    """Observing a K = 0 step (every verify length 0) changes neither the prior nor the
    corrections, so the next skipped step plans K from the memo, without a recomputation (one
    per step on the worker before: 0.44 ms of GIL-holding numpy at c = 32)."""
    from dspark_sglang.algo.capacity import CapacityModel, TableModel
    from dspark_sglang.algo.verify_budget import parse_schedule_mode
    from dspark_sglang.engine.planner import VerifyPlanner

    cap = CapacityModel(TableModel((1, 64), (0.01, 0.02)))
    p = VerifyPlanner(parse_schedule_mode("lagged"), 4, cap, None, False, 0.0, False)
    ids, max_len = [7, 9], np.array([4, 4])
    plan = p.plan(ids, np.zeros((2, 4)), max_len, 10, 0)  # a probe: both rows drafted
    p.observe_acceptance(plan.lengths, np.array([2, 1]), ids)
    for _ in range(20):  # past STALE_FLOOR: the prior snapshot, then repeats
        p.skip(ids, max_len, 10)
        p.observe_acceptance(np.zeros(2, np.int64), np.zeros(2, np.int64), ids)
        p.budget(ids, max_len, 10)
    state = (p.prior, p.correction, p.surv_correction)
    calls = []
    inner = p._k_from_history
    p._k_from_history = lambda *a: calls.append(1) or inner(*a)  # type: ignore[method-assign]
    for _ in range(5):
        p.skip(ids, max_len, 10)
        p.observe_acceptance(np.zeros(2, np.int64), np.zeros(2, np.int64), ids)
        p.budget(ids, max_len, 10)
    assert p.prior is state[0] and p.correction is state[1] and p.surv_correction is state[2]
    assert not calls


def test_a_load_shift_brings_the_probe_gap_back_to_its_minimum() -> None:
    """The gap backed off at one load is reset once the batch is LOAD_SHIFT times larger or
    smaller than when it was last at PROBE_MIN; the load moving less keeps it."""
    from dspark_sglang.algo.capacity import CapacityModel, TableModel
    from dspark_sglang.algo.verify_budget import parse_schedule_mode
    from dspark_sglang.engine.planner import (
        LOAD_SHIFT,
        PROBE_EVIDENCE,
        PROBE_MAX,
        PROBE_MIN,
        VerifyPlanner,
    )

    cap = CapacityModel(TableModel((1, 64), (0.01, 0.02)))
    p = VerifyPlanner(parse_schedule_mode("lagged"), 4, cap, None, False, 0.0, False)
    p.prior = replace(p.prior, trials=(float(PROBE_EVIDENCE),) * 4)
    big = list(range(32))
    for _ in range(8):  # probes at R = 32 that keep finding K = 0
        p.plan(big, np.zeros((32, 4)), np.full(32, 4), 10, 0)
    assert p._probe_every == PROBE_MAX
    near = list(range(32 // LOAD_SHIFT))  # exactly LOAD_SHIFT times smaller: the same load
    p.skip(near, np.full(len(near), 4), 10)
    assert p._probe_every == PROBE_MAX
    small = list(range(32 // LOAD_SHIFT - 1))
    p.skip(small, np.full(len(small), 4), 10)
    assert p._probe_every == PROBE_MIN
    # a probe drafting a few rows of a large batch is priced at the whole batch's load
    for _ in range(8):
        p.plan(small[:4], np.zeros((4, 4)), np.full(4, 4), 10, 0, batch=(small, np.full(15, 4), 10))
    assert p._probe_every == PROBE_MAX


def test_corrected_survival_reaches_sync_as_the_conditionals_it_is_the_product_of() -> None:
    s = np.array([[0.9, 0.45, 0.45, 0.0, 0.0], [1.0, 1.0, 0.5, 0.25, 0.1]])
    c = _conditionals(s)
    np.testing.assert_allclose(survival(c), s)
    assert c[0, 3:].tolist() == [0.0, 0.0] and np.all((c >= 0) & (c <= 1))


def test_selective_lagged_drafts_the_rows_k_admits_and_carries_the_rest_forward() -> None:
    """A drafter priced by its rows (5 ms + 20 ms per row, forwards 80 ms): with one confident
    request among four, K pays for drafting that one alone; draft_rows names it, the step is
    priced with one drafted row, and the others' survival is pushed again, aged toward the prior,
    so the next K does not read them as fresh requests. Without selection K stays 0."""
    from dspark_sglang.algo.capacity import CapacityModel, Curve, TableModel
    from dspark_sglang.algo.verify_budget import parse_schedule_mode
    from dspark_sglang.engine.planner import STALE_DECAY, VerifyPlanner

    draft = Curve((1.0, 64.0), (0.025, 1.285))
    cap = CapacityModel(TableModel((1, 256), (0.08, 0.08)), draft=draft)
    mode = parse_schedule_mode("lagged")
    ids, max_len = [3, 5, 7, 9], np.array([4, 4, 4, 4])
    logits = np.array([[4.0] * 4] + [[-4.0] * 4] * 3)  # request 3 confident, the rest not
    got = {}
    for selective in (False, True):
        p = VerifyPlanner(mode, 4, cap, None, False, 0.0, False, selective)
        p.plan(ids, logits, max_len, 40, 0)  # a probe of every row, then one more step: lag 2
        p.plan(ids, logits, max_len, 40, 0)
        got[selective] = p.budget(ids, max_len, 40)
        if selective:
            k = got[True]
            keep = p.draft_rows(ids, k, max_len)
            assert keep is not None and keep.tolist() == [0]
            before = p.history.lagged(np.array([5, 7, 9]), 1, p.prior)
            plan = p.plan([3], logits[:1], max_len[:1], 10, k, (ids, max_len, 40))
            assert not plan.probe and plan.draft_rows == 1 and plan.k == k
            assert plan.predicted_seconds == cap.predict(4, 4 + k, 40, draft_rows=1)
            base = p.prior.survival
            after = p.history.lagged(np.array([5, 7, 9]), 1, p.prior)
            np.testing.assert_allclose(after, base + (before - base) * STALE_DECAY)
            assert p.draft_rows(ids, 0, max_len) is None
    assert got[False] == 0 and got[True] == 4
    # a drafter that costs the same for any rows (here: none) drafts them all, for the live top-K
    free = VerifyPlanner(mode, 4, replace(cap, draft=None), None, False, 0.0, False, True)
    free.plan(ids, logits, max_len, 40, 0)
    free.plan(ids, logits, max_len, 40, 0)
    k = free.budget(ids, max_len, 40)
    assert k > 0 and free.draft_rows(ids, k, max_len) is None


def test_the_user_rate_floor_turns_down_a_k_that_slows_the_requests_it_does_not_pay_for() -> None:
    """The selective setting above (one confident request of four; forwards 80 ms, drafting one
    row 25 ms): K = 4 drafts request 3 alone and the other three wait 105 ms for one token each,
    0.76 of their plain rate. A floor of 1 refuses that K, a floor of 0.5 keeps it; drafting all
    four confident requests raises every one's rate, so even a floor of 1 keeps it."""
    from dspark_sglang.algo.capacity import CapacityModel, Curve, TableModel
    from dspark_sglang.algo.verify_budget import parse_schedule_mode

    draft = Curve((1.0, 64.0), (0.025, 1.285))
    cap = CapacityModel(TableModel((1, 256), (0.08, 0.08)), draft=draft)
    mode = parse_schedule_mode("lagged")
    ids, max_len = [3, 5, 7, 9], np.array([4, 4, 4, 4])
    one = np.array([[4.0] * 4] + [[-4.0] * 4] * 3)
    every = np.full((4, 4), 4.0)

    def k_of(logits: np.ndarray, floor: float) -> int:
        p = VerifyPlanner(mode, 4, cap, None, False, 0.0, False, True, user_rate_floor=floor)
        p.plan(ids, logits, max_len, 40, 0)
        p.plan(ids, logits, max_len, 40, 0)
        return p.budget(ids, max_len, 40)

    assert k_of(one, 0.0) == 4 and k_of(one, 0.5) == 4 and k_of(one, 1.0) == 0
    assert k_of(every, 0.0) > 0 and k_of(every, 1.0) == k_of(every, 0.0)
    # only lagged plans K before drafting: the floor is not read elsewhere
    sync = VerifyPlanner(
        parse_schedule_mode("sync"), 4, cap, None, False, 0.0, False, True, user_rate_floor=1.0
    )
    assert sync.user_rate_floor == 0.0


def test_a_tie_margin_widens_the_lagged_k_and_only_the_lagged_one() -> None:
    """Forwards of 80 ms up to B = 8 and 1 ms more a token above: with four requests whose later
    drafts are weak, the argmax stops at K = 8 of 16; a margin widens K the more the larger it
    is (0.001: not at all; 0.3: every draft), and sync never reads it."""
    from dspark_sglang.algo.capacity import CapacityModel, TableModel
    from dspark_sglang.algo.verify_budget import parse_schedule_mode

    buckets = tuple(range(1, 21))
    cap = CapacityModel(TableModel(buckets, tuple(0.08 + 0.001 * max(0, b - 8) for b in buckets)))
    mode = parse_schedule_mode("lagged")
    ids, max_len = [3, 5, 7, 9], np.array([4, 4, 4, 4])
    logits = np.tile(np.array([4.0, -1.0, -1.5, -2.0]), (4, 1))

    def k_of(margin: float) -> int:
        p = VerifyPlanner(mode, 4, cap, None, False, 0.0, False, False, tie_margin=margin)
        p.plan(ids, logits, max_len, 40, 0)
        p.plan(ids, logits, max_len, 40, 0)
        return p.budget(ids, max_len, 40)

    assert k_of(0.0) == k_of(0.001) == 8 < k_of(0.05) < k_of(0.3) == 16
    sync = VerifyPlanner(
        parse_schedule_mode("sync"), 4, cap, None, False, 0.0, False, False, tie_margin=0.1
    )
    assert sync.tie_margin == 0.0


@pytest.mark.parametrize("overlap", [False, True])
def test_selective_rows_index_the_batch_the_step_drafts(overlap: bool) -> None:
    """draft_rows names rows of the batch passed to it, the ones its K admits under the lagged
    survival, also when K was planned (on the overlap thread) for last step's batch and a
    request has left since."""
    from dspark_sglang.algo.capacity import CapacityModel, Curve, TableModel
    from dspark_sglang.algo.survival import AcceptancePrior
    from dspark_sglang.algo.verify_budget import assign_top_k, parse_schedule_mode
    from dspark_sglang.engine.planner import VerifyPlanner

    draft = Curve((1.0, 64.0), (0.025, 1.285))
    cap = CapacityModel(TableModel((1, 256), (0.08, 0.08)), draft=draft)
    p = VerifyPlanner(parse_schedule_mode("lagged"), 4, cap, None, False, 0.0, overlap, True)
    p.prior = AcceptancePrior.uniform(4, rate=0.05)
    logits = np.array([[-4.0] * 4, [4.0] * 4, [4.0] * 4, [-4.0] * 4])  # 5 and 7 confident
    ids, max_len = [3, 5, 7, 9], np.array([4, 4, 4, 4])
    p.plan(ids, logits, max_len, 40, 0)  # two probes of every row: a lag-2 snapshot
    p.plan(ids, logits, max_len, 40, 0)
    for batch in ([3, 5, 7, 9], [5, 7, 9]):  # request 3 leaves at the second step
        rows = [ids.index(i) for i in batch]
        k = p.budget(batch, max_len[rows], 40)
        keep = p.draft_rows(batch, k, max_len[rows])
        lagged = p.history.lagged(np.array(batch), 2, p.prior)
        want = np.flatnonzero(assign_top_k(lagged, k, max_len=max_len[rows]))
        assert k > 0 and keep is not None and keep.tolist() == want.tolist()
        p.plan(
            [batch[i] for i in keep],
            logits[rows][keep],
            max_len[rows][keep],
            40,
            k,
            (batch, max_len[rows], 40),
        )
    p.close()


@pytest.mark.parametrize("mode", ["lagged", "sync"])
def test_predicted_theta_is_the_expected_tokens_over_the_predicted_step(mode: str) -> None:
    """A step's predicted Θ is its expected committed tokens over its predicted seconds, the
    drafter included: selective lagged prices SPS without the drafter (row_priced_sps adds it
    per row), and its step records read a forward-only Θ, about 1.5x the realised rate on the
    CPU engine (c = 8 and 64) where sync's was within 7 %."""
    from dspark_sglang.algo.capacity import CapacityModel, Curve, TableModel
    from dspark_sglang.algo.survival import AcceptancePrior, sts_confidences, survival
    from dspark_sglang.algo.verify_budget import parse_schedule_mode
    from dspark_sglang.engine.planner import VerifyPlanner

    draft = Curve((1.0, 64.0), (0.01, 0.2))
    cap = CapacityModel(TableModel((1, 256), (0.02, 0.06)), draft=draft)
    p = VerifyPlanner(parse_schedule_mode(mode), 4, cap, None, False, 0.0, False, True)
    p.prior = AcceptancePrior.uniform(4, rate=0.9)
    logits = np.array([[3.0, 2.0, 1.0, 0.0], [2.0, 2.0, 2.0, 2.0], [4.0, 3.0, -1.0, -2.0]])
    ids, max_len = [1, 2, 3], np.array([4, 4, 4])
    k = p.budget(ids, max_len, 30) if p.plans_before_drafting else None
    assert p.draft_rows(ids, k, max_len) is None if k else True  # every row drafted
    plan = p.plan(ids, logits, max_len, 30, k)
    assert plan.k > 0
    surv = survival(sts_confidences(logits, None))
    admitted = np.arange(4)[None, :] < plan.lengths[:, None]
    tokens = 3 + float(surv[admitted].sum())
    seconds = cap.predict(3, 3 + plan.k, 30, drafted=True)
    assert plan.predicted_seconds == pytest.approx(seconds)
    assert seconds > cap.predict(3, 3 + plan.k, 30)  # the drafter is in it
    assert plan.predicted_theta == pytest.approx(tokens / seconds, rel=1e-9)
    p.close()


@pytest.mark.parametrize("overlap", [False, True])
def test_absent_requests_read_the_pool_when_the_whole_batch_is_drafted(overlap: bool) -> None:
    """Eight fresh requests, and a pool of recent rows of which half were confident and half not.
    Read as the pool's mean (a prior with the same mean survival) no K pays: verifying the same
    share of every row's drafts costs the forward more than it earns. Read as the pool's spread,
    the live top-K verifies the confident half only (K = 16 at B = 24): drafting every row pays,
    and draft_rows says so (None: all of them). Without the pool (fewer than POOL_MIN rows), or
    with a pool of identical rows, K stays 0."""
    from dspark_sglang.algo.capacity import CapacityModel, Curve, TableModel
    from dspark_sglang.algo.survival import AcceptancePrior
    from dspark_sglang.algo.verify_budget import parse_schedule_mode
    from dspark_sglang.engine.planner import POOL_MIN, VerifyPlanner

    draft = Curve((1.0, 64.0), (0.005, 0.068))  # 5 ms + 1 ms per row
    buckets = tuple(range(1, 257))  # every B its own bucket: 80 ms + 10 ms per token
    cap = CapacityModel(TableModel(buckets, tuple(0.07 + 0.01 * b for b in buckets)), draft=draft)
    mode = parse_schedule_mode("lagged")
    old, fresh, max_len = list(range(8)), list(range(100, 108)), np.full(8, 4)

    def planner(logits: np.ndarray, probes: int) -> VerifyPlanner:
        p = VerifyPlanner(mode, 4, cap, None, False, 0.0, overlap, True)
        for _ in range(probes):  # probes of every row: unselected rows for the pool
            p.plan(old, logits, max_len, 80, 0)
        mean = p._pool.mean(axis=0) if p._pool.size else np.full(4, 0.5)
        rates = mean / np.concatenate([[1.0], mean[:-1]])
        p.prior = replace(AcceptancePrior.uniform(4), rates=tuple(float(x) for x in rates))
        p.skip(fresh, max_len, 80)  # the plan for the fresh batch, from the history
        return p

    split = np.array([[6.0] * 4] * 4 + [[-6.0] * 4] * 4)
    p = planner(split, probes=POOL_MIN // 8)
    k = p.budget(fresh, max_len, 80)
    assert k > 0 and p.draft_rows(fresh, k, max_len) is None
    assert p.history.lagged_with_hits(np.array(fresh), 2, p.prior)[1].sum() == 0  # all absent
    assert not p.plan(fresh, split, max_len, 80, k).explored  # the best plan, not exploration
    p.close()
    few = planner(split, probes=POOL_MIN // 8 - 1)
    assert few.budget(fresh, max_len, 80) == 0
    few.close()
    even = planner(np.zeros((8, 4)), probes=POOL_MIN // 8)  # every row alike: the mean is exact
    assert even.budget(fresh, max_len, 80) == 0
    even.close()


@pytest.mark.parametrize("overlap", [False, True])
def test_whole_batch_drafting_is_explored_while_its_price_is_untested(overlap: bool) -> None:
    """Eight requests whose lagged survival is 0.5, 0.25, …: drafting them all is priced at 0.93
    of decoding plainly (K = 8 at B = 16), so K = 0 is the best plan. While no drafting step timed
    the drafter at R = 8 the whole batch is drafted anyway (within EXPLORE_RATIO), once
    CAP_MIN_RECORDS did, K = 0; a drafter priced far above the plain step (0.68 of it) is not
    explored; and without a live estimator, or with --explore-ratio 0, nothing is."""
    from dspark_sglang.algo.capacity import CapacityModel, Curve, TableModel
    from dspark_sglang.algo.capacity_fit import CAP_MIN_RECORDS
    from dspark_sglang.algo.verify_budget import parse_schedule_mode
    from dspark_sglang.config import ConfigError, DraftConfig
    from dspark_sglang.engine.planner import EXPLORE_RATIO, VerifyPlanner
    from dspark_sglang.types import StepRecord

    buckets = tuple(range(1, 257))  # every B its own bucket: 70 ms + 10 ms per token
    table = TableModel(buckets, tuple(0.07 + 0.01 * b for b in buckets))
    mode = parse_schedule_mode("lagged")
    ids, max_len, logits = list(range(8)), np.full(8, 4), np.zeros((8, 4))

    def planner(draft: Curve, live: bool = True, ratio: float = EXPLORE_RATIO) -> VerifyPlanner:
        cap = CapacityModel(table, draft=draft)
        p = VerifyPlanner(mode, 4, cap, None, live, 0.0, overlap, True, ratio)
        for _ in range(2):  # every row drafted and verified: lagged survival 0.5, 0.25, …
            p.plan(ids, logits, max_len, 80, 0)
        p.skip(ids, max_len, 80)  # plans the next K (on the thread, with overlap)
        return p

    cheap = Curve((1.0, 64.0), (0.005, 0.068))  # 5 ms + 1 ms per row: 13 ms for 8 rows
    assert EXPLORE_RATIO * 8 / 0.15 <= (8 + 8 * 0.5) / (0.07 + 0.16 + 0.013)
    p = planner(cheap)
    k = p.budget(ids, max_len, 80)
    assert k == 8 and p.draft_rows(ids, k, max_len) is None  # every row
    assert p.plan(ids, logits, max_len, 80, k).explored  # StepRecord.explored: bench.step_kinds
    assert p.estimator is not None
    for t in range(CAP_MIN_RECORDS):
        p.estimator.observe(
            StepRecord(t, 8, 16, 0, 8, 640, 0.243, draft_seconds=0.013, num_draft_reqs=8)
        )
    p.skip(ids, max_len, 80)
    assert p.budget(ids, max_len, 80) == 0  # tested: the plain step is the better plan
    p.close()
    dear = planner(Curve((1.0, 64.0), (0.1, 0.163)))
    assert dear.budget(ids, max_len, 80) == 0
    dear.close()
    fixed = planner(cheap, live=False)
    assert fixed.budget(ids, max_len, 80) == 0
    fixed.close()
    off = planner(cheap, ratio=0.0)  # --explore-ratio 0
    assert off.budget(ids, max_len, 80) == 0
    off.close()
    assert DraftConfig().explore_ratio == EXPLORE_RATIO  # the server's default is the planner's
    with pytest.raises(ConfigError, match="--explore-ratio"):
        DraftConfig(explore_ratio=1.5)
    for bad in (-0.1, 1.0, math.nan):
        with pytest.raises(ConfigError, match="--plan-tie-margin"):
            DraftConfig(tie_margin=bad)


@pytest.mark.parametrize("overlap", [False, True])
def test_exploration_starts_a_burst_only_within_its_budget(overlap: bool) -> None:
    """The setting above (whole-batch drafting at R = 8 explored while untested). A first
    explored step that took 0.5 s where the plain step is priced 0.15 s loses 0.35 s; the burst
    it opened still runs its EXPLORE_BURST steps (what teaches the price), then no burst starts
    while 0.35 s is more than EXPLORE_BUDGET of the seconds observed, and one starts again once
    the plain steps observed since make it so. With --explore-budget 1 nothing caps it; with 0
    only bursts that lost nothing go on."""
    from dspark_sglang.algo.capacity import CapacityModel, Curve, TableModel
    from dspark_sglang.algo.verify_budget import parse_schedule_mode
    from dspark_sglang.config import ConfigError, DraftConfig
    from dspark_sglang.engine.planner import EXPLORE_BUDGET, EXPLORE_BURST, VerifyPlanner
    from dspark_sglang.types import StepRecord

    buckets = tuple(range(1, 257))  # every B its own bucket: 70 ms + 10 ms per token
    table = TableModel(buckets, tuple(0.07 + 0.01 * b for b in buckets))
    cheap = Curve((1.0, 64.0), (0.005, 0.068))
    mode = parse_schedule_mode("lagged")
    ids, max_len, logits = list(range(8)), np.full(8, 4), np.zeros((8, 4))
    none = np.empty(0, np.int64)
    plain_theta = 8 / 0.15  # the model's plain step at R = 8: 0.15 s

    def explored(seconds: float) -> StepRecord:
        # no draft_seconds: these records stay out of the estimator (fold below), so the
        # drafter's price at R = 8 stays untested and only the budget decides
        return StepRecord(0, 8, 16, 0, 8, 640, seconds, explored=True, plain_theta=plain_theta)

    def planner(budget: float) -> VerifyPlanner:
        cap = CapacityModel(table, draft=cheap)
        p = VerifyPlanner(mode, 4, cap, None, True, 0.0, overlap, True, explore_budget=budget)
        p.fold = 10**9
        for _ in range(2):  # every row drafted and verified: lagged survival 0.5, 0.25, …
            p.plan(ids, logits, max_len, 80, 0)
        p.skip(ids, max_len, 80)
        return p

    def burst(p: VerifyPlanner) -> None:  # a first step that loses 0.35 s, then steps that pay
        # with overlap the next K is planned while a step runs, before its record is observed:
        # the burst's last record reaches the budget a step later
        for i in range(EXPLORE_BURST + overlap):
            k = p.budget(ids, max_len, 80)
            assert k == 8 and p.plan(ids, logits, max_len, 80, k).explored
            p.observe(none, none, explored(0.5 if i == 0 else 0.15))

    p = planner(EXPLORE_BUDGET)
    burst(p)
    assert p.state()["explore_lost_s"] == pytest.approx(0.35)
    assert p.budget(ids, max_len, 80) == 0  # 0.35 s lost > 1 % of the 1.1-1.25 s observed
    p.skip(ids, max_len, 80)
    plain = StepRecord(1, 8, 8, 0, 8, 640, 0.15)
    for _ in range(round(0.35 / EXPLORE_BUDGET / 0.15)):
        p.observe(none, none, plain)
    p.skip(ids, max_len, 80)
    assert p.budget(ids, max_len, 80) == 8  # 0.35 s <= 1 % of the 36 s observed
    assert p.state()["explore_lost_share"] <= EXPLORE_BUDGET
    p.close()
    uncapped = planner(1.0)
    burst(uncapped)
    assert uncapped.budget(ids, max_len, 80) == 8
    uncapped.close()
    strict = planner(0.0)
    burst(strict)
    assert strict.budget(ids, max_len, 80) == 0
    strict.close()
    assert DraftConfig().explore_budget == EXPLORE_BUDGET  # the server's default is the planner's
    for bad in (-0.01, 1.5, math.nan):
        with pytest.raises(ConfigError, match="--explore-budget"):
            DraftConfig(explore_budget=bad)


def _live_lagged_planner() -> tuple[CapacityModel, VerifyPlanner, LiveEstimator]:
    """A lagged planner (γ = 4) with a live estimator on a small table model, and a reference
    estimator on the same model to feed record by record."""
    from dspark_sglang.algo.capacity import Curve, TableModel
    from dspark_sglang.algo.verify_budget import parse_schedule_mode

    buckets = (1, 2, 4, 8, 16)
    cap = CapacityModel(
        TableModel(buckets, tuple(0.002 + 0.001 * b for b in buckets)),
        draft=Curve((1.0, 64.0), (0.003, 0.01)),
    )
    p = VerifyPlanner(parse_schedule_mode("lagged"), 4, cap, None, True, 0.0, False, True)
    assert p.estimator is not None
    return cap, p, LiveEstimator(cap)


def test_plain_step_records_reach_the_estimator_in_folds_in_step_order() -> None:
    """Records of steps that did not draft wait until FOLD_RECORDS are queued; a drafting step's
    record that is news (here: no plan() before it, so no steady drafting run) feeds the queue
    and itself at once, and close() feeds what is left. The estimator ends exactly where one
    fed record by record ends, and the planner holds the model it last published."""
    from dspark_sglang.engine.planner import FOLD_RECORDS
    from dspark_sglang.types import StepRecord

    _, p, ref = _live_lagged_planner()
    none = np.zeros(0, np.int64)
    rng = np.random.default_rng(0)

    def rec(t: int, drafted: bool) -> StepRecord:
        y = 0.003 * (2.0 if t > 40 else 1.0) * rng.uniform(0.95, 1.05)  # a 2x drift at t = 41
        if drafted:
            return StepRecord(t, 1, 4, 0, 1, 100 + t, 2 * y + 0.004, draft_seconds=0.004)
        return StepRecord(t, 1, 1, 0, 1, 100 + t, y)

    published = None
    for t in range(FOLD_RECORDS - 1):
        r = rec(t, False)
        p.observe(none, none, r)
        published = ref.observe(r) or published
    assert p.estimator.num_observed == 0  # queued
    r = rec(FOLD_RECORDS - 1, False)
    p.observe(none, none, r)
    published = ref.observe(r) or published
    assert p.estimator.num_observed == FOLD_RECORDS
    for t in range(FOLD_RECORDS, 3 * FOLD_RECORDS + 3):
        drafted = t == 2 * FOLD_RECORDS + 1
        r = rec(t, drafted)
        p.observe(np.array([3]) if drafted else none, np.array([2]) if drafted else none, r)
        published = ref.observe(r) or published
        if drafted:  # fed with the plain records before it, in order
            assert p.estimator.num_observed == t + 1
            assert p.estimator.drafts_timed(1) == ref.drafts_timed(1) == 1
    assert p.estimator.num_observed < ref.num_observed
    p.close()
    assert p.estimator.num_observed == ref.num_observed
    assert p.estimator.drift_events == ref.drift_events >= 1
    assert published is not None and p.capacity.version == published.version
    assert p.capacity.predict(1, 1, 150) == pytest.approx(published.predict(1, 1, 150))


def test_steady_drafting_records_fold_once_their_price_is_tested() -> None:
    """A drafting step's record goes to the estimator at once while fewer than CAP_MIN_RECORDS
    drafting steps timed its R, and as the first of a drafting run (after a plain step); steady
    drafting steps at a tested R wait for the fold like plain ones. The estimator ends where one
    fed record by record ends."""
    from dspark_sglang.algo.capacity_fit import CAP_MIN_RECORDS
    from dspark_sglang.engine.planner import FOLD_RECORDS
    from dspark_sglang.types import StepRecord

    cap, p, ref = _live_lagged_planner()
    ids, max_len, conf = [7], np.array([4]), np.full((1, 4), 2.0)
    rng = np.random.default_rng(1)
    fed: list[int] = []  # estimator records after each step
    published = [cap]

    def step(t: int, drafted: bool) -> None:
        y = 0.003 * rng.uniform(0.97, 1.03)
        if drafted:
            p.plan(ids, conf, max_len, 100 + t, k=2)
            r = StepRecord(
                t, 1, 3, 0, 1, 100 + t, 2 * y + 0.004, draft_seconds=0.004, num_draft_reqs=1
            )
            p.observe(np.array([2]), np.array([1]), r, ids)
        else:
            p.skip(ids, max_len, 100 + t)
            r = StepRecord(t, 1, 1, 0, 1, 100 + t, y)
            p.observe(np.zeros(0, np.int64), np.zeros(0, np.int64), r)
        published.append(ref.observe(r) or published[-1])
        fed.append(p.estimator.num_observed)

    for t in range(CAP_MIN_RECORDS):  # untested: each at once
        step(t, True)
        assert fed[-1] == t + 1 and p.estimator.drafts_timed(1) == t + 1
    for t in range(CAP_MIN_RECORDS, CAP_MIN_RECORDS + 5):  # steady at a tested R: folded
        step(t, True)
    assert fed[-1] == CAP_MIN_RECORDS
    step(CAP_MIN_RECORDS + 5, False)
    assert fed[-1] == CAP_MIN_RECORDS
    step(CAP_MIN_RECORDS + 6, True)  # the first drafting step after a plain one: at once
    assert fed[-1] == CAP_MIN_RECORDS + 7
    for t in range(CAP_MIN_RECORDS + 7, CAP_MIN_RECORDS + 7 + FOLD_RECORDS):
        step(t, True)
    assert fed[-1] == CAP_MIN_RECORDS + 7 + FOLD_RECORDS  # a full fold went in
    assert fed[-2] == CAP_MIN_RECORDS + 7
    for t in range(CAP_MIN_RECORDS + 7 + FOLD_RECORDS, 48):
        step(t, t % 7 != 0)
    assert p.estimator.num_observed < ref.num_observed
    p.close()
    assert p.estimator.num_observed == ref.num_observed
    assert p.estimator.drafts_timed(1) == ref.drafts_timed(1)
    assert p.capacity.version == published[-1].version > cap.version
    assert p.capacity.predict(1, 3, 150) == pytest.approx(published[-1].predict(1, 3, 150))


@given(
    st.lists(st.floats(0.05, 0.99), min_size=4, max_size=24),
    st.floats(0.0, 0.02),
    st.floats(0.0, 0.004),
)
def test_the_planned_tokens_of_a_selective_k_are_its_top_k_survival(
    conf: list[float], fixed: float, per_row: float
) -> None:
    """The planner reads the tokens a selective K was planned on off the search's Θ (one
    multiplication instead of another top-K pass): the same number as planned_tokens."""
    from dspark_sglang.algo import verify_budget as vb
    from dspark_sglang.engine.planner import _planned

    r = len(conf) // 4
    surv = survival(np.asarray(conf[: 4 * r]).reshape(r, 4))
    sps = 1.0 / (0.004 + 0.0002 * np.arange(r * 5 + 1))
    draft = fixed + per_row * np.arange(r + 1)
    draft[0] = 0.0
    k, rows, theta = vb.selective_k(surv, sps, draft)
    got = _planned(theta, sps, r, k, float(draft[rows.size]))
    if k == 0:
        assert np.isnan(got)
    else:
        assert got == pytest.approx(vb.planned_tokens(surv, k), rel=1e-9)


def test_a_resumed_drafter_teaches_the_switch_price_and_a_prompt_backlog_does_not() -> None:
    """resume_ratio folds (drafter seconds / the average steady run of as many rows - 1) of
    drafting steps that resumed after plain steps, capped at RESUME_MAX: the first at full
    weight, then averaged, and none before RESUME_MIN_STEADY steady runs were timed (the draft
    term is not the yardstick: here it prices 4 ms where the drafter takes 2). A drafting step
    after a drafting step, and a resumed one that also projected a prompt's rows, teach
    nothing."""
    from dspark_sglang.algo.capacity import CapacityModel, Curve, TableModel
    from dspark_sglang.algo.verify_budget import parse_schedule_mode
    from dspark_sglang.engine.planner import RESUME_MAX, RESUME_MIN_STEADY, VerifyPlanner
    from dspark_sglang.types import StepRecord

    cap = CapacityModel(TableModel((1, 64), (0.01, 0.02)), draft=Curve((1.0, 64.0), (0.004, 0.1)))
    p = VerifyPlanner(parse_schedule_mode("lagged"), 4, cap, None, False, 0.0, False, True)
    ids, logits, max_len = [7], np.zeros((1, 4)), np.array([4])
    steady = 0.002

    def drafting(seconds: float, backlog: bool = False) -> None:
        p.plan(ids, logits, max_len, 10, 3, backlog=backlog)
        rec = StepRecord(0, 1, 4, 0, 1, 10, 0.03, draft_seconds=seconds, num_draft_reqs=1)
        p.observe(np.array([3]), np.array([1]), rec, ids)

    p.skip(ids, max_len, 10)
    drafting(3 * steady)  # resumed, but no steady run to compare with
    for _ in range(RESUME_MIN_STEADY):
        drafting(steady)
    p.skip(ids, max_len, 10)
    drafting(5 * steady, backlog=True)
    assert p.resume_ratio == 0.0
    p.skip(ids, max_len, 10)
    drafting(1.5 * steady)
    assert p.resume_ratio == pytest.approx(0.5)
    drafting(steady)  # follows a drafting step: steady, and it keeps the average
    p.skip(ids, max_len, 10)
    p.skip(ids, max_len, 10)
    drafting(9 * steady)
    assert p.resume_ratio == pytest.approx((0.5 + RESUME_MAX) / 2)


def _break_even_drafter() -> tuple[object, list[int], np.ndarray, np.ndarray, float]:
    """One confident request on a table where B = 1 costs 10 ms and B = 2 … 64 20 ms (K = 4 if it
    pays): the table, the request's ids, caps and confidence logits, and the drafter price at
    which K = 4 ties K = 0 (one token a 10 ms step)."""
    from dspark_sglang.algo.capacity import TableModel
    from dspark_sglang.algo.verify_budget import parse_schedule_mode
    from dspark_sglang.engine.planner import VerifyPlanner

    table = TableModel((1, 64), (0.01, 0.02))
    ids, max_len, logits = [7], np.array([4]), np.full((1, 4), 4.0)
    probe = VerifyPlanner(
        parse_schedule_mode("lagged"), 4, CapacityModel(table), None, False, 0.0, False
    )
    probe.plan(ids, logits, max_len, 10, 0)
    tau = 1.0 + float(probe.history.lagged(np.array(ids), 1, probe.prior).sum())
    return table, ids, max_len, logits, tau / 100.0 - 0.02


@pytest.mark.parametrize("selective", [True, False])
def test_a_skip_in_a_drafting_run_is_charged_the_resume_it_causes(selective: bool) -> None:
    """With a learned resume excess, a K search in a drafting run charges it to K = 0 (whose
    resume comes later): a drafter priced a little over break-even keeps drafting once drafting.
    Leaving a plain run (here after two probes) is not charged: a drafter a little under
    break-even drafts either way. Without the excess both follow the price."""
    from dspark_sglang.algo.capacity import CapacityModel, Curve
    from dspark_sglang.algo.verify_budget import parse_schedule_mode
    from dspark_sglang.engine.planner import VerifyPlanner

    table, ids, max_len, logits, even = _break_even_drafter()
    mode = parse_schedule_mode("lagged")

    def k_of(draft_s: float, ratio: float, drafting_run: bool) -> int:
        cap = CapacityModel(table, draft=Curve((1.0, 64.0), (draft_s, draft_s)))
        p = VerifyPlanner(mode, 4, cap, None, False, 0.0, False, selective)
        p.plan(ids, logits, max_len, 10, 0)  # two probes: a lag-2 snapshot, a plain run
        p.plan(ids, logits, max_len, 10, 0)
        p.resume_ratio = ratio
        if drafting_run:
            p._drafting_run, p._last_rows = 1, 1
        return p.budget(ids, max_len, 10)

    cheap, dear = 0.9 * even, 1.1 * even
    assert k_of(cheap, 0.0, False) == 4 and k_of(dear, 0.0, True) == 0  # no excess learned
    assert k_of(dear, 0.5, True) == 4  # skipping now costs a resume later: keep drafting
    assert k_of(cheap, 0.5, False) == 4  # leaving a plain run is not charged
    assert k_of(dear, 0.5, False) == 0


@pytest.mark.parametrize("selective", [True, False])
def test_leaving_a_plain_run_is_charged_its_queued_context_over_the_steps_left(
    selective: bool,
) -> None:
    """A drafter priced under break-even drafts, unless the plain run queued context rows whose
    projection its requests have too few steps left to pay back (FLUSH_MIN_ROWS): then K = 0.
    The same backlog with many steps left, one too short to matter, no flush timed yet, or the
    charge turned off: it drafts."""
    from dspark_sglang.algo.capacity import CapacityModel, Curve
    from dspark_sglang.algo.verify_budget import parse_schedule_mode
    from dspark_sglang.engine.planner import VerifyPlanner

    table, ids, max_len, logits, even = _break_even_drafter()
    mode = parse_schedule_mode("lagged")

    def k_of(queued: int, left: int, row_s: float = 20e-6, charge: bool = True) -> int:
        cap = CapacityModel(table, draft=Curve((1.0, 64.0), (0.9 * even, 0.9 * even)))
        p = VerifyPlanner(mode, 4, cap, None, False, 0.0, False, selective, resume_charge=charge)
        p.plan(ids, logits, max_len, 10, 0)
        p.plan(ids, logits, max_len, 10, 0)
        if row_s:
            p.observe_flush(1000, 1000 * row_s)
        p.note_queue([queued], [left])
        return p.budget(ids, max_len, 10)

    # a drafter at 0.9 of break-even (28 ms) leaves 2.8 ms a step; 256 rows x 20 us = 5.1 ms
    assert k_of(256, 2) == 0  # one step left to pay it back
    assert k_of(256, 512) == 4  # RESUME_HORIZON steps: 0.08 ms a step
    assert k_of(2, 2) == 4  # one drafting step's rows: no backlog
    assert k_of(256, 2, row_s=0.0) == 4  # nothing timed: nothing charged
    assert k_of(256, 2, charge=False) == 4


def test_the_resume_charge_follows_backlog_horizon_and_flushes_on_a_coarse_grid() -> None:
    """_resume_row_s = backlog rows beyond one drafting step's x seconds per row / steps left
    (at most RESUME_HORIZON), on powers of two; flushes under FLUSH_MIN_ROWS teach nothing."""
    from dspark_sglang.algo.capacity import CapacityModel, TableModel
    from dspark_sglang.algo.verify_budget import parse_schedule_mode
    from dspark_sglang.engine.planner import FLUSH_MIN_ROWS, RESUME_HORIZON, VerifyPlanner

    cap = CapacityModel(TableModel((1, 64), (0.01, 0.02)))
    p = VerifyPlanner(
        parse_schedule_mode("lagged"), 4, cap, None, False, 0.0, False, True, resume_charge=True
    )
    p.note_queue([130, 130], [1000, 1000])
    assert p._resume_row_s() == 0.0  # no flush timed yet
    p.observe_flush(FLUSH_MIN_ROWS - 1, 1.0)
    assert p.flush_row_seconds == 0.0
    p.observe_flush(1000, 0.016)  # 16 us a row
    assert p.flush_row_seconds == pytest.approx(16e-6)
    per_step = 1.0 + float(p.prior.survival.sum())  # 1 + 4 x 0.5-ish survival
    backlog = 2.0 ** round(np.log2(130 - per_step))  # 128
    long = p._resume_row_s()
    assert long == pytest.approx(2.0 ** round(np.log2(backlog * 16 / RESUME_HORIZON)) * 1e-6)
    p.note_queue([130, 130], [2, 2])  # about one step left
    assert p._resume_row_s() == pytest.approx(2.0 ** round(np.log2(backlog * 16)) * 1e-6)
    p.note_queue([131, 129], [1000, 1000])  # the backlog grew a row: the same charge
    assert p._resume_row_s() == long
    p.note_queue([2, 2], [1000, 1000])  # fewer rows than a drafting step makes
    assert p._resume_row_s() == 0.0
    assert p.state()["flush_row_seconds"] == pytest.approx(16e-6)


def test_the_skip_charge_is_spread_over_the_average_plain_run() -> None:
    """One resume per plain run: a K = 0 step in a drafting run is charged the resume over the
    average length of the plain runs that ended so far (probes count as plain steps)."""
    from dspark_sglang.algo.capacity import CapacityModel, Curve, TableModel
    from dspark_sglang.algo.verify_budget import parse_schedule_mode
    from dspark_sglang.engine.planner import VerifyPlanner

    cap = CapacityModel(TableModel((1, 64), (0.01, 0.02)), draft=Curve((1.0, 64.0), (0.004, 0.1)))
    p = VerifyPlanner(parse_schedule_mode("lagged"), 4, cap, None, False, 0.0, False, True)
    ids, logits, max_len = [7], np.zeros((1, 4)), np.array([4])
    p.resume_ratio = 0.6
    assert p._skip_charge(1) == 0.0  # not in a drafting run
    for _ in range(9):
        p.skip(ids, max_len, 10)
    p.plan(ids, logits, max_len, 10, 0)  # a probe: the tenth plain step
    p.plan(ids, logits, max_len, 10, 3)
    assert p._skip_charge(1) == pytest.approx(0.6 * 0.004 / 10)
    p.skip(ids, max_len, 10)
    assert p._skip_charge(1) == 0.0
    p.plan(ids, logits, max_len, 10, 3)  # a plain run of 1 folds in: (10 + 1) / 2
    assert p._skip_charge(1) == pytest.approx(0.6 * 0.004 / 5.5)


def test_the_planner_state_reports_what_it_learned() -> None:
    """state() (GET /capacity's `planner`): the prior, both corrections, the switch price and
    the probe gap as they stand, JSON-ready, moving with what the planner observes."""
    import json

    from dspark_sglang.algo.capacity import CapacityModel, Curve, TableModel
    from dspark_sglang.algo.verify_budget import parse_schedule_mode
    from dspark_sglang.engine.planner import PROBE_MIN, VerifyPlanner
    from dspark_sglang.types import StepRecord

    cap = CapacityModel(TableModel((1, 64), (0.01, 0.02)), draft=Curve((1.0, 64.0), (0.004, 0.1)))
    p = VerifyPlanner(parse_schedule_mode("lagged"), 4, cap, None, False, 0.0, False, True)
    before = p.state()
    assert before["mode"] == "lagged" and before["prior_rates"] == [0.5] * 4
    assert before["confidence_ratios"] == [1.0] * 4 and before["survival_ratios"] == [1.0] * 4
    assert before["probe_every"] == PROBE_MIN and before["resume_ratio"] == 0.0
    ids, max_len = [7], np.array([4])
    p.plan(ids, np.full((1, 4), -2.0), max_len, 10, 4)  # confidences ~0.12, all four accepted
    rec = StepRecord(0, 1, 5, 0, 1, 10, 0.03, draft_seconds=0.002, num_draft_reqs=1)
    p.observe(np.array([4]), np.array([4]), rec, ids)
    after = json.loads(json.dumps(p.state()))
    assert all(a > 0.5 for a in after["prior_rates"]) and after["prior_trials"] == [1.0] * 4
    assert all(r > 1.0 for r in after["confidence_ratios"])


@pytest.mark.parametrize("shrinks", [True, False])
def test_lagged_k_reads_a_pessimistic_lagged_row_as_far_as_such_rows_held_up(
    shrinks: bool,
) -> None:
    """A lagged row far below the average makes K = 0 at face value; once LagShrink has learned
    that such departures did not hold two steps later (ρ = 0), K reads the average row and drafts.
    With lag shrinking off the planner plans at face value whatever ρ says."""
    from dspark_sglang.algo.capacity import CapacityModel, Curve, TableModel
    from dspark_sglang.algo.survival import AcceptancePrior, LagShrink
    from dspark_sglang.algo.verify_budget import parse_schedule_mode
    from dspark_sglang.engine.planner import VerifyPlanner

    # a forward of 10-20 ms, and a drafter adding 10 ms: drafting pays from ~1 accepted draft
    cap = CapacityModel(TableModel((1, 64), (0.01, 0.02)), draft=Curve((1.0, 64.0), (0.01, 0.01)))
    mode = parse_schedule_mode("lagged")
    p = VerifyPlanner(mode, 4, cap, None, False, 0.0, False, lag_shrink=shrinks)
    p.prior = AcceptancePrior((0.9, 0.9, 0.9, 0.9), trials=(100.0,) * 4)
    low = np.array([[0.2, 0.04, 0.01, 0.0]])
    for _ in range(mode.lag):
        p.history = p.history.push(np.array([7]), low)
    ids, max_len = [7], np.array([4])
    assert p.budget(ids, max_len, 10) == 0  # nothing learned yet: face value
    # departures from the average that came to nothing: y stays 0 whatever x was
    p.lag_fit = LagShrink(n=100.0, sx=0.0, sy=0.0, sxx=100.0, sxy=-8.0)
    assert p.lag_fit.rho == 0.0 and p.state()["lag_shrink"] == 0.0
    assert (p.budget(ids, max_len, 10) > 0) is shrinks
    assert p.state()["lag_shrink_applied"] is shrinks


@pytest.mark.parametrize("shrinks", [True, False])
def test_planner_state_is_strict_json_before_anything_was_learned(shrinks: bool) -> None:
    """GET /capacity returns the state as JSON that refuses NaN (a 500 otherwise)."""
    import json

    from dspark_sglang.algo.capacity import CapacityModel, TableModel
    from dspark_sglang.algo.verify_budget import parse_schedule_mode
    from dspark_sglang.engine.planner import VerifyPlanner

    cap = CapacityModel(TableModel((1, 64), (0.01, 0.02)))
    p = VerifyPlanner(
        parse_schedule_mode("lagged"), 4, cap, None, True, 0.0, False, lag_shrink=shrinks
    )
    state = p.state()
    assert state["lag_slope"] is None
    json.dumps(state, allow_nan=False)


def test_observe_feeds_lag_shrink_the_row_this_steps_k_was_planned_from() -> None:
    """observe() runs after plan() pushed this step's own survival: the row K read is `lag + 1`
    pushes back, and only verified rows that had one are folded in."""
    from dspark_sglang.algo.capacity import CapacityModel, TableModel
    from dspark_sglang.algo.survival import AcceptancePrior
    from dspark_sglang.algo.verify_budget import parse_schedule_mode
    from dspark_sglang.engine.planner import VerifyPlanner

    cap = CapacityModel(TableModel((1, 64), (0.01, 0.02)))
    mode = parse_schedule_mode("lagged")
    off = VerifyPlanner(mode, 2, cap, None, False, 0.0, False)
    p = VerifyPlanner(mode, 2, cap, None, False, 0.0, False, lag_shrink=True)
    p.prior = off.prior = AcceptancePrior((0.5, 0.5), trials=(100.0,) * 2)  # center [0.5, 0.25]
    p.history = p.history.push(np.array([3]), np.array([[0.9, 0.8]]))  # the row K read (lag 2)
    p.history = p.history.push(np.array([3]), np.array([[0.1, 0.0]]))
    p.history = p.history.push(np.array([3, 4]), np.array([[0.1, 0.0], [0.1, 0.0]]))  # this step
    off.history = p.history
    for q in (p, off):
        q.observe_acceptance(np.array([2, 2]), np.array([2, 0]), [3, 4])  # 4 had no lagged row
    assert off.lag_fit.n == 0.0  # off: nothing learned, nothing paid
    fit = p.lag_fit
    assert fit.n == pytest.approx(1.0)
    assert fit.sx == pytest.approx(0.9 + 0.8 - 0.75) and fit.sy == pytest.approx(2 - 0.75)


def test_lagged_k_reads_the_calibrated_survival_and_observe_teaches_the_calibration() -> None:
    """plan() pushes survival after all three stages to the history K reads: a calibration that
    learned the head's 0.03 tail drafts realise 0.2 makes K verify them; with the identity K
    drops them. observe() folds every verified position into the calibration, and state()
    reports its map."""
    import json

    from dspark_sglang.algo.capacity import CapacityModel, TableModel
    from dspark_sglang.algo.survival import CALIB_EDGES, SurvivalCalibration
    from dspark_sglang.algo.verify_budget import parse_schedule_mode
    from dspark_sglang.engine.planner import VerifyPlanner
    from dspark_sglang.types import StepRecord

    # 10 ms plus 0.16 ms a token: a draft pays from a survival of about 0.1
    buckets = tuple(range(1, 17))
    cap = CapacityModel(TableModel(buckets, tuple(0.01 + 1.6e-4 * (b - 1) for b in buckets)))
    mode = parse_schedule_mode("lagged")
    conf = np.array([[0.95, 0.95, 0.95, 0.95], [0.6, 0.05, 0.9, 0.9]])
    logits = np.log(conf / (1.0 - conf))
    ids, max_len = [7, 8], np.array([4, 4])
    learned = SurvivalCalibration.identity()
    b = int(np.searchsorted(CALIB_EDGES, 0.03, side="right")) - 1  # the tail's bin
    num = [0.0] * len(learned.num)
    obs, pred = list(num), list(num)
    num[b], obs[b], pred[b] = 500.0, 100.0, 15.0
    learned = SurvivalCalibration(tuple(pred), tuple(obs), tuple(num))
    assert learned.apply(np.array([[0.03]]))[0, 0] > 0.15
    ks = []
    for cal in (SurvivalCalibration.identity(), learned):
        p = VerifyPlanner(mode, 4, cap, None, False, 0.0, False)
        p.calibration = cal
        for _ in range(mode.lag):
            p.plan(ids, logits, max_len, 10, 8)
        ks.append(p.budget(ids, max_len, 10))
        newest = p.history.snapshots[-1][1]
        np.testing.assert_allclose(newest, cal.apply(p.surv_correction.apply(survival(conf))))
    assert ks[0] == 5 and ks[1] == 8
    before = sum(p.calibration.num)
    rec = StepRecord(0, 2, 10, 0, 2, 10, 0.012, draft_seconds=0.002, num_draft_reqs=2)
    p.observe(np.array([4, 4]), np.array([4, 1]), rec, ids)
    # eight positions verified; three of them in the tail's bin, which decays its 500 by them
    assert sum(p.calibration.num) == pytest.approx(before + 8.0 - 500.0 * (1.0 - 0.998**3))
    state = json.loads(json.dumps(p.state(), allow_nan=False))
    assert state["calibration"]["knots"] == list(p.calibration.knots)
    assert state["calibration"]["values"] == list(p.calibration.values)


@pytest.mark.parametrize("selective", [True, False])
def test_lagged_k_prices_drafting_by_how_drafting_steps_ran_against_plain_ones(
    selective: bool,
) -> None:
    """StepKindBias: where drafting steps at this R ran over their predicted seconds by more than
    plain steps did, a drafter priced a little under break-even no longer drafts; where they ran
    under, one priced a little over does. A bias learned at another R bin changes nothing."""
    from dspark_sglang.algo.capacity import CapacityModel, Curve
    from dspark_sglang.algo.verify_budget import parse_schedule_mode
    from dspark_sglang.engine.planner import VerifyPlanner

    table, ids, max_len, logits, even = _break_even_drafter()
    mode = parse_schedule_mode("lagged")

    def k_of(draft_s: float, draft_ratio: float, at_r: int = 1) -> int:
        cap = CapacityModel(table, draft=Curve((1.0, 64.0), (draft_s, draft_s)))
        p = VerifyPlanner(mode, 4, cap, None, False, 0.0, False, selective)
        p.plan(ids, logits, max_len, 10, 0)
        p.plan(ids, logits, max_len, 10, 0)
        for _ in range(200):
            p.step_bias.observe(at_r, True, draft_ratio * 0.03, 0.03)
            p.step_bias.observe(at_r, False, 0.01, 0.01)
        return p.budget(ids, max_len, 10)

    cheap, dear = 0.95 * even, 1.05 * even
    assert k_of(cheap, 1.0) == 4 and k_of(dear, 1.0) == 0  # no bias: the price decides
    assert k_of(cheap, 1.2) == 0  # drafting steps ran 20 % over, plain ones on time
    assert k_of(dear, 0.8) == 4
    assert k_of(cheap, 1.2, at_r=32) == 4


def test_the_step_bias_prior_prices_drafting_before_any_step_was_measured() -> None:
    """A drafter priced 2 % under break-even drafts with no prior; with the prior (4 %) it waits
    until drafting and plain steps at its R were measured, and drafts again once they agree."""
    from dspark_sglang.algo.capacity import CapacityModel, Curve
    from dspark_sglang.algo.verify_budget import parse_schedule_mode
    from dspark_sglang.engine.planner import VerifyPlanner

    table, ids, max_len, logits, even = _break_even_drafter()
    cap = CapacityModel(table, draft=Curve((1.0, 64.0), (0.98 * even, 0.98 * even)))

    def planner(prior: float) -> VerifyPlanner:
        mode = parse_schedule_mode("lagged")
        p = VerifyPlanner(mode, 4, cap, None, False, 0.0, False, True, step_bias_prior=prior)
        p.plan(ids, logits, max_len, 10, 0)
        p.plan(ids, logits, max_len, 10, 0)
        return p

    assert planner(0.0).budget(ids, max_len, 10) == 4
    p = planner(0.04)
    assert p.budget(ids, max_len, 10) == 0
    for _ in range(2000):
        p.step_bias.observe(1, True, 0.03, 0.03)
        p.step_bias.observe(1, False, 0.01, 0.01)
    assert p.budget(ids, max_len, 10) == 4


def test_observe_teaches_the_step_bias_steady_drafting_and_plain_steps_only() -> None:
    """Steady drafting steps and plain steps teach StepKindBias their measured / predicted
    seconds; probes, a resumed drafter, and steps with prefill tokens do not."""
    import math

    from dspark_sglang.algo.capacity import CapacityModel, Curve, TableModel
    from dspark_sglang.algo.verify_budget import parse_schedule_mode
    from dspark_sglang.engine.planner import VerifyPlanner
    from dspark_sglang.types import StepRecord

    cap = CapacityModel(TableModel((1, 64), (0.01, 0.02)), draft=Curve((1.0, 64.0), (0.004, 0.1)))
    p = VerifyPlanner(parse_schedule_mode("lagged"), 4, cap, None, False, 0.0, False, True)
    ids, logits, max_len = [7], np.zeros((1, 4)), np.array([4])

    def rec(seconds: float, predicted: float, **kw: object) -> StepRecord:
        return StepRecord(0, 1, 4, 0, 1, 10, seconds, predicted_seconds=predicted, **kw)

    def counts() -> tuple[float, float]:
        row = p.step_bias.bins.get(0, [0.0, 0.0, 0.0, 0.0])
        return row[1], row[3]

    p.skip(ids, max_len, 10)
    p.observe(np.zeros(1, np.int64), np.zeros(1, np.int64), rec(0.011, 0.01), ids)
    assert counts() == (0.0, 1.0)  # a plain step
    drafted = {"draft_seconds": 0.004, "num_draft_reqs": 1}
    p.plan(ids, logits, max_len, 10, 3)  # resumed after the plain step
    p.observe(np.array([3]), np.array([1]), rec(0.03, 0.02, draft_resumed=True, **drafted), ids)
    assert counts() == (0.0, 1.0)
    p.plan(ids, logits, max_len, 10, 3)  # steady
    p.observe(np.array([3]), np.array([1]), rec(0.03, 0.02, **drafted), ids)
    assert counts() == (1.0, 1.0)
    p.plan(ids, logits, max_len, 10, 3, backlog=True)  # projected a prompt's rows
    p.observe(np.array([3]), np.array([1]), rec(0.03, 0.02, **drafted), ids)
    p.plan(ids, logits, max_len, 10, 0)  # a probe
    p.observe(np.array([4]), np.array([1]), rec(0.03, 0.02, probe=True, **drafted), ids)
    p.skip(ids, max_len, 10)
    prefill = StepRecord(0, 1, 40, 36, 1, 10, 0.05, predicted_seconds=0.01)
    p.observe(np.zeros(1, np.int64), np.zeros(1, np.int64), prefill, ids)
    assert counts() == (1.0, 1.0)
    assert p.step_bias.bins[0][0] == pytest.approx(math.log(1.5))
    assert p.step_bias.bins[0][2] == pytest.approx(math.log(1.1))
    assert p.state()["step_bias"]["1"]["draft_steps"] == 1.0


def test_the_step_bias_can_be_turned_off() -> None:
    """`--disable-step-bias`: the K search prices by the capacity model alone."""
    from dspark_sglang.algo.capacity import CapacityModel, Curve, TableModel
    from dspark_sglang.algo.verify_budget import parse_schedule_mode
    from dspark_sglang.engine.planner import VerifyPlanner

    cap = CapacityModel(TableModel((1, 64), (0.01, 0.02)), draft=Curve((1.0, 64.0), (0.004, 0.1)))
    mode = parse_schedule_mode("lagged")
    on = VerifyPlanner(mode, 4, cap, None, False, 0.0, False, True)
    off = VerifyPlanner(mode, 4, cap, None, False, 0.0, False, True, step_bias=False)
    for p in (on, off):
        for _ in range(100):
            p.step_bias.observe(1, True, 0.03, 0.02)
            p.step_bias.observe(1, False, 0.01, 0.01)
    assert on._bias(1) == pytest.approx(0.25, abs=1 / 128) and off._bias(1) == 0.0


def test_a_lagged_drafting_plan_carries_the_plain_steps_theta_it_was_weighed_against() -> None:
    """Plan.plain_theta (StepRecord.plain_theta): on a lagged K > 0 step, R over the model's plain
    step (B = R, no drafter) at the step's context; nan on a K = 0 step (a probe) and in sync."""
    from dspark_sglang.algo.capacity import CapacityModel, TableModel
    from dspark_sglang.algo.verify_budget import parse_schedule_mode

    buckets = tuple(range(1, 21))
    cap = CapacityModel(TableModel(buckets, tuple(0.08 + 0.001 * max(0, b - 8) for b in buckets)))
    ids, max_len = [3, 5, 7, 9], np.array([4, 4, 4, 4])
    logits = np.tile(np.array([4.0, -1.0, -1.5, -2.0]), (4, 1))
    p = VerifyPlanner(parse_schedule_mode("lagged"), 4, cap, None, False, 0.0, False, False)
    p.plan(ids, logits, max_len, 40, 0)
    p.plan(ids, logits, max_len, 40, 0)
    k = p.budget(ids, max_len, 40)
    assert k > 0
    plan = p.plan(ids, logits, max_len, 40, k)
    assert plan.plain_theta == pytest.approx(4 / float(cap.predict(4, 4, 40, drafted=False)))
    assert math.isnan(p.plan(ids, logits, max_len, 40, 0).plain_theta)
    sync = VerifyPlanner(parse_schedule_mode("sync"), 4, cap, None, False, 0.0, False, False)
    assert math.isnan(sync.plan(ids, logits, max_len, 40).plain_theta)
