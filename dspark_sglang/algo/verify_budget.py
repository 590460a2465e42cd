"""Verify-length policies ℓ_r ∈ [0, γ]: Algorithm 1 (`early_stop`), lagged global K + live top-K
(§5.2), the baselines, and the replay-only `oracle` / `retrospective`. Pure numpy + stdlib; imports
only `dspark_sglang.config`, never engine, models, torch.cuda or a clock.

SPS contract: `sps` is a 1-D float array indexed by B, the verify forward's size in tokens
(B = R + Σ ℓ_r: every request always verifies its anchor row). For 1 <= B <= B_max = len(sps) - 1,
`sps[B]` is the steps per second of that forward, positive and finite (already ceiled to the
executed graph bucket if the capacity model does that); `sps[0]` is never read. A B beyond the
table is not admissible: the Θ searches never return one (only min_len can force it).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from dspark_sglang.config import ConfigError

DEFAULT_LAG = 2  # §5.2: K comes from the confidence outputs of two steps prior
SERVING_MODES = ("lagged", "sync", "verify-all", "fixed", "threshold", "mtp1")

# Region map of the admission path shared by every search below. Survival a[r, j] is [R, γ] with
# column j-1 = draft position j; `neg` is its transpose [γ, R], so the flat index
# i = (j-1)*R + r is position-major. The path lists candidates in this order:
#   forced (j <= min_len[r])        first, by i, whatever the value (`forced` mask; neg = 1.0)
#   free (a > 0, j <= max_len[r])   by a descending, ties by i ascending (neg = -a)
#   otherwise                       off the path (neg = 1.0)
# Ties by i = (position asc, request asc) are value-independent, and since a is non-increasing
# along a row every path prefix gives each request a prefix of its drafts. Θ along the path needs
# only the sorted free values (equal values are interchangeable in τ), and the first m free entries
# are "every a above the m-th value + the first tied ones by i". So the fast path needs a SIMD value
# sort or an O(Rγ) partition, never a stable index sort (2-4x slower on fresh data).


# R·γ up to which the lagged K searches and the top-K admission walk the candidates as Python
# floats instead of a dozen numpy calls on [γ, R] arrays. They run on the host every drafting step
# (the K search also after plain steps), right after a forward that evicted numpy's code and data
# from the caches: in-process on the CPU engine at c = 1, `selective_k` took 133-170 µs a call and
# `assign_top_k` 98 µs, against 37 µs for the loop. Same float operations in the same order, so the
# same K, rows and Θ bit for bit (tests/unit/algo/test_verify_budget.py checks both paths agree).
SMALL_PATH = 64


def _small_path(
    surv: np.ndarray, max_len: np.ndarray | int | None
) -> list[tuple[float, int]] | None:
    """The free path (no min_len) as (-a, flat index) pairs in path order, or None where the numpy
    path must run (a large batch, or a max_len it has to check)."""
    num_reqs, gamma = surv.shape
    if num_reqs * gamma > SMALL_PATH:
        return None
    if max_len is None:
        hi = [gamma] * num_reqs
    elif (
        isinstance(max_len, np.ndarray)
        and max_len.shape == (num_reqs,)
        and max_len.dtype.kind in "iu"
    ):
        hi = max_len.tolist()
    elif isinstance(max_len, int | np.integer):
        hi = [int(max_len)] * num_reqs
    else:
        return None
    if hi and min(hi) < 0:
        return None  # the numpy path raises
    rows = surv.tolist()
    path = [
        (-a, j * num_reqs + r)
        for r, row in enumerate(rows)
        for j, a in enumerate(row[: hi[r]])
        if a > 0.0
    ]
    path.sort()
    return path


def _per_request(x: np.ndarray | int | None, num_reqs: int, default: int) -> np.ndarray:
    if x is None:
        return np.full(num_reqs, default, dtype=np.int64)
    out = np.asarray(x, dtype=np.int64)
    if out.shape != (num_reqs,):  # a scalar for every request (broadcast_to costs µs per call)
        out = np.broadcast_to(out, (num_reqs,))
    if out.size and out.min() < 0:
        raise ValueError("per-request verify lengths must be >= 0")
    return out


def _candidates(
    surv: np.ndarray, min_len: np.ndarray | int | None, max_len: np.ndarray | int | None
) -> tuple[np.ndarray, np.ndarray | None]:
    """(neg [γ, R]: -a for free candidates, 1.0 elsewhere; forced mask [γ, R] or None)."""
    num_reqs, gamma = surv.shape
    by_pos = surv.T
    neg = np.where(by_pos > 0.0, -by_pos, 1.0)
    forced = None
    if max_len is not None or min_len is not None:
        hi = np.minimum(_per_request(max_len, num_reqs, gamma), gamma)
        cols = np.arange(gamma)[:, None]
        neg[cols >= hi[None, :]] = 1.0
        if min_len is not None:
            forced = cols < np.minimum(_per_request(min_len, num_reqs, 0), hi)[None, :]
            neg[forced] = 1.0
    return neg, forced


def _sorted_free(flat: np.ndarray, n_free: int, cap: int) -> np.ndarray:
    """The best min(n_free, cap) free keys, ascending (-a ascending = survival descending)."""
    if cap <= 0:
        return np.empty(0)
    if cap < n_free:  # a short SPS table: partition, then sort only what fits
        return np.sort(np.partition(flat, cap - 1)[:cap])
    return np.sort(flat)[:n_free]


def _admit(
    neg: np.ndarray,
    forced: np.ndarray | None,
    m: int,
    n_free: int,
    sorted_neg: np.ndarray | None = None,
) -> np.ndarray:
    """ℓ for the forced set plus the first m free path entries: every key above the m-th best,
    then the tied ones by flat index (position asc, request asc)."""
    num_reqs = neg.shape[1]
    lens = np.zeros(num_reqs, dtype=np.int64) if forced is None else forced.sum(axis=0)
    if m <= 0:
        return lens
    if m >= n_free:
        return lens + (neg < 0.0).sum(axis=0)
    flat = neg.ravel()
    t = sorted_neg[m - 1] if sorted_neg is not None else np.partition(flat, m - 1)[m - 1]
    above = neg < t
    lens = lens + above.sum(axis=0)
    ties = np.flatnonzero(flat == t)[: m - int(np.count_nonzero(above))]
    return lens + np.bincount(ties % num_reqs, minlength=num_reqs)


def _theta(num_reqs: int, vals: np.ndarray, sps: np.ndarray) -> np.ndarray:
    """Θ[K] = τ(K) · SPS(R + K) for K = 0..K_max, τ(K) = R + Σ of the first K path values (§3.2.2).
    The path is cut where R + K leaves the SPS table, so every K returned is admissible."""
    n = max(0, min(vals.size + 1, sps.size - num_reqs))
    if n == 0:
        return np.empty(0)
    # ((R + v1) + v2) + ...: the same summation order as Algorithm 1's running τ.
    tau = np.cumsum(np.concatenate(([float(num_reqs)], vals[: n - 1])))
    return tau * sps[num_reqs : num_reqs + n]


def _path_values(
    surv: np.ndarray, neg: np.ndarray, forced: np.ndarray | None, sps: np.ndarray
) -> tuple[np.ndarray, np.ndarray, int, int]:
    """(Θ along the path, sorted free keys, #forced, #free) for a candidate set."""
    num_reqs = surv.shape[0]
    flat = neg.ravel()
    n_free = int(np.count_nonzero(flat < 0.0))
    forced_vals = np.empty(0) if forced is None else surv.T[forced]  # position-major, like Alg. 1
    n_forced = forced_vals.size
    srt = _sorted_free(flat, n_free, sps.size - 1 - num_reqs - n_forced)
    theta = _theta(num_reqs, np.concatenate([forced_vals, -srt]), sps)
    return theta, srt, n_forced, n_free


def _path_order(neg: np.ndarray, forced: np.ndarray | None) -> np.ndarray:
    """The full path as flat indices; only the SLA floor needs it."""
    flat = neg.ravel()
    order = np.argsort(flat)[: np.count_nonzero(flat < 0.0)]  # SIMD sort, unstable
    keys = flat[order]
    if np.any(keys[1:] == keys[:-1]):  # equal survival: restore (position, request) order
        order = np.argsort(flat, kind="stable")[: order.size]
    if forced is not None:
        order = np.concatenate([np.flatnonzero(forced.ravel()), order])
    return order


def _min_user_rate(
    surv: np.ndarray, order: np.ndarray, sps: np.ndarray, n_theta: int
) -> np.ndarray:
    """u[K] = min_r (1 + Σ_{j<=ℓ_r(K)} a[r, j]) · SPS(R + K) along the path, for K < n_theta.

    Request r sits in state j (ℓ_r = j, value V = 1 + cumsum a[r, :j]) for K in [k_j, k_{j+1}),
    where k_j is the K that admits (r, j). min_r V(K) >= y iff K >= max{k_{j+1} : V_{r,j} < y},
    so with the states sorted by V an exclusive running max of their end points inverts the lower
    envelope in O(Rγ log Rγ); equal V across requests resolve to the same envelope value."""
    num_reqs, gamma = surv.shape
    if num_reqs == 0:  # no request, no floor to miss
        return np.full(n_theta, np.inf)
    # Position-major [γ, R] like the path: enter[j-1, r] = k_j, the K that admits (r, j).
    enter = np.full(num_reqs * gamma, np.inf)
    enter[order[: n_theta - 1]] = np.arange(1, min(order.size, n_theta - 1) + 1)
    enter = enter.reshape(gamma, num_reqs)
    # State j >= 1 ends at k_{j+1} (the last never ends); its value is 1 + Σ_{i<=j} a.
    end = np.concatenate([enter[1:], np.full((1, num_reqs), np.inf)]).ravel()
    value = (1.0 + np.cumsum(surv.T, axis=0)).ravel()
    # The R states j = 0 all have V = 1, the minimum, so they lead without sorting (R equal keys
    # would also slow the SIMD sort). Any order of equal V gives the same envelope.
    by_value = np.argsort(value)
    v = np.concatenate([np.ones(num_reqs), value[by_value]])
    e = np.concatenate([enter[0], end[by_value]])
    reach = np.maximum.accumulate(np.concatenate([[0.0], e[:-1]]))  # non-decreasing K thresholds
    # idx(K) = #{reach <= K} - 1, by histogram: reach holds integer K values or inf.
    hits = np.bincount(np.minimum(reach, n_theta).astype(np.int64), minlength=n_theta + 1)
    idx = np.cumsum(hits[:n_theta]) - 1
    return v[idx] * sps[num_reqs : num_reqs + n_theta]


def early_stop(
    surv: np.ndarray,
    sps: np.ndarray,
    *,
    min_len: np.ndarray | int | None = None,
    max_len: np.ndarray | int | None = None,
    min_user_tps: float = 0.0,
) -> np.ndarray:
    """Algorithm 1 (paper §3.2.2): walk candidates (r, j) by survival descending (ties: position
    asc, request asc), admit each while Θ = τ · SPS(B) strictly improves, stop at the first
    non-improvement. The break makes it non-anticipating (Appendix A): admitting (r, k) reads only
    path entries before it, never a[r, k+1..], which depend on the realised x_{r,k}.

    min_len positions are admitted up front (value-independent, Θ_best starts there); max_len and
    a = 0 remove candidates (Alg. 1 line 4); a B beyond the SPS table stops the walk.
    min_user_tps > 0 (DESIGN §5) adds one more break: the admission must keep
    min_r (1 + Σ_{j<=ℓ_r} a_{r,j}) · SPS(B) >= min(min_user_tps, its value before the admission),
    i.e. never break a met per-request floor and never worsen an unmet one."""
    neg, forced = _candidates(surv, min_len, max_len)
    theta, srt, n_forced, n_free = _path_values(surv, neg, forced, sps)
    if theta.size <= n_forced + 1:  # nothing beyond the forced prefix fits in the table
        return _admit(neg, forced, 0, n_free)
    better = theta[n_forced + 1 :] > theta[n_forced:-1]
    if min_user_tps > 0.0:
        rate = _min_user_rate(surv, _path_order(neg, forced), sps, theta.size)[n_forced:]
        better &= rate[1:] >= np.minimum(min_user_tps, rate[:-1])
    m = better.size if better.all() else int(np.argmin(better))
    return _admit(neg, forced, m, n_free, srt)


def lagged_global_k(
    lagged_surv: np.ndarray,
    sps: np.ndarray,
    *,
    min_len: np.ndarray | int | None = None,
    max_len: np.ndarray | int | None = None,
    min_user_tps: float = 0.0,
    tie_margin: float = 0.0,
) -> int:
    """Capacity K (total admitted draft tokens, B = R + K) of the lagged scheduler (paper §5.2):
    the unconstrained argmax over all K of Θ(K) = (R + Σ top-K a) · SPS(R + K), no early stop, so
    jagged SPS cliffs cannot trap it. `lagged_surv` is [R, γ] for the *current* requests as
    published `lag` steps earlier (survival.SurvivalHistory.lagged; prior rows for fresh requests):
    K never sees this step's tokens. Ties pick the smallest K; min_len drafts count toward K.

    min_user_tps > 0 (DESIGN §5): argmax over the K whose predicted min_r (1 + Σ a_r) · SPS(R + K)
    >= min_user_tps; if no K meets the floor, the K with the best floor.

    tie_margin > 0: when the best K drafts (K > 0), the largest K whose Θ is within that share
    of the best (docs/scheduler.md "Near ties")."""
    return lagged_global_plan(
        lagged_surv,
        sps,
        min_len=min_len,
        max_len=max_len,
        min_user_tps=min_user_tps,
        tie_margin=tie_margin,
    )[0]


def lagged_global_plan(
    lagged_surv: np.ndarray,
    sps: np.ndarray,
    *,
    min_len: np.ndarray | int | None = None,
    max_len: np.ndarray | int | None = None,
    min_user_tps: float = 0.0,
    tie_margin: float = 0.0,
) -> tuple[int, float]:
    """`lagged_global_k` and the tokens τ(K) = Θ(K) / SPS(R + K) it was chosen on (what
    `planned_tokens` gives for that K; nan where no K fits the table), from the same pass."""
    num_reqs = lagged_surv.shape[0]
    if min_len is None and not min_user_tps and sps.size > num_reqs:
        path = _small_path(lagged_surv, max_len)
        got = None if path is None else _global_small(num_reqs, path, sps, tie_margin)
        if got is not None:
            return got
    neg, forced = _candidates(lagged_surv, min_len, max_len)
    theta, _, n_forced, _ = _path_values(lagged_surv, neg, forced, sps)
    if theta.size <= n_forced:
        return n_forced, float("nan")
    rate = None
    if min_user_tps > 0.0:
        rate = _min_user_rate(lagged_surv, _path_order(neg, forced), sps, theta.size)
    k = _best_k(theta, n_forced, rate, min_user_tps, tie_margin)
    return k, float(theta[k] / sps[num_reqs + k])


def _global_small(
    num_reqs: int, path: list[tuple[float, int]], sps: np.ndarray, tie_margin: float = 0.0
) -> tuple[int, float] | None:
    """lagged_global_plan over a `_small_path` (`_selective_small` without a drafter per row)."""
    table = sps[num_reqs : num_reqs + min(len(path), sps.size - num_reqs - 1) + 1].tolist()
    tau = float(num_reqs)
    best, best_k = tau * table[0], 0
    thetas = [best]
    for k, (neg, _) in enumerate(path[: len(table) - 1], 1):
        tau -= neg
        theta = tau * table[k]
        if theta != theta:
            return None
        thetas.append(theta)
        if theta > best:
            best, best_k = theta, k
    if best != best:
        return None
    best_k = _widened(thetas, best_k, tie_margin)
    return best_k, thetas[best_k] / table[best_k]


def _best_k(
    theta: np.ndarray,
    n_forced: int,
    rate: np.ndarray | None,
    floor: float,
    tie_margin: float = 0.0,
) -> int:
    """argmax of Θ over K >= n_forced (ties: smallest K); with the per-user rates along the path,
    over the K that meet the floor, or the K with the best floor if none does. tie_margin > 0:
    a drafting best K widens to the largest K within that share of its Θ (`_widened`)."""
    if rate is None:
        k = n_forced + int(np.argmax(theta[n_forced:]))
        return _widened(theta, k, tie_margin)
    meets = rate[n_forced:] >= floor
    if not meets.any():
        return n_forced + int(np.argmax(rate[n_forced:]))
    vals = np.full(theta.shape, -np.inf)
    vals[n_forced:] = np.where(meets, theta[n_forced:], -np.inf)
    return _widened(vals, n_forced + int(np.argmax(vals[n_forced:])), tie_margin)


def _widened(theta: np.ndarray | list[float], k: int, tie_margin: float) -> int:
    """The largest K >= k whose Θ is at least (1 - tie_margin) of Θ(k), when k > 0 (a drafting
    plan) and the margin is on; else k. A plain best (K = 0) is never widened: where plain steps
    win, drafting is not a near tie to break (docs/scheduler.md "Near ties")."""
    if tie_margin <= 0.0 or k <= 0:
        return k
    vals = np.asarray(theta, np.float64)
    bar = (1.0 - tie_margin) * vals[k]
    near = np.flatnonzero(vals[k:] >= bar)
    return k + int(near[-1]) if near.size else k


def row_priced_sps(
    lagged_surv: np.ndarray,
    sps: np.ndarray,
    draft_seconds: np.ndarray,
    *,
    min_len: np.ndarray | int | None = None,
    max_len: np.ndarray | int | None = None,
) -> np.ndarray:
    """The SPS table a lagged K search reads when only the requests K admits are drafted: entry
    R + K prices the forward (`sps`, without the drafter) plus `draft_seconds[n]`, n the requests
    holding a draft among the first K path entries by lagged survival (n = 0 at K = 0: no drafter).
    `draft_seconds` is indexed by drafted rows 0..R. Entries below R stay as `sps` has them; the
    table ends where the path does.

    A drafter whose price grows with its rows (a CPU one: a fixed part plus most of a plain row's
    forward per drafted row) makes "draft everyone" the wrong alternative to "draft no one" at a
    large R: a few confident requests pay where the whole batch does not."""
    num_reqs = lagged_surv.shape[0]
    if sps.size <= num_reqs:
        return np.array(sps, np.float64, copy=True)
    neg, forced = _candidates(lagged_surv, min_len, max_len)
    order = _path_order(neg, forced)[: sps.size - num_reqs - 1]
    return _row_priced(sps, num_reqs, order, draft_seconds)


def _row_priced(
    sps: np.ndarray, num_reqs: int, order: np.ndarray, draft_seconds: np.ndarray
) -> np.ndarray:
    """row_priced_sps along a path already cut to the table (K = 0 .. order.size)."""
    out = np.array(sps[: num_reqs + order.size + 1], np.float64, copy=True)
    # Flat index i = (position - 1)·R + request, and a request's entries come in position order,
    # so its first entry on the path is its position-1 entry.
    rows = np.concatenate([[0], np.cumsum(order < num_reqs)])
    seconds = 1.0 / out[num_reqs:] + np.asarray(draft_seconds, np.float64)[rows]
    out[num_reqs:] = 1.0 / seconds
    return out  # past the path no K is admissible


def selective_k(
    lagged_surv: np.ndarray,
    sps: np.ndarray,
    draft_seconds: np.ndarray,
    *,
    min_len: np.ndarray | int | None = None,
    max_len: np.ndarray | int | None = None,
    min_user_tps: float = 0.0,
    tie_margin: float = 0.0,
) -> tuple[int, np.ndarray, float]:
    """`lagged_global_k` over `row_priced_sps`, the requests that K drafts (sorted indices: those
    with an entry among the first K path candidates, which is what `assign_top_k` admits under the
    same survival) and the predicted Θ at K (-inf where the table holds no admissible K), from one
    pass over the candidates. The same K as the two calls; the lagged planner runs this every
    drafting step on the host, where each pass is a few dozen small numpy calls, and weighs its Θ
    against drafting every row."""
    num_reqs = lagged_surv.shape[0]
    if sps.size <= num_reqs:  # not even K = 0 fits the table
        k = lagged_global_k(lagged_surv, sps, min_len=min_len, max_len=max_len)
        return k, _admitted_rows(lagged_surv, k, min_len, max_len), -np.inf
    if min_len is None and not min_user_tps:
        path = _small_path(lagged_surv, max_len)
        got = (
            None
            if path is None
            else _selective_small(num_reqs, path, sps, draft_seconds, tie_margin)
        )
        if got is not None:
            return got
    neg, forced = _candidates(lagged_surv, min_len, max_len)
    order = _path_order(neg, forced)[: sps.size - num_reqs - 1]
    priced = _row_priced(sps, num_reqs, order, draft_seconds)
    vals = lagged_surv.T.ravel()[order]  # forced first in flat order, then by survival
    theta = _theta(num_reqs, vals, priced)
    n_forced = 0 if forced is None else int(np.count_nonzero(forced))
    if theta.size <= n_forced:  # the forced prefix alone overruns the table
        return n_forced, _admitted_rows(lagged_surv, n_forced, min_len, max_len), -np.inf
    rate = None
    if min_user_tps > 0.0:
        rate = _min_user_rate(lagged_surv, order, priced, theta.size)
    k = _best_k(theta, n_forced, rate, min_user_tps, tie_margin)
    first = order[:k]
    return k, np.sort(first[first < num_reqs]), float(theta[k])


def _selective_small(
    num_reqs: int,
    path: list[tuple[float, int]],
    sps: np.ndarray,
    draft_seconds: np.ndarray,
    tie_margin: float = 0.0,
) -> tuple[int, np.ndarray, float] | None:
    """selective_k over a `_small_path`, with the numpy path's float operations in its order:
    τ = ((R + a1) + a2) + ..., SPS(R + K) = 1 / (1 / sps + drafter seconds of the rows drafted).
    None when a Θ is not a number (argmax's NaN rule is the numpy path's to apply)."""
    path = path[: sps.size - num_reqs - 1]
    table = sps[num_reqs : num_reqs + len(path) + 1].tolist()
    draft = np.asarray(draft_seconds, np.float64).tolist()
    tau, drafted = float(num_reqs), 0
    best = tau * (1.0 / (1.0 / table[0] + draft[0]))
    best_k = 0
    thetas = [best]
    for k, (neg, i) in enumerate(path, 1):
        tau -= neg  # + a, exactly
        drafted += i < num_reqs  # a request's first path entry is its position-1 entry
        theta = tau * (1.0 / (1.0 / table[k] + draft[drafted]))
        if theta != theta:
            return None
        thetas.append(theta)
        if theta > best:  # ties: the smallest K
            best, best_k = theta, k
    if best != best:
        return None
    best_k = _widened(thetas, best_k, tie_margin)
    rows = sorted(i for _, i in path[:best_k] if i < num_reqs)
    return best_k, np.array(rows, np.int64), thetas[best_k]


def _admitted_rows(
    surv: np.ndarray, k: int, min_len: np.ndarray | int | None, max_len: np.ndarray | int | None
) -> np.ndarray:
    return np.flatnonzero(assign_top_k(surv, k, min_len=min_len, max_len=max_len))


def assign_top_k(
    live_surv: np.ndarray,
    k: int,
    *,
    min_len: np.ndarray | int | None = None,
    max_len: np.ndarray | int | None = None,
) -> np.ndarray:
    """Admit the top-K candidates by *live* survival (paper §5.2, dynamic top-K), ties broken by
    (position asc, request asc) so the rank of (r, k) never depends on a[r, k+1..]. Each request's
    admitted set is a prefix; min_len positions are admitted first (even past K), max_len and a = 0
    are never admitted, so fewer than K are admitted when fewer are eligible."""
    path = None if min_len is not None else _small_path(live_surv, max_len)
    if path is not None:
        lens = [0] * live_surv.shape[0]
        for _, i in path[: max(int(k), 0)]:
            lens[i % live_surv.shape[0]] += 1
        return np.array(lens, np.int64)
    neg, forced = _candidates(live_surv, min_len, max_len)
    n_forced = 0 if forced is None else int(np.count_nonzero(forced))
    n_free = int(np.count_nonzero(neg < 0.0))
    return _admit(neg, forced, int(k) - n_forced, n_free)


def planned_tokens(
    surv: np.ndarray,
    k: int,
    *,
    min_len: np.ndarray | int | None = None,
    max_len: np.ndarray | int | None = None,
) -> float:
    """τ(K) = R + the survival of the K candidates `assign_top_k` admits (§3.2.2): the tokens a
    step is expected to emit when K is spent by this survival. Fed the lagged survival a lagged K
    was chosen from, it is what that K was planned on, which the realised tokens then test."""
    lens = assign_top_k(surv, k, min_len=min_len, max_len=max_len)
    gamma = surv.shape[1]
    return float(surv.shape[0]) + float(surv[np.arange(gamma)[None, :] < lens[:, None]].sum())


def expected_throughput(surv: np.ndarray, lengths: np.ndarray, sps: np.ndarray) -> float:
    """Predicted Θ = Σ_r (1 + Σ_{j<=ℓ_r} a_{r,j}) · SPS(R + Σ ℓ_r) (§3.2.2); -inf off the table."""
    lens = np.asarray(lengths)
    b = surv.shape[0] + int(lens.sum())
    if b >= sps.size:
        return -np.inf
    admitted = np.arange(surv.shape[1])[None, :] < lens[:, None]
    return float((surv.shape[0] + surv[admitted].sum()) * sps[b])


# Baselines: each reads only the shape (and values, for threshold) of this step's [R, γ] matrix.


def verify_all(confidences: np.ndarray, *, max_len: np.ndarray | int | None = None) -> np.ndarray:
    """ℓ_r = γ: verify every draft (the classic speculative-decoding baseline)."""
    return fixed(confidences, confidences.shape[1], max_len=max_len)


def fixed(
    confidences: np.ndarray, n: int, *, max_len: np.ndarray | int | None = None
) -> np.ndarray:
    """ℓ_r = min(n, γ, max_len_r): a static verify length."""
    num_reqs, gamma = confidences.shape
    return np.minimum(min(int(n), gamma), _per_request(max_len, num_reqs, gamma)).astype(np.int64)


def mtp1(confidences: np.ndarray, *, max_len: np.ndarray | int | None = None) -> np.ndarray:
    """ℓ_r = 1: the MTP-1 production baseline the paper compares against (§1, Fig. 7)."""
    return fixed(confidences, 1, max_len=max_len)


def threshold(
    confidences: np.ndarray,
    c_min: float,
    *,
    max_len: np.ndarray | int | None = None,
    cumulative: bool = False,
) -> np.ndarray:
    """DeepSpec's static threshold (paper §3.2.2 "prior methods"; deepspec_spec §4.2b): verify the
    longest prefix whose per-step conditional confidences c_{r,k} are all >= c_min. cumulative=True
    compares survival a_{r,k} instead. Either way a step-independent constant decides."""
    c = np.clip(np.asarray(confidences, dtype=np.float64), 0.0, 1.0)
    if cumulative:
        c = np.cumprod(c, axis=1)
    run = np.cumprod(c >= c_min, axis=1).sum(axis=1)
    return np.minimum(run, _per_request(max_len, c.shape[0], c.shape[1])).astype(np.int64)


# Comparison-only policies: never in SERVING_MODES, parse_schedule_mode rejects them.


def oracle(
    accepted_lens: np.ndarray,
    gamma: int,
    sps: np.ndarray,
    *,
    max_len: np.ndarray | int | None = None,
) -> np.ndarray:
    """Clairvoyant replay bound: knows the realised accepted length n_r of each full draft.
    Verifying K drafts, accepted ones first, emits R + min(K, Σ n_r) tokens; the oracle maximises
    that times SPS(R + K) over every admissible K (wasted drafts only pay on a non-monotone table)
    and spreads them by (position asc, request asc). Needs the future: replay/simulation only."""
    n = np.asarray(accepted_lens, dtype=np.int64)
    num_reqs = n.shape[0]
    hi = np.minimum(_per_request(max_len, num_reqs, gamma), gamma)
    good = np.minimum(n, hi)
    kk = np.arange(max(0, min(int(hi.sum()) + 1, sps.size - num_reqs)))
    if kk.size == 0:
        return np.zeros(num_reqs, dtype=np.int64)
    tokens = num_reqs + np.minimum(kk, good.sum())
    k = int(np.argmax(tokens * sps[num_reqs + kk]))
    cols = np.arange(gamma)[:, None]  # position-major [γ, R], like the admission path
    accepted = np.flatnonzero((cols < good[None, :]).ravel())
    wasted = np.flatnonzero(((cols >= good[None, :]) & (cols < hi[None, :])).ravel())
    order = np.concatenate([accepted, wasted])
    return np.bincount(order[:k] % num_reqs, minlength=num_reqs).astype(np.int64)


def retrospective(surv: np.ndarray, sps: np.ndarray) -> np.ndarray:
    """The *biased* scheduler of Appendix A: global argmax of Θ over K, no early stop and no lag,
    on survival that already includes confidences conditioned on this step's realised drafts.
    Admission of x_{r,k} then depends on x_{r,k} itself, which breaks losslessness. Test fixture
    and comparison only; never selectable in serving."""
    return assign_top_k(surv, lagged_global_k(surv, sps))


@dataclass(frozen=True, slots=True)
class ScheduleMode:
    """A parsed `--schedule-mode`: one of SERVING_MODES plus its parameter."""

    name: str
    length: int = 0  # fixed:N
    c_min: float = 0.0  # threshold:C
    lag: int = DEFAULT_LAG  # lagged[:L]

    def __str__(self) -> str:
        return {
            "fixed": f"fixed:{self.length}",
            "threshold": f"threshold:{self.c_min}",
            "lagged": f"lagged:{self.lag}",
        }.get(self.name, self.name)


def parse_schedule_mode(text: str) -> ScheduleMode:
    """`lagged[:L]|sync|verify-all|fixed:N|threshold:C|mtp1` -> ScheduleMode (DESIGN §3 step 2)."""
    name, sep, arg = text.strip().partition(":")
    usage = (
        "expected lagged[:L] (L>=1), sync, verify-all, fixed:N (N>=0), threshold:C (0<=C<=1), mtp1"
    )

    def bad(why: str) -> ConfigError:
        return ConfigError(f"--schedule-mode {text!r}: {why}; {usage}")

    if name not in SERVING_MODES:
        if name in ("retrospective", "oracle"):
            raise bad(f"{name} is a test/replay-only comparison, not a serving policy")
        raise bad("unknown mode")
    if name in ("sync", "verify-all", "mtp1"):
        if sep:
            raise bad(f"{name} takes no parameter")
        return ScheduleMode(name)
    if name == "lagged" and not sep:
        return ScheduleMode(name)
    if not arg:
        raise bad(f"{name} needs a parameter")
    if name == "threshold":
        try:
            c = float(arg)
        except ValueError:
            raise bad("C is not a number") from None
        if not 0.0 <= c <= 1.0:  # also rejects nan
            raise bad("C must be in [0, 1]")
        return ScheduleMode(name, c_min=c)
    try:
        v = int(arg)
    except ValueError:
        raise bad(f"{'N' if name == 'fixed' else 'L'} is not an integer") from None
    if name == "fixed":
        if v < 0:
            raise bad("N must be >= 0")
        return ScheduleMode(name, length=v)
    if v < 1:  # lag 0 would be the retrospective scheduler
        raise bad("L must be >= 1")
    return ScheduleMode(name, lag=v)


def plan_verify_lengths(
    mode: ScheduleMode,
    confidences: np.ndarray,
    sps: np.ndarray,
    *,
    lagged_surv: np.ndarray | None = None,
    min_len: np.ndarray | int | None = None,
    max_len: np.ndarray | int | None = None,
    min_user_tps: float = 0.0,
) -> np.ndarray:
    """One step's ℓ for a serving mode (DESIGN §3 step 2). `confidences` are this step's STS-scaled
    conditional c[r, k]; `lagged_surv` (required for lagged) is the survival published mode.lag
    steps earlier. Baselines honour max_len and raise ℓ to min_len."""
    surv = np.cumprod(np.clip(confidences, 0.0, 1.0), axis=1)
    if mode.name == "sync":
        return early_stop(surv, sps, min_len=min_len, max_len=max_len, min_user_tps=min_user_tps)
    if mode.name == "lagged":
        if lagged_surv is None:
            raise ValueError("lagged mode needs lagged_surv (SurvivalHistory.lagged)")
        k = lagged_global_k(
            lagged_surv, sps, min_len=min_len, max_len=max_len, min_user_tps=min_user_tps
        )
        return assign_top_k(surv, k, min_len=min_len, max_len=max_len)
    if mode.name == "verify-all":
        lens = verify_all(confidences, max_len=max_len)
    elif mode.name == "fixed":
        lens = fixed(confidences, mode.length, max_len=max_len)
    elif mode.name == "threshold":
        lens = threshold(confidences, mode.c_min, max_len=max_len)
    elif mode.name == "mtp1":
        lens = mtp1(confidences, max_len=max_len)
    else:
        raise ValueError(f"not a serving schedule mode: {mode.name!r}")
    num_reqs, gamma = confidences.shape
    hi = np.minimum(_per_request(max_len, num_reqs, gamma), gamma)
    return np.maximum(lens, np.minimum(_per_request(min_len, num_reqs, 0), hi))
