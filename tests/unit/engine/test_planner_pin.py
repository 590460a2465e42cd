"""engine/planner.py: lagged pinned at verify-all (PIN_PLANS, `replan_every`)."""

from __future__ import annotations

import numpy as np
import pytest

from dspark_sglang.algo.capacity import CapacityModel, TableModel
from dspark_sglang.algo.verify_budget import parse_schedule_mode
from dspark_sglang.config import ConfigError, DraftConfig
from dspark_sglang.engine.planner import Plan, VerifyPlanner
from dspark_sglang.types import StepRecord

GAMMA = 4
CHEAP = CapacityModel(TableModel((1, 64), (0.010, 0.011)))  # a verified draft costs ~0.2 %


def lagged(replan_every: int, **kw: object) -> tuple[VerifyPlanner, list[int]]:
    """A lagged planner on a cheap fixed curve, and the list its K searches append to."""
    p = VerifyPlanner(
        parse_schedule_mode("lagged"),
        GAMMA,
        CHEAP,
        None,
        False,
        0.0,
        bool(kw.pop("overlap", False)),
        replan_every=replan_every,
        **kw,  # type: ignore[arg-type]
    )
    searches: list[int] = []
    inner = p._k_from_history

    def spy(*a: object, **k: object) -> object:
        searches.append(p.pinned_steps)
        return inner(*a, **k)  # type: ignore[arg-type]

    p._k_from_history = spy  # type: ignore[method-assign]
    return p, searches


def step(
    p: VerifyPlanner,
    t: int,
    logit: float | np.ndarray = 6.0,
    max_len: np.ndarray | None = None,
) -> tuple[int, Plan]:
    """One engine step: budget, plan on the drafts' confidence logits (one request, or one row
    per request of `logit` [R, GAMMA]), every verified draft accepted."""
    logits = np.full((1, GAMMA), logit) if np.isscalar(logit) else np.asarray(logit)
    r = logits.shape[0]
    ids = list(range(7, 7 + r))
    caps = np.full(r, GAMMA) if max_len is None else max_len
    k = p.budget(ids, caps, 100)
    plan = p.plan(ids, logits, caps, 100, k)
    rec = StepRecord(
        step=t,
        num_reqs=r,
        num_tokens=r + int(plan.lengths.sum()),
        num_prefill_tokens=0,
        num_decode_reqs=r,
        kv_tokens=100,
        step_seconds=0.012,
        draft_seconds=0.002,
        num_draft_reqs=r,
    )
    p.observe(plan.lengths, plan.lengths.copy(), rec, ids)
    return k, plan


def test_two_searches_that_verify_every_draft_pin_the_next_steps_until_every_fourth() -> None:
    """After two K searches in a row that verify every draft of one batch, the next three steps
    verify every draft without a search; of those, the step whose survival the next search
    reads (lag = 2 before it) plans and learns as usual, the others push no survival (the
    history repeats) and leave the acceptance prior alone."""
    p, searches = lagged(4)
    pinned, learned, snap3 = [], [], None
    for t in range(10):
        if t == 5:  # the search reads the snapshot step 3 pushed
            assert p.history.snapshots[-2] is snap3
        before = p.prior
        k, plan = step(p, t)
        assert k == GAMMA and plan.lengths.tolist() == [GAMMA]
        pinned.append(plan.pinned)
        learned.append(p.prior is not before)
        if t == 3:
            snap3 = p.history.snapshots[-1]
    assert searches == [0, 0, 3, 6]  # steps 0, 1, 5 and 9 searched
    assert pinned == [False, False, True, True, True, False, True, True, True, False]
    assert learned == [True, True, False, True, False, True, False, True, False, True]
    assert p.state()["pinned_steps"] == 6 and p.state()["replan_every"] == 4


def test_a_new_batch_or_a_new_capacity_model_ends_the_pin() -> None:
    p, searches = lagged(4)
    step(p, 0)
    step(p, 1)  # pinned from here
    step(p, 2, max_len=np.array([GAMMA - 1]))  # the request's cap shrank: a new batch
    assert len(searches) == 3 and p.pinned_steps == 0
    step(p, 3, max_len=np.array([GAMMA - 1]))  # the second search on that batch: pinned again
    step(p, 4, max_len=np.array([GAMMA - 1]))
    assert len(searches) == 4 and p.pinned_steps == 1
    p.capacity = CapacityModel(TableModel((1, 64), (0.010, 0.011)))  # a live refit published
    step(p, 5, max_len=np.array([GAMMA - 1]))
    assert len(searches) == 5 and p.pinned_steps == 1


def test_a_pinned_k_below_every_draft_verifies_the_drafts_a_search_would() -> None:
    """Two requests and a curve whose step costs three times as much past B = 4: K = 2 every
    step. Pinned, a step verifies the two top drafts by its own survival (those of the request
    confident this step, or one of each), as a planner that searches every step does."""
    dear = CapacityModel(TableModel((2, 4, 5, 64), (0.010, 0.011, 0.030, 0.031)))
    a, b = [6.0] * GAMMA, [0.0] * GAMMA
    turns = [np.array([a, b]), np.array([b, a]), np.array([a, a])]
    plans = {}
    for every in (1, 4):
        p, _ = lagged(every)
        p.capacity = dear
        plans[every] = [step(p, t, turns[t % 3])[1] for t in range(8)]
    assert [x.pinned for x in plans[4]] == [False, False, True, True, True, False, True, True]
    assert {x.k for x in plans[4]} == {2}
    assert {tuple(x.lengths.tolist()) for x in plans[4] if x.pinned} == {(1, 1), (0, 2), (2, 0)}
    assert [x.lengths.tolist() for x in plans[4]] == [x.lengths.tolist() for x in plans[1]]


def test_a_selective_k_that_drafts_some_rows_is_never_pinned() -> None:
    """One confident request among four and a drafter priced by its rows: each search drafts
    that one alone, and a pin would draft every row, so every step searches."""
    from dspark_sglang.algo.capacity import Curve

    cap = CapacityModel(
        TableModel((1, 256), (0.08, 0.08)), draft=Curve((1.0, 64.0), (0.025, 1.285))
    )
    p, searches = lagged(4, selective=True)
    p.capacity = cap
    ids, max_len = [3, 5, 7, 9], np.array([GAMMA] * 4)
    logits = np.array([[4.0] * GAMMA] + [[-4.0] * GAMMA] * 3)
    p.plan(ids, logits, max_len, 40, 0)  # probes of every row: the lag's history
    p.plan(ids, logits, max_len, 40, 0)
    for _ in range(6):
        k = p.budget(ids, max_len, 40)
        keep = p.draft_rows(ids, k, max_len)
        assert k > 0 and keep is not None and keep.tolist() == [0]
        p.plan([3], logits[:1], max_len[:1], 40, k, (ids, max_len, 40))
    assert len(searches) == 6 and p.pinned_steps == 0


def test_lag_shrink_pins_too_and_learns_only_from_rows_lag_steps_old() -> None:
    """With LagShrink a pin holds as without it. Its fit pairs a step's acceptance with the
    snapshot `lag` steps back; a pinned step pushes a repeat, so the pin's planning step and a
    search right after a pin may read rows older than that, and then fold nothing. N = 6:
    searches at 0, 1, 7, 13; the pins' planning steps 5 and 11 read repeats (pushed at 3, 9),
    the searches at 7 and 13 the planning steps' own rows (5, 11); 0 and 1 have no lag yet."""
    p, searches = lagged(6, lag_shrink=True)
    assert p.replan_every == 6
    learned = []
    for t in range(14):
        before = p.lag_fit
        step(p, t)
        learned.append(p.lag_fit is not before)
    assert len(searches) == 4 and p.pinned_steps == 10
    assert [t for t, x in enumerate(learned) if x] == [7, 13]


@pytest.mark.parametrize("kw", [{"replan_every": 1}, {"overlap": True}])
def test_every_step_searches_when_told_and_with_the_overlap_thread(
    kw: dict[str, object],
) -> None:
    """replan_every = 1 is the search on every step; the overlap thread already takes the
    search off the step: it does not pin."""
    every = int(kw.pop("replan_every", 4))  # type: ignore[call-overload]
    p, searches = lagged(every, **kw)
    for t in range(8):
        step(p, t)
    assert p.replan_every == 1 and p.pinned_steps == 0
    if not kw.get("overlap"):  # (the thread searches ahead, on a step's inputs or a memo's)
        assert len(searches) == 8
    p.close()


def test_the_servers_default_is_eight_and_below_one_is_a_config_error() -> None:
    assert DraftConfig().replan_every == 8
    with pytest.raises(ConfigError, match="--lagged-replan-every"):
        DraftConfig(replan_every=0)


# every token of a step costs 10 ms: a verified draft that may be rejected never pays
DEAR = CapacityModel(TableModel(tuple(range(1, 65)), tuple(0.010 * b for b in range(1, 65))))


def plain_step(p: VerifyPlanner, t: int, r: int = 4) -> int:
    """One lagged step of R requests whose batch changes every step (a request replaced: the
    exact-input K memo never hits); K = 0 decodes plainly (skip), as the engine does."""
    ids = list(range(t, t + r))
    caps = np.full(r, GAMMA)
    k = p.budget(ids, caps, 100)
    if k == 0:
        p.skip(ids, caps, 100)
        rec = StepRecord(
            step=t,
            num_reqs=r,
            num_tokens=r,
            num_prefill_tokens=0,
            num_decode_reqs=r,
            kv_tokens=100,
            step_seconds=0.010,
        )
        p.observe(np.zeros(0, np.int64), np.zeros(0, np.int64), rec, [])
    return k


def test_a_search_that_chooses_k_0_for_a_batch_size_pins_plain_steps_until_every_fourth() -> None:
    """K = 0 pins by batch size, capacity model and lagged snapshot, not by batch: requests
    come and go under the pin, a new size bin or model ends it, and every fourth step
    searches again."""
    p, searches = lagged_dear(4)
    ks = [plain_step(p, t) for t in range(10)]
    assert ks == [0] * 10
    assert len(searches) == 3 and p.zero_pinned_steps == 7  # searches at steps 0, 4, 8
    plain_step(p, 10)  # the bin of R = 4 again, inside step 8's pin
    assert len(searches) == 3
    plain_step(p, 11, r=6)  # another size: a search, which pins R = 6's bin
    assert len(searches) == 4
    plain_step(p, 12, r=6)
    plain_step(p, 13, r=6)
    assert len(searches) == 4 and p.zero_pinned_steps == 10
    p.capacity = CapacityModel(DEAR.form)  # a live refit published
    plain_step(p, 14, r=6)
    assert len(searches) == 5
    assert p.state()["zero_pinned_steps"] == 10


def test_a_drafting_step_ends_a_k_0_pin_and_one_search_a_step_pins_nothing() -> None:
    p, searches = lagged_dear(8)
    plain_step(p, 0)  # a search: pinned from here
    plain_step(p, 1)
    step(p, 2, logit=np.full((4, GAMMA), 6.0))  # a probe: drafts verified, a new snapshot
    assert len(searches) == 1
    plain_step(p, 3)  # K reads the snapshot of two steps back: the probe's is not it yet
    assert len(searches) == 1
    plain_step(p, 4)  # now it is: a search, well inside the eight steps
    assert len(searches) == 2 and p.zero_pinned_steps == 3
    q, every = lagged_dear(1)
    for t in range(6):
        plain_step(q, t)
    assert len(every) == 6 and q.zero_pinned_steps == 0


def lagged_dear(replan_every: int) -> tuple[VerifyPlanner, list[int]]:
    """`lagged` on a curve where verifying drafts never pays: every search chooses K = 0."""
    p, searches = lagged(replan_every)
    p.capacity = DEAR
    return p, searches
