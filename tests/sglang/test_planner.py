"""SGLang's own DSparkVerifyPlanner, built and driven on CPU tensors with a fake model runner,
returns our policy's decisions: K from `lagged_global_k` priced by the ceil-bucket model, fresh
requests from the acceptance prior, and SGLang's live top-K equal to `assign_top_k`."""

from __future__ import annotations

import time
from collections.abc import Callable
from types import SimpleNamespace as NS
from typing import Any

import numpy as np
import pytest
import torch

from dspark_sglang.algo.survival import AcceptancePrior
from dspark_sglang.algo.verify_budget import assign_top_k, lagged_global_k
from dspark_sglang.capacity_profile import load_profile
from dspark_sglang.sglang_plugin import hooks
from dspark_sglang.sglang_plugin.control import PluginConfig
from tests.sglang.conftest import GAMMA, TIERS, R, batch_for, fake_runner, make_profile


def expected_k(conf: np.ndarray, fresh: np.ndarray, ctx: int, model: object) -> int:
    surv = np.cumprod(conf, axis=1)
    surv[fresh] = AcceptancePrior.uniform(GAMMA).survival
    sps = model.sps_array(R, R * (GAMMA + 1), ctx)  # type: ignore[attr-defined]
    return lagged_global_k(surv, sps, max_len=GAMMA)


def test_sglang_planner_returns_our_k_and_prices_fresh_requests_by_the_prior(
    sglang_planner: Callable[..., Any], profile_path: object
) -> None:
    gen = [1, 1, 2, 1, 3, 1]
    planner = sglang_planner(fake_runner(gen))
    assert type(planner._budget_planner).__name__ == "DsparkBudgetPlanner"
    assert not planner.is_verify_all  # SGLang's table is our profile, not the flat default
    g = torch.Generator().manual_seed(0)
    conf = 0.5 + 0.5 * torch.rand(R, GAMMA, generator=g)
    lagged_gen = [1, 1, 1, 0, 3, 1]  # rows 2 (slot reused) and 3 (new) are fresh
    seq_lens = [100, 200, 5, 7, 300, 50]
    batch, fmap = batch_for(conf, lagged_gen, seq_lens)
    planner.prepare_verify_budget(batch, fmap)

    fresh = np.array([False, False, True, True, False, False])
    model = load_profile(profile_path).model
    k = expected_k(conf.double().numpy(), fresh, sum(seq_lens), model)
    assert batch.spec_info.verify_token_budget == k
    assert batch.spec_verify_tier_num_tokens == min(R + k, R * (GAMMA + 1))
    d = planner.take_budget_decision()
    assert d.budget == k and d.predicted_step_seconds == pytest.approx(model.predict(R, R + k))
    # SGLang's live top-K (the torch path of its Triton kernel) admits what assign_top_k does.
    from sglang.kernels.ops.speculative.dspark.dspark_schedule import ScheduleVerifyLensTopk

    live = 0.3 + 0.7 * torch.rand(R, GAMMA, generator=g)
    lens = ScheduleVerifyLensTopk.execute(confidence=live, budget=k, cfg=planner._schedule_cfg)
    ours = assign_top_k(np.cumprod(live.double().numpy(), axis=1), k, max_len=GAMMA)
    assert lens.tolist() == (1 + ours).tolist()


def test_ceil_pricing_differs_from_sglangs_floor_lookup(sglang_planner: Callable[..., Any]) -> None:
    """All-certain drafts: B = R + K. SGLang's floor lookup thinks B = 23 still runs at the
    16-token speed; the step replays the 24-token graph, so we stop at the 16 tier instead."""
    from sglang.srt.speculative.dspark_components import dspark_planner as dp

    n = 4
    conf = torch.full((n, GAMMA), 0.999)
    batch, fmap = batch_for(conf, [1] * n, [10] * n)
    planner = sglang_planner(fake_runner([1] * n))
    planner.prepare_verify_budget(batch, fmap)
    ours = batch.spec_info.verify_token_budget
    floor_table = dp.SpsCostTable(
        sample_batch_tokens=list(TIERS), sample_steps_per_sec=[1 / s for s in make_profile()
        .model.form.seconds], max_batch_tokens=TIERS[-1],
    )  # fmt: skip
    original = dp.compute_verify_token_budget(
        history_survival_probs=torch.cumprod(conf, 1), sps_table=floor_table,
        cfg=planner._schedule_cfg,
    )  # fmt: skip
    assert n + ours == 16  # the top of a tier
    assert n + original.budget == n * (GAMMA + 1)  # 20: priced at SPS(16), replays 24


def test_overlap_off_uses_the_carry_ring_and_the_batch_context(
    sglang_planner: Callable[..., Any],
) -> None:
    """Overlap off: SGLang's carry ring delays confidences by two steps; our subclass keeps it."""
    gen = [1] * R
    planner = sglang_planner(fake_runner(gen), overlap=False)
    bp = planner._budget_planner
    assert bp.carry_steps == 2
    steps = [torch.full((R, GAMMA), c) for c in (0.95, 0.2, 0.6)]
    ks = []
    for conf in steps:
        ks.append(
            planner.compute_budget_sync(
                confidence=conf, prefix_lens=torch.full((R,), 40), req_pool_indices=torch.arange(R)
            )
        )
    assert hooks.STATE.planner.ctx == 40 * R
    # Steps 1-2 see no history (prior rows); step 3 sees step 1's confidences.
    prior_only = expected_k(np.zeros((R, GAMMA)), np.ones(R, bool), 40 * R, bp.dspark.live.model)
    assert ks[:2] == [prior_only, prior_only]
    assert ks[2] == expected_k(steps[0].double().numpy(), np.zeros(R, bool), 40 * R,
                               bp.dspark.live.model)  # fmt: skip


def test_forced_budget_frac_and_sglang_tiers(sglang_planner: Callable[..., Any]) -> None:
    planner = sglang_planner(fake_runner([1] * R, tiers=(8, 16, 32)))
    batch, fmap = batch_for(torch.full((R, GAMMA), 0.9), [1] * R, [1] * R)
    planner.prepare_verify_budget(batch, fmap)
    assert hooks.STATE.planner.live.model.form.buckets == (8, 16, 32)  # rebased to SGLang's
    planner.set_forced_budget_frac(0.5)
    planner.prepare_verify_budget(batch, fmap)
    assert batch.spec_info.verify_token_budget == R * GAMMA // 2
    assert hooks.STATE.planner.fallbacks["forced_budget_frac"] == 1


def test_planner_path_under_one_millisecond(plugin: object) -> None:
    """STYLE §3: R = 128, γ = 7 against the EP8 analytic profile (EP max-load term included)."""
    from dspark_sglang.sglang_plugin.adapt import BudgetPlanner

    model = load_profile("engine_profiles/dsv4-like-h200-ep8.yaml").model
    sc = NS(gamma=7, min_verify_len=1, survival_eps=1e-6, resolved_max_verify_len=lambda: 8)
    p = BudgetPlanner(PluginConfig(), sc, model, leader=True)
    rng = np.random.default_rng(0)
    conf, known = rng.uniform(0.3, 1.0, (128, 7)), rng.uniform(size=128) > 0.1
    p.note_batch(128 * 2000)
    p.budget(conf, known)  # warm the E[max load] cache
    times = []
    for _ in range(30):
        t = time.perf_counter()
        p.budget(conf, known)
        times.append(time.perf_counter() - t)
    assert float(np.median(times)) < 1e-3
