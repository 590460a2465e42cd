"""Verify-length policies: Appendix A, non-anticipation, optimality, SLA, baselines, parsing."""

from __future__ import annotations

import ast
import itertools
import time
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dspark_sglang.algo import verify_budget as vb
from dspark_sglang.algo.survival import survival
from dspark_sglang.config import ConfigError

FAST = settings(max_examples=120, deadline=None, derandomize=True)
# Values that collide often, so ties between positions and requests are exercised.
CONF = st.one_of(st.sampled_from([0.0, 0.25, 0.5, 0.9, 1.0]), st.floats(0.0, 1.0))
SPS_VAL = st.one_of(st.sampled_from([0.2, 0.5, 1.0]), st.floats(0.01, 2.0))


@st.composite
def instances(draw: st.DrawFn, max_r: int = 4, max_g: int = 5) -> dict:
    """Random (confidences, jagged SPS table, min/max lengths); the table may be too short."""
    r, g = draw(st.integers(1, max_r)), draw(st.integers(1, max_g))
    conf = np.array(draw(st.lists(CONF, min_size=r * g, max_size=r * g))).reshape(r, g)
    size = draw(st.integers(r, r * (g + 1) + 1))
    sps = np.array([0.0, *draw(st.lists(SPS_VAL, min_size=size - 1, max_size=size - 1))])
    hi = np.array(draw(st.lists(st.integers(0, g), min_size=r, max_size=r)))
    lo = np.array(draw(st.lists(st.integers(0, 2), min_size=r, max_size=r)))
    use = draw(st.sampled_from(["none", "max", "both"]))
    return dict(
        conf=conf,
        sps=sps,
        min_len=lo if use == "both" else None,
        max_len=hi if use != "none" else None,
    )


def bounds(a: np.ndarray, min_len: object, max_len: object) -> tuple[np.ndarray, np.ndarray]:
    r, g = a.shape
    hi = np.minimum(np.broadcast_to(g if max_len is None else max_len, (r,)), g)
    lo = np.minimum(np.broadcast_to(0 if min_len is None else min_len, (r,)), hi)
    return lo.astype(int), hi.astype(int)


def path_reference(a: np.ndarray, min_len: object, max_len: object) -> list[tuple[int, int]]:
    """Alg. 1 line 4 written out: forced positions, then (r, j) with a > 0 by (-a, j, r)."""
    lo, hi = bounds(a, min_len, max_len)
    forced = sorted(
        ((r, j) for r in range(a.shape[0]) for j in range(1, lo[r] + 1)),
        key=lambda rj: (rj[1], rj[0]),
    )
    free = [
        (r, j) for r in range(a.shape[0]) for j in range(lo[r] + 1, hi[r] + 1) if a[r, j - 1] > 0
    ]
    return forced + sorted(free, key=lambda rj: (-a[rj[0], rj[1] - 1], rj[1], rj[0]))


def user_floor(a: np.ndarray, lens: np.ndarray, sps: np.ndarray) -> float:
    b = a.shape[0] + int(lens.sum())
    per_req = 1.0 + np.array([a[r, : lens[r]].sum() for r in range(a.shape[0])])
    return float(per_req.min() * sps[b])


def algorithm1_reference(
    a: np.ndarray,
    sps: np.ndarray,
    min_len: object = None,
    max_len: object = None,
    min_user_tps: float = 0.0,
) -> np.ndarray:
    """Algorithm 1 as printed, one candidate at a time (plus the documented min-length start and
    SLA break)."""
    lo, _ = bounds(a, min_len, max_len)
    path = path_reference(a, min_len, max_len)
    lens, b, tau = np.zeros(a.shape[0], dtype=int), a.shape[0], float(a.shape[0])
    forced = int(lo.sum())
    for r, j in path[:forced]:
        lens[r], b, tau = j, b + 1, tau + a[r, j - 1]
    if b >= sps.size:
        return lens
    best = tau * sps[b]
    for r, j in path[forced:]:
        if b + 1 >= sps.size:
            break
        theta = (tau + a[r, j - 1]) * sps[b + 1]
        trial = lens.copy()
        trial[r] = j
        floor_ok = user_floor(a, trial, sps) >= min(min_user_tps, user_floor(a, lens, sps))
        if theta > best and (min_user_tps <= 0 or floor_ok):
            lens, b, tau, best = trial, b + 1, tau + a[r, j - 1], theta
        else:
            break
    return lens


def top_k_reference(a: np.ndarray, k: int, min_len: object, max_len: object) -> np.ndarray:
    lo, _ = bounds(a, min_len, max_len)
    lens = np.zeros(a.shape[0], dtype=int)
    for r, j in path_reference(a, min_len, max_len)[: max(k, int(lo.sum()))]:
        assert j == lens[r] + 1, "admitted set is not a prefix"
        lens[r] = j
    return lens


def brute_force_best(a: np.ndarray, sps: np.ndarray) -> float:
    """max Θ over every allocation ℓ ∈ {0..γ}^R (prefixes are the only allocations)."""
    r, g = a.shape
    return max(
        vb.expected_throughput(a, np.array(lens), sps)
        for lens in itertools.product(range(g + 1), repeat=r)
    )


# ---- Appendix A --------------------------------------------------------------------------------

APP_A_SPS = np.array([0.0, 1.0, 0.5, 0.45])
P_TARGET = {"A": 0.7, "B": 0.3}
P_DRAFT = {"A": 0.5, "B": 0.5}
C2_GIVEN_X1 = {"A": 0.9, "B": 0.0}  # the Markov confidence head sees x1


def first_token_distribution(policy: object) -> dict[str, float]:
    """Exact P(Y1) by enumerating x1: the schedule sees survival conditioned on x1 (as the
    confidence head would produce it); admitted drafts go through min(1, p/q) acceptance with the
    residual on rejection; ℓ = 0 samples Y1 from the target."""
    out = dict.fromkeys(P_TARGET, 0.0)
    residual = {y: max(0.0, P_TARGET[y] - P_DRAFT[y]) for y in P_TARGET}
    norm = sum(residual.values())
    for x1, q in P_DRAFT.items():
        lens = policy(survival(np.array([[0.8, C2_GIVEN_X1[x1]]])), APP_A_SPS)
        if lens[0] >= 1:
            accept = min(1.0, P_TARGET[x1] / P_DRAFT[x1])
            out[x1] += q * accept
            for y in out:
                out[y] += q * (1 - accept) * residual[y] / norm
        else:
            for y in out:
                out[y] += q * P_TARGET[y]
    return out


def test_appendix_a_throughputs() -> None:
    high, low = survival(np.array([[0.8, 0.9]])), survival(np.array([[0.8, 0.0]]))
    theta = [vb.expected_throughput(high, np.array([n]), APP_A_SPS) for n in range(3)]
    assert theta == pytest.approx([1.0, 0.9, 1.134])
    assert vb.expected_throughput(low, np.array([2]), APP_A_SPS) == pytest.approx(0.81)


def test_appendix_a_early_stop_verifies_nothing_whatever_x1() -> None:
    for c2 in C2_GIVEN_X1.values():
        assert vb.early_stop(survival(np.array([[0.8, c2]])), APP_A_SPS).tolist() == [0]
    assert first_token_distribution(vb.early_stop) == pytest.approx(P_TARGET, abs=1e-12)


def test_appendix_a_retrospective_is_biased() -> None:
    assert vb.retrospective(survival(np.array([[0.8, 0.9]])), APP_A_SPS).tolist() == [2]
    assert vb.retrospective(survival(np.array([[0.8, 0.0]])), APP_A_SPS).tolist() == [0]
    assert first_token_distribution(vb.retrospective) == pytest.approx(
        {"A": 0.85, "B": 0.15}, abs=1e-12
    )


def test_lagged_k_from_published_survival_is_unbiased_on_appendix_a() -> None:
    # K from a snapshot that predates x1 (here: the prior row, a2 = 0.8 * 0.5) cannot follow x1.
    k = vb.lagged_global_k(np.array([[0.8, 0.4]]), APP_A_SPS)
    policy = lambda a, sps: vb.assign_top_k(a, k)
    assert first_token_distribution(policy) == pytest.approx(P_TARGET, abs=1e-12)


# ---- non-anticipation --------------------------------------------------------------------------


def perturb_after(conf: np.ndarray, r: int, k: int, values: list[float]) -> np.ndarray:
    """Replace c[r, k+1..γ] (0-based columns k..): exactly what the realised x_{r,k} can change."""
    out = conf.copy()
    tail = out[r, k:]
    tail[:] = np.resize(np.array(values), tail.shape)
    return out


@FAST
@given(
    inst=instances(),
    r=st.integers(0, 3),
    k=st.integers(0, 5),
    values=st.lists(CONF, min_size=1, max_size=5),
    tps=st.sampled_from([0.0, 0.5, 1.5]),
)
def test_early_stop_admission_of_k_ignores_x_k(
    inst: dict, r: int, k: int, values: list[float], tps: float
) -> None:
    """1[ℓ_r >= j] for j <= k is a function of c[r, 1..k] and other requests only, so
    min(ℓ_r, k) must not move when c[r, k+1..] (downstream of x_{r,k}) changes."""
    conf, sps = inst["conf"], inst["sps"]
    r, k = r % conf.shape[0], k % (conf.shape[1] + 1)
    kw = dict(min_len=inst["min_len"], max_len=inst["max_len"], min_user_tps=tps)
    before = vb.early_stop(survival(conf), sps, **kw)
    after = vb.early_stop(survival(perturb_after(conf, r, k, values)), sps, **kw)
    assert min(before[r], k) == min(after[r], k)


@FAST
@given(
    inst=instances(),
    big_k=st.integers(0, 25),
    r=st.integers(0, 3),
    k=st.integers(0, 5),
    values=st.lists(CONF, min_size=1, max_size=5),
)
def test_top_k_admission_of_k_ignores_x_k(
    inst: dict, big_k: int, r: int, k: int, values: list[float]
) -> None:
    conf = inst["conf"]
    r, k = r % conf.shape[0], k % (conf.shape[1] + 1)
    kw = dict(min_len=inst["min_len"], max_len=inst["max_len"])
    before = vb.assign_top_k(survival(conf), big_k, **kw)
    after = vb.assign_top_k(survival(perturb_after(conf, r, k, values)), big_k, **kw)
    assert min(before[r], k) == min(after[r], k)


@FAST
@given(inst=instances(), seed=st.integers(0, 2**16), lag=st.integers(1, 3))
def test_lagged_capacity_ignores_current_step(inst: dict, seed: int, lag: int) -> None:
    """With every live draft eligible, Σℓ = K: it moves with the published survival only."""
    conf, sps = inst["conf"], inst["sps"]
    mode = vb.ScheduleMode("lagged", lag=lag)
    published = survival(conf)
    rng = np.random.default_rng(seed)
    totals = {
        int(
            vb.plan_verify_lengths(
                mode, rng.uniform(0.01, 1.0, conf.shape), sps, lagged_surv=published
            ).sum()
        )
        for _ in range(3)
    }
    assert totals == {vb.lagged_global_k(published, sps)}


def test_the_property_catches_the_retrospective_scheduler() -> None:
    conf = np.array([[0.8, 0.9]])
    before = vb.retrospective(survival(conf), APP_A_SPS)
    after = vb.retrospective(survival(perturb_after(conf, 0, 1, [0.0])), APP_A_SPS)
    assert min(before[0], 1) != min(after[0], 1)


# ---- exactness and optimality ------------------------------------------------------------------


@FAST
@given(inst=instances(), tps=st.sampled_from([0.0, 0.5, 1.5, 4.0]))
def test_early_stop_is_algorithm_1(inst: dict, tps: float) -> None:
    a = survival(inst["conf"])
    kw = dict(min_len=inst["min_len"], max_len=inst["max_len"], min_user_tps=tps)
    expected = algorithm1_reference(a, inst["sps"], **kw)
    assert vb.early_stop(a, inst["sps"], **kw).tolist() == expected.tolist()


@FAST
@given(inst=instances(), big_k=st.integers(0, 25))
def test_assign_top_k_is_the_top_k_prefix_set(inst: dict, big_k: int) -> None:
    a = survival(inst["conf"])
    kw = dict(min_len=inst["min_len"], max_len=inst["max_len"])
    lens = vb.assign_top_k(a, big_k, **kw)
    assert lens.tolist() == top_k_reference(a, big_k, **kw).tolist()
    lo, hi = bounds(a, inst["min_len"], inst["max_len"])
    assert np.all(lens >= lo) and np.all(lens <= hi)


@FAST
@given(inst=instances(), tps=st.sampled_from([0.5, 1.0, 1.5, 4.0]))
def test_lagged_sla_is_the_best_feasible_k(inst: dict, tps: float) -> None:
    a, sps = survival(inst["conf"]), inst["sps"]
    kw = dict(min_len=inst["min_len"], max_len=inst["max_len"])
    lo, _ = bounds(a, **kw)
    n_path = len(path_reference(a, **kw))
    ks = range(int(lo.sum()), max(int(lo.sum()), min(n_path, sps.size - 1 - a.shape[0])) + 1)
    rows = []
    for k in ks:
        lens = vb.assign_top_k(a, k, **kw)
        if a.shape[0] + lens.sum() < sps.size:
            rows.append((k, vb.expected_throughput(a, lens, sps), user_floor(a, lens, sps)))
    got = vb.lagged_global_k(a, sps, min_user_tps=tps, **kw)
    if not rows:
        assert got == lo.sum()
        return
    got_row = next(row for row in rows if row[0] == got)
    feasible = [row for row in rows if row[2] >= tps]
    if feasible:  # best Θ among the K that meet the floor
        assert got_row[2] >= tps
        assert got_row[1] == pytest.approx(max(row[1] for row in feasible), rel=1e-12)
    else:  # no K meets it: the best floor
        assert got_row[2] == pytest.approx(max(row[2] for row in rows), rel=1e-12)


def test_early_stop_matches_brute_force_when_theta_is_unimodal() -> None:
    # SPS = 1 / (t0 + t1 B): τ is concave along the path, so Θ = τ / affine is quasi-concave.
    rng = np.random.default_rng(0)
    for _ in range(150):
        r, g = rng.integers(1, 4), rng.integers(1, 4)
        a = survival(rng.beta(2.0, 1.0, (r, g)))
        b = np.arange(r * (g + 1) + 1)
        sps = 1.0 / (rng.uniform(0.1, 1.0) + rng.uniform(0.01, 0.5) * b)
        got = vb.expected_throughput(a, vb.early_stop(a, sps), sps)
        assert got == pytest.approx(brute_force_best(a, sps), rel=1e-12)


def test_lagged_with_lag_zero_matches_brute_force_on_jagged_sps() -> None:
    rng = np.random.default_rng(1)
    early_gap = 0
    for _ in range(150):
        r, g = rng.integers(1, 4), rng.integers(1, 4)
        a = survival(rng.beta(2.0, 1.0, (r, g)))
        sps = np.concatenate([[0.0], rng.uniform(0.05, 1.0, r * (g + 1))])
        lens = vb.assign_top_k(a, vb.lagged_global_k(a, sps))
        best = brute_force_best(a, sps)
        assert vb.expected_throughput(a, lens, sps) == pytest.approx(best, rel=1e-12)
        early_gap += vb.expected_throughput(a, vb.early_stop(a, sps), sps) < best - 1e-9
    assert early_gap > 0  # jagged SPS does trap the early stop sometimes (paper §5.2)


def test_sps_cliff_traps_early_stop_but_not_the_global_search() -> None:
    a = np.array([[0.8, 0.72]])
    assert vb.early_stop(a, APP_A_SPS).tolist() == [0]
    assert vb.lagged_global_k(a, APP_A_SPS) == 2


# ---- table limits, min/max lengths, determinism ------------------------------------------------


def test_b_beyond_the_table_is_never_admitted() -> None:
    a = np.full((3, 4), 0.99)
    sps = np.array([0.0, 1.0, 1.0, 1.0, 1.0, 1.0])  # B_max = 5 -> at most 2 drafts for R = 3
    assert vb.early_stop(a, sps).sum() == 2
    assert vb.lagged_global_k(a, sps) == 2
    assert vb.early_stop(a, sps[:3]).tolist() == [0, 0, 0]  # R itself beyond the table
    assert vb.early_stop(a, sps[:3], min_len=1).tolist() == [1, 1, 1]  # forced wins
    assert vb.expected_throughput(a, np.array([1, 1, 1]), sps) == -np.inf


def test_min_and_max_lengths() -> None:
    a = survival(np.array([[0.9, 0.9, 0.9], [0.1, 0.9, 0.9], [0.9, 0.0, 0.9]]))
    flat = np.array([0.0, *([1.0] * 12)])
    assert vb.early_stop(a, flat).tolist() == [3, 3, 1]  # a = 0 stops request 2 (Alg. 1 line 4)
    assert vb.early_stop(a, flat, max_len=np.array([1, 3, 3])).tolist() == [1, 3, 1]
    assert vb.assign_top_k(a, 0, min_len=np.array([0, 2, 2])).tolist() == [0, 2, 2]
    capped = dict(min_len=1, max_len=np.array([3, 0, 3]))  # K counts the forced drafts
    assert vb.assign_top_k(a, 2, **capped).tolist() == [1, 0, 1]
    assert vb.assign_top_k(a, 3, **capped).tolist() == [2, 0, 1]
    assert vb.assign_top_k(a, 100).tolist() == [3, 3, 1]
    steep = np.array([0.0, 1.0, 0.5, 0.3, 0.1])
    assert vb.early_stop(survival(np.ones((1, 3))), steep, min_len=2).tolist() == [2]


def test_an_empty_batch_gets_empty_lengths() -> None:
    none, sps = np.zeros((0, 5)), np.ones(8)
    assert vb.early_stop(none, sps, min_user_tps=5.0).shape == (0,)
    assert vb.lagged_global_k(none, sps, min_user_tps=5.0) == 0
    assert vb.assign_top_k(none, 3).shape == (0,)
    assert vb.plan_verify_lengths(vb.ScheduleMode("mtp1"), none, sps).shape == (0,)


def test_ties_break_by_position_then_request() -> None:
    a = np.full((3, 2), 0.5)
    assert vb.assign_top_k(a, 2).tolist() == [1, 1, 0]
    assert vb.assign_top_k(a, 4).tolist() == [2, 1, 1]


def test_policies_are_deterministic_and_leave_inputs_alone() -> None:
    rng = np.random.default_rng(2)
    a = survival(rng.beta(4, 1.5, (64, 7)))
    sps = 1.0 / (0.01 + 1e-4 * np.arange(64 * 8 + 1))
    copy = a.copy()
    for policy in (
        lambda: vb.early_stop(a, sps, min_user_tps=50.0),
        lambda: vb.assign_top_k(a, vb.lagged_global_k(a, sps, min_len=1), min_len=1),
    ):
        first = policy()
        assert first.dtype == np.int64
        assert np.array_equal(first, policy())
    assert np.array_equal(a, copy)


# ---- SLA ---------------------------------------------------------------------------------------


def test_sla_floor_shortens_verification() -> None:
    # Three confident requests and one hopeless one: the plain optimum leaves request 3 at ℓ = 0,
    # so its rate is SPS(B) alone and the floor caps B.
    a = survival(np.array([[0.95] * 5] * 3 + [[0.05] * 5]))
    sps = 1.0 / (0.001 + 0.0004 * np.arange(4 * 6 + 1))
    assert vb.early_stop(a, sps).tolist() == [4, 4, 4, 0]
    assert user_floor(a, np.array([4, 4, 4, 0]), sps) < 150.0
    for policy in (
        lambda x: vb.early_stop(a, sps, min_user_tps=x),
        lambda x: vb.assign_top_k(a, vb.lagged_global_k(a, sps, min_user_tps=x)),
    ):
        assert policy(150.0).tolist() == [4, 3, 3, 0]
        assert policy(200.0).tolist() == [2, 2, 2, 0]
        assert user_floor(a, policy(300.0), sps) >= 300.0
    # Start below the floor: nothing can lift request 3, so sync admits nothing that lowers it.
    assert vb.early_stop(a, sps, min_user_tps=1e6).tolist() == [0, 0, 0, 0]


def test_lagged_sla_takes_the_best_floor_when_none_is_feasible() -> None:
    a = survival(np.full((4, 5), 0.9))
    sps = 1.0 / (0.001 + 0.0004 * np.arange(4 * 6 + 1))
    floors = [user_floor(a, vb.assign_top_k(a, k), sps) for k in range(21)]
    assert vb.lagged_global_k(a, sps, min_user_tps=1e6) == int(np.argmax(floors))


# ---- baselines and the oracle ------------------------------------------------------------------


def test_baselines() -> None:
    conf = np.array([[0.9, 0.4, 0.9], [0.6, 0.6, 0.6], [0.3, 1.0, 1.0]])
    assert vb.verify_all(conf).tolist() == [3, 3, 3]
    assert vb.verify_all(conf, max_len=np.array([3, 1, 0])).tolist() == [3, 1, 0]
    assert vb.fixed(conf, 2).tolist() == [2, 2, 2]
    assert vb.fixed(conf, 9, max_len=2).tolist() == [2, 2, 2]
    assert vb.mtp1(conf).tolist() == [1, 1, 1]
    assert vb.threshold(conf, 0.5).tolist() == [1, 3, 0]  # per-step c, as DeepSpec
    assert vb.threshold(conf, 0.5, cumulative=True).tolist() == [1, 1, 0]  # survival a
    assert vb.threshold(conf, 0.0).tolist() == [3, 3, 3]


def test_oracle_is_an_upper_bound_on_realised_throughput() -> None:
    rng = np.random.default_rng(3)
    for _ in range(50):
        r, g = rng.integers(1, 6), rng.integers(1, 6)
        conf = rng.beta(3, 1, (r, g))
        accepted = np.argmin(np.concatenate([rng.random((r, g)) < conf, np.zeros((r, 1))], 1), 1)
        sps = np.concatenate([[0.0], rng.uniform(0.05, 1.0, r * (g + 1))])

        def realised(lens: np.ndarray, n: np.ndarray = accepted, s: np.ndarray = sps) -> float:
            return float((n.size + np.minimum(lens, n).sum()) * s[n.size + lens.sum()])

        best = realised(vb.oracle(accepted, g, sps))
        falling = np.concatenate([[0.0], np.sort(sps[1:])[::-1]])
        assert np.all(vb.oracle(accepted, g, falling) <= accepted)  # waste only pays if SPS rises
        a = survival(conf)
        for lens in (vb.early_stop(a, sps), vb.verify_all(conf), vb.mtp1(conf)):
            assert realised(lens) <= best + 1e-12


def test_oracle_examples() -> None:
    flat = np.ones(20)
    assert vb.oracle(np.array([2, 0, 5]), 4, flat).tolist() == [2, 0, 4]
    assert vb.oracle(np.array([2, 0, 5]), 4, flat, max_len=np.array([1, 4, 4])).tolist() == [
        1,
        0,
        4,
    ]
    cliff = np.array([0.0, 1.0, 1.0, 0.2, 0.2, 0.2, 0.2])
    assert vb.oracle(np.array([3, 3]), 3, cliff).tolist() == [0, 0]
    dip = np.array([0.0, 1.0, 0.1, 2.0])  # a wasted draft reaches the faster B = 3
    assert vb.oracle(np.array([1, 0]), 2, dip).tolist() == [1, 0]
    assert vb.oracle(np.array([0]), 2, dip).tolist() == [2]


# ---- parsing and dispatch ----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "mode"),
    [
        ("lagged", vb.ScheduleMode("lagged", lag=2)),
        ("lagged:3", vb.ScheduleMode("lagged", lag=3)),
        ("sync", vb.ScheduleMode("sync")),
        ("verify-all", vb.ScheduleMode("verify-all")),
        ("fixed:0", vb.ScheduleMode("fixed", length=0)),
        ("fixed:4", vb.ScheduleMode("fixed", length=4)),
        ("threshold:0.6", vb.ScheduleMode("threshold", c_min=0.6)),
        ("mtp1", vb.ScheduleMode("mtp1")),
    ],
)
def test_parse_schedule_mode(text: str, mode: vb.ScheduleMode) -> None:
    assert vb.parse_schedule_mode(text) == mode
    assert vb.parse_schedule_mode(str(mode)) == mode


@pytest.mark.parametrize(
    "text",
    [
        "fixed:x",
        "fixed",
        "fixed:-1",
        "threshold:2",
        "threshold:nan",
        "threshold:",
        "bogus",
        "",
        "retrospective",
        "oracle",
        "lagged:0",
        "lagged:",
        "sync:",
        "lagged:x",
        "sync:3",
        "mtp1:1",
    ],
)
def test_parse_schedule_mode_rejects(text: str) -> None:
    with pytest.raises(ConfigError, match="--schedule-mode"):
        vb.parse_schedule_mode(text)


def test_serving_modes_exclude_comparison_policies() -> None:
    assert "retrospective" not in vb.SERVING_MODES and "oracle" not in vb.SERVING_MODES
    with pytest.raises(ValueError, match="not a serving"):
        vb.plan_verify_lengths(vb.ScheduleMode("retrospective"), np.ones((1, 2)), np.ones(4))


def test_plan_verify_lengths_dispatches_every_mode() -> None:
    conf = np.array([[0.9, 0.9, 0.2], [0.95, 0.5, 0.5]])
    sps = np.array([0.0, 1.0, 1.0, 1.0, 1.0, 0.9, 0.5, 0.5, 0.5])
    a = survival(conf)
    plan = lambda text, **kw: vb.plan_verify_lengths(vb.parse_schedule_mode(text), conf, sps, **kw)
    assert plan("sync").tolist() == vb.early_stop(a, sps).tolist()
    k = vb.lagged_global_k(a * 0.5, sps)
    assert plan("lagged", lagged_surv=a * 0.5).tolist() == vb.assign_top_k(a, k).tolist()
    assert plan("verify-all").tolist() == [3, 3]
    assert plan("fixed:2", max_len=np.array([1, 3])).tolist() == [1, 2]
    assert plan("threshold:0.6").tolist() == [2, 1]
    assert plan("mtp1", min_len=2).tolist() == [2, 2]
    with pytest.raises(ValueError, match="lagged_surv"):
        plan("lagged")


# ---- purity and speed --------------------------------------------------------------------------

ALLOWED_IMPORTS = {
    "__future__",
    "collections.abc",
    "dataclasses",
    "itertools",
    "math",
    "numpy",
    "dspark_sglang.algo.monotone",  # pure numpy too (listed below)
    "dspark_sglang.config",
    "dspark_sglang.types",
}


@pytest.mark.parametrize(
    "module", ["monotone.py", "step_bias.py", "survival.py", "verify_budget.py"]
)
def test_algorithms_import_only_numpy_stdlib_config_types(module: str) -> None:
    path = Path(vb.__file__).with_name(module)
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            names.add(node.module or "")
    assert names <= ALLOWED_IMPORTS, names - ALLOWED_IMPORTS


def test_decision_time_at_r512_gamma7() -> None:
    # The goal is < 200 µs median (docs/scheduler.md, bench/scheduler.py); this shared-CPU guard
    # only catches a regression to a non-vectorised implementation. Inputs rotate, as in serving:
    # one input timed over and over lets the branch predictor learn the sort.
    rng = np.random.default_rng(4)
    inputs = [survival(rng.beta(4, 1.5, (512, 7))) for _ in range(4)]
    sps = 1.0 / (0.01 + 2e-5 * np.maximum(np.arange(512 * 8 + 1), 256))
    for policy in (
        lambda a: vb.early_stop(a, sps),
        lambda a: vb.assign_top_k(a, vb.lagged_global_k(a, sps)),
    ):
        times = []
        for i in range(16):
            t0 = time.perf_counter()
            policy(inputs[i % 4])
            times.append(time.perf_counter() - t0)
        assert np.median(times) < 2e-3


# -- row-priced drafter (selective lagged drafting) ------------------------------------------


def test_row_priced_sps_adds_the_drafter_of_the_requests_the_path_has_reached() -> None:
    a = np.array([[0.9, 0.5], [0.3, 0.1]])  # path: (0,1) 0.9, (0,2) 0.5, (1,1) 0.3, (1,2) 0.1
    sps = np.array([0.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0])  # 1 s forwards
    out = vb.row_priced_sps(a, sps, np.array([0.0, 0.5, 1.0]))
    # B = R + K for K = 0..4: rows drafted 0, 1, 1, 2, 2; the table ends with the path
    np.testing.assert_allclose(out, [0.0, 1.0, 1.0, 1 / 1.5, 1 / 1.5, 0.5, 0.5])
    capped = vb.row_priced_sps(a, sps, np.array([0.0, 0.5, 1.0]), max_len=np.array([1, 2]))
    np.testing.assert_allclose(capped, [0.0, 1.0, 1.0, 1 / 1.5, 0.5, 0.5])  # (0,2) is off


@FAST
@given(instances(), st.floats(0.0, 2.0), st.floats(0.0, 0.5))
def test_row_priced_sps_with_a_flat_drafter_is_the_when_verifying_table(
    inst: dict, fixed: float, per_row: float
) -> None:
    """A drafter priced the same for any row count is the all-rows price, so the K search
    agrees with the whole-batch lagged table; one that grows with its rows never prices a K
    above that, so the best Θ can only rise."""
    a, sps = survival(inst["conf"]), inst["sps"]
    kw = {"min_len": inst["min_len"], "max_len": inst["max_len"]}
    r = a.shape[0]
    if sps.size <= r:
        return
    whole = sps.copy()
    whole[r + 1 :] = 1.0 / (1.0 / sps[r + 1 :] + fixed + per_row * r)
    flat = np.full(r + 1, fixed + per_row * r)
    flat[0] = 0.0
    got = vb.row_priced_sps(a, sps, flat, **kw)
    np.testing.assert_allclose(got, whole[: got.size])
    assert vb.lagged_global_k(a, got, **kw) == vb.lagged_global_k(a, whole, **kw)
    rows = fixed + per_row * np.arange(r + 1)
    rows[0] = 0.0
    sel = vb.row_priced_sps(a, sps, rows, **kw)
    assert np.all(sel[r:] >= got[r:] - 1e-12)
    if kw["min_len"] is None:
        best = lambda t: max(vb._theta(r, -np.sort(-a.ravel()), t))
        assert best(sel) >= best(got) - 1e-9


@FAST
@given(instances(), st.floats(0.0, 0.5), st.sampled_from([0.0, 3.0, 1e6]))
def test_selective_k_is_the_row_priced_search_and_the_rows_it_admits(
    inst: dict, per_row: float, tps: float
) -> None:
    """The planner's one-pass search returns what the two public calls return: K of
    lagged_global_k over row_priced_sps, and the requests assign_top_k admits at that K."""
    a, sps = survival(inst["conf"]), inst["sps"]
    kw = {"min_len": inst["min_len"], "max_len": inst["max_len"]}
    rows = 0.01 + per_row * np.arange(a.shape[0] + 1)
    rows[0] = 0.0
    k, keep, theta = vb.selective_k(a, sps, rows, min_user_tps=tps, **kw)
    priced = vb.row_priced_sps(a, sps, rows, **kw)
    assert k == vb.lagged_global_k(a, priced, min_user_tps=tps, **kw)
    assert keep.tolist() == np.flatnonzero(vb.assign_top_k(a, k, **kw)).tolist()
    if sps.size > a.shape[0] and theta > -np.inf:  # Θ at K: the tokens over the row-priced step
        lens = vb.assign_top_k(a, k, **kw)
        tokens = a.shape[0] + float(a[np.arange(a.shape[1])[None, :] < lens[:, None]].sum())
        assert theta == pytest.approx(tokens * priced[a.shape[0] + k], rel=1e-9)


def test_a_few_confident_requests_pay_for_a_drafter_priced_by_its_rows() -> None:
    """One confident request among eight: drafting all eight does not pay for its tokens,
    drafting it alone does, and the rows to draft are exactly the ones K admits."""
    a = survival(np.array([[0.95] * 4] + [[0.05] * 4] * 7))
    sps = np.concatenate([[0.0], np.full(8 * 5, 1.0 / 0.08)])  # 80 ms forwards, any B
    draft = 0.005 + 0.01 * np.arange(9)  # 5 ms + 10 ms per drafted row
    draft[0] = 0.0
    whole = sps.copy()
    whole[9:] = 1.0 / (0.08 + draft[8])
    assert vb.lagged_global_k(a, whole) == 0
    k = vb.lagged_global_k(a, vb.row_priced_sps(a, sps, draft))
    assert k == 4
    assert np.flatnonzero(vb.assign_top_k(a, k)).tolist() == [0]


def test_planned_tokens_are_r_plus_the_admitted_survival() -> None:
    surv = np.array([[0.9, 0.5, 0.1], [0.8, 0.7, 0.6]])
    assert vb.planned_tokens(surv, 0) == 2.0
    assert vb.planned_tokens(surv, 3) == pytest.approx(2.0 + 0.9 + 0.8 + 0.7)
    # a cap of one draft on row 1: the third pick is row 0's second
    cap = np.array([3, 1])
    assert vb.planned_tokens(surv, 3, max_len=cap) == pytest.approx(2.0 + 0.9 + 0.8 + 0.5)
    assert vb.planned_tokens(surv, 99) == pytest.approx(2.0 + surv.sum())


@FAST
@given(instances(), st.sampled_from([0.0, 3.0, 1e6]))
def test_lagged_global_plan_reads_the_planned_tokens_off_theta(inst: dict, tps: float) -> None:
    """The τ the lagged K search returns is `planned_tokens` at its K: R + the survival of the
    candidates assign_top_k admits."""
    a, sps = survival(inst["conf"]), inst["sps"]
    kw = {"min_len": inst["min_len"], "max_len": inst["max_len"]}
    k, tau = vb.lagged_global_plan(a, sps, min_user_tps=tps, **kw)
    assert k == vb.lagged_global_k(a, sps, min_user_tps=tps, **kw)
    if sps.size > a.shape[0] + k and not np.isnan(tau):
        assert tau == pytest.approx(vb.planned_tokens(a, k, **kw), rel=1e-9)


def _numpy_path(fn: object, *args: object, **kw: object) -> object:
    """fn with the small-batch Python path off (SMALL_PATH = 0): the numpy reference."""
    saved, vb.SMALL_PATH = vb.SMALL_PATH, 0
    try:
        return fn(*args, **kw)
    finally:
        vb.SMALL_PATH = saved


@settings(max_examples=400, deadline=None, derandomize=True)
@given(
    instances(max_r=6, max_g=8),
    st.floats(0.0, 0.5),
    st.integers(-1, 50),
    st.sampled_from([0.0, 0.05, 0.3]),
)
def test_the_small_batch_path_is_the_numpy_path_bit_for_bit(
    inst: dict, per_row: float, k: int, margin: float
) -> None:
    """Below SMALL_PATH candidates the K searches and the top-K admission walk Python floats; they
    must return the numpy path's K, rows, lengths and Θ exactly (the planner's decisions and the
    recorded planned tokens may not depend on which path ran), ties and caps included."""
    a, sps = survival(inst["conf"]), inst["sps"]
    assert a.size <= vb.SMALL_PATH  # every instance here takes the small path
    kw = {"max_len": inst["max_len"]}  # min_len always takes the numpy path
    rows = 0.01 + per_row * np.arange(a.shape[0] + 1)
    rows[0] = 0.0
    if sps.size > a.shape[0]:
        fast, ref = (
            vb.selective_k(a, sps, rows, tie_margin=margin, **kw),
            _numpy_path(vb.selective_k, a, sps, rows, tie_margin=margin, **kw),
        )
        assert fast[0] == ref[0] and fast[1].tolist() == ref[1].tolist() and fast[2] == ref[2]
        assert fast[1].dtype == np.int64
    plan, ref_plan = (
        vb.lagged_global_plan(a, sps, tie_margin=margin, **kw),
        _numpy_path(vb.lagged_global_plan, a, sps, tie_margin=margin, **kw),
    )
    assert plan[0] == ref_plan[0]
    assert plan[1] == ref_plan[1] or (np.isnan(plan[1]) and np.isnan(ref_plan[1]))
    lens, ref_lens = vb.assign_top_k(a, k, **kw), _numpy_path(vb.assign_top_k, a, k, **kw)
    assert lens.tolist() == ref_lens.tolist() and lens.dtype == ref_lens.dtype


def test_the_small_batch_path_covers_what_the_planner_sends() -> None:
    """An int64 cap array (the engine's), a scalar cap and none take the Python path; a float cap
    array, a batch above SMALL_PATH and a negative cap do not (the numpy path checks and raises)."""
    a = survival(np.full((2, 3), 0.8))
    # row 0 (cap 3) at flat 0, 2, 4; row 1 (cap 1) at flat 1
    assert [i for _, i in vb._small_path(a, np.array([3, 1]))] == [0, 1, 2, 4]
    assert vb._small_path(a, 2) is not None and vb._small_path(a, None) is not None
    assert vb._small_path(a, np.array([3.0, 1.0])) is None
    assert vb._small_path(survival(np.full((9, 8), 0.8)), None) is None
    assert vb._small_path(a, np.array([-1, 2])) is None
    with pytest.raises(ValueError):
        vb.assign_top_k(a, 2, max_len=np.array([-1, 2]))


def _theta_by_k(a: np.ndarray, sps: np.ndarray, **kw: object) -> list[float]:
    """Θ(K) = planned_tokens(K) · SPS(R + K) for every K the table holds, written out."""
    r = a.shape[0]
    top = min(sps.size - 1 - r, len(path_reference(a, kw.get("min_len"), kw.get("max_len"))))
    return [vb.planned_tokens(a, k, **kw) * float(sps[r + k]) for k in range(top + 1)]


@FAST
@given(instances(), st.sampled_from([0.01, 0.05, 0.3, 0.9]))
def test_a_tie_margin_widens_a_drafting_k_to_the_largest_k_within_it(
    inst: dict, margin: float
) -> None:
    """--plan-tie-margin: a best K > 0 becomes the largest K >= it whose Θ is within the margin
    of the best Θ; a best K = 0 (plain) stays 0; the margin never narrows K."""
    a, sps = survival(inst["conf"]), inst["sps"]
    kw = {"min_len": inst["min_len"], "max_len": inst["max_len"]}
    if sps.size <= a.shape[0]:
        return
    best = vb.lagged_global_k(a, sps, **kw)
    wide = vb.lagged_global_k(a, sps, tie_margin=margin, **kw)
    theta = _theta_by_k(a, sps, **kw)
    if best == 0 or best >= len(theta):  # plain, or forced drafts the table cannot hold
        assert wide == best
        return
    assert wide >= best
    bar = (1.0 - margin) * theta[best]
    assert theta[wide] >= bar * (1 - 1e-9)
    assert all(t < bar * (1 + 1e-9) for t in theta[wide + 1 :])


def test_a_tie_margin_verifies_every_draft_where_trimming_gains_less() -> None:
    """Eight requests, a drafter priced by its rows: the argmax trims the weak tail drafts for a
    1 % gain; a 5 % margin verifies them all (the Θ it gives up is under 5 %); a 0.5 % one does
    not; and where plain steps win by more than the margin, K stays 0."""
    a = survival(np.array([[0.9, 0.8, 0.6, 0.3]] * 8))
    r, g = a.shape
    # forwards: 40 ms to B = 24, then 0.4 ms a token
    b = np.arange(r * (g + 1) + 1)
    sps = np.concatenate([[0.0], 1.0 / (0.040 + 0.0004 * np.maximum(b[1:] - 24, 0))])
    draft = np.full(r + 1, 0.002)
    draft[0] = 0.0
    k, _, theta = vb.selective_k(a, sps, draft)
    assert 0 < k < r * g
    k5, rows5, theta5 = vb.selective_k(a, sps, draft, tie_margin=0.05)
    assert k5 == r * g and rows5.tolist() == list(range(r)) and theta5 >= 0.95 * theta
    assert vb.selective_k(a, sps, draft, tie_margin=0.005)[0] < r * g
    slow = sps.copy()
    slow[r + 1 :] *= 0.2  # any drafting step takes five plain ones
    assert vb.selective_k(a, slow, draft, tie_margin=0.3)[0] == 0
