"""Step observations reach the live model, and model versions and control requests reach every
rank through SGLang's own receive -> broadcast -> process path (driven for real on one rank)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace as NS
from typing import Any

import numpy as np
import pytest
import torch
import zmq

from dspark_sglang.capacity_profile import save_profile
from dspark_sglang.sglang_plugin import hooks
from dspark_sglang.sglang_plugin.adapt import BudgetPlanner
from dspark_sglang.sglang_plugin.live_model import LiveModel, ModelUpdate, StagedProfile
from tests.sglang.conftest import GAMMA, R, batch_for, fake_runner, make_profile

Loop = tuple[Callable[..., list], list, Any]  # step(*server_args), replies, controller
OBSERVE_KW = dict.fromkeys(hooks.SIGNATURES[hooks.OBSERVERS + "observe_verify_step"].split()[1:])


@pytest.fixture
def planner(sglang_planner: Callable[..., Any]) -> BudgetPlanner:
    sp = sglang_planner(fake_runner([1] * R))
    p = hooks.STATE.planner
    p._clock = Clock()
    batch, fmap = batch_for(torch.full((R, GAMMA), 0.9), [1] * R, [64] * R)
    sp.prepare_verify_budget(batch, fmap)
    return p


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def observers() -> object:
    """SGLang's DsparkStepObservers with its sinks switched off (their own envs default off)."""
    from sglang.srt.speculative.dspark_components.dspark_observability import (
        DsparkStepObservers,
    )

    obs = DsparkStepObservers.__new__(DsparkStepObservers)
    obs._planner = NS(carries_confidence=True, is_compact_mode=True)
    obs._sts_collect_path = ""
    obs._confidence_probe = NS(maybe_observe=lambda **kw: None)
    obs._block_accept_recorder = None
    obs._info_dumper = NS(enabled=False, note_non_decode_step=lambda: None)
    return obs


def run_steps(p: BudgetPlanner, obs: object, n: int, seconds: float, budget: int | None) -> None:
    layout = None if budget is None else NS(graph_num_tokens=min(R + budget, R * (GAMMA + 1)))
    kw = {**OBSERVE_KW, "bs": R, "verify_token_budget": budget, "layout": layout}
    for _ in range(n):
        p._clock.t += seconds
        obs.observe_verify_step(**kw)


def test_step_times_reach_the_live_model(planner: BudgetPlanner) -> None:
    obs = observers()
    budget = planner.last.budget
    tokens = min(R + budget, R * (GAMMA + 1))
    slow = 2.0 * planner.live.model.predict(R, tokens, planner.ctx)
    run_steps(planner, obs, 40, slow, budget)
    assert planner.live.last_measured == pytest.approx(slow)
    update = planner.live.outgoing()
    assert isinstance(update, ModelUpdate) and update.model.version >= 1
    assert update.model.predict(R, tokens, planner.ctx) == pytest.approx(slow, rel=0.1)
    # A prefill step in between: the next interval spans it and is not a step time.
    n = planner.live._estimator.num_observed
    obs.note_prefill_step()
    run_steps(planner, obs, 1, 5 * slow, budget)
    assert planner.live._estimator.num_observed == n
    run_steps(planner, obs, 1, slow, None)
    assert planner.fallbacks["verify_all"] == 1


def test_accepted_lengths_reach_the_prior(planner: BudgetPlanner) -> None:
    """SGLang's result processor (real code) computes accepted drafts on the host; the prior
    learns from them without another device sync."""
    from sglang.srt.managers.scheduler_components.batch_result_processor import (
        SchedulerBatchResultProcessor,
    )
    from sglang.srt.managers.utils import GenerationBatchResult

    proc = NS(
        metrics_reporter=NS(snapshot_spec_decode_metrics=lambda b, r: None),
        model_worker=NS(on_verify_complete_cpu=lambda *a, **k: None),
        advance_grammar_fsm=lambda r, b: None,
    )
    verify_rows = torch.tensor([GAMMA + 1] * R, dtype=torch.int32)  # every draft verified
    before = planner.prior.rates
    for _ in range(50):
        result = GenerationBatchResult(
            next_token_ids=torch.zeros(R * (GAMMA + 1), dtype=torch.int64),
            accept_lens=torch.full((R,), GAMMA + 1),  # all drafts + bonus accepted
            cap_lens=verify_rows,
            speculative_num_draft_tokens=GAMMA + 1,
        )
        batch = NS(reqs=[NS(is_retracted=True) for _ in range(R)])
        SchedulerBatchResultProcessor._resolve_spec_v2_tokens(proc, result, batch)
    assert all(a > b for a, b in zip(planner.prior.rates, before, strict=True))
    assert planner.prior.rates[0] > 0.9


@pytest.fixture
def loop(monkeypatch: pytest.MonkeyPatch) -> Loop:
    """One rank's receive -> process: SGLang's real SchedulerRequestReceiver.recv_requests and
    Scheduler.process_input_requests with the internal-state controller, on fake sockets."""
    from sglang.srt.managers import scheduler as sm
    from sglang.srt.managers.scheduler_components import internal_state as ist
    from sglang.srt.managers.scheduler_components import request_receiver as rr

    inbox: list = []

    def sock_recv(sock: object, flags: int) -> object:
        if sock == "tokenizer" and inbox:
            return inbox.pop(0)
        raise zmq.ZMQError()

    par = NS(pp_rank=0, attn_tp_rank=0, attn_cp_rank=0, attn_dp_enabled=False, tp_size=1)
    monkeypatch.setattr(rr, "get_parallel", lambda: par)
    monkeypatch.setattr(rr, "get_disagg", lambda: NS(language_only=False))
    monkeypatch.setattr(rr, "sock_recv", sock_recv)
    monkeypatch.setattr(sm, "get_disagg", lambda: NS(enable_pd_role_switch=False))
    monkeypatch.setattr(sm, "get_mm", lambda: NS(mm_feature_transport="none"))
    receiver = rr.SchedulerRequestReceiver(
        recv_from_tokenizer="tokenizer",
        recv_from_rpc="rpc",
        recv_skipper=None,
        input_blocker=None,
        mm_receiver=None,
        server_args=None,
        model_config=NS(is_multimodal=False),
        max_recv_per_poll=-1,
        stream_output=None,
        get_last_batch=lambda: None,
    )
    replies: list = []
    sched = NS(
        session_controller=NS(maybe_reap=lambda now: None),
        flush_wrapper=NS(check_pending=lambda: None),
        external_corpus_manager=None,
        rust_server=None,
        scheduler_stage_metrics=None,
        _tokenized_requests=sm.Scheduler._tokenized_requests,
        send_control_output=lambda out, req: replies.append(out.updated),
    )
    ctl = ist.SchedulerInternalStateController(
        NS(spec_algorithm=NS(is_none=lambda: True)), record_step_time=False
    )
    sched._request_dispatcher = ctl.set_internal_state

    def step(*server_args: dict) -> list:
        inbox.extend(sm.SetInternalStateReq(server_args=a) for a in server_args)
        reqs = receiver.recv_requests(local_reqs=None)
        sm.Scheduler.process_input_requests(sched, list(reqs))
        return reqs

    return step, replies, ctl


def test_updates_ride_the_request_broadcast_and_apply_at_one_point(
    planner: BudgetPlanner, loop: Loop
) -> None:
    step, replies, _ = loop
    run_steps(planner, observers(), 40, 0.05, planner.last.budget)
    update = planner.live.outgoing()
    assert update is not None
    reqs = step()
    assert [type(r) for r in reqs] == [ModelUpdate]  # shipped in local_reqs
    assert planner.live.model is update.model and planner.live.outgoing() is None
    assert replies == []  # our messages are not requests: no reply goes to the tokenizer
    # Another rank applies the same broadcast object alike; a resent copy applies once.
    follower = LiveModel(make_profile().model, leader=False, live=True)
    for _ in range(2):
        follower.apply(update)
    assert follower.model is update.model and follower.applied_seq == update.seq
    assert follower.outgoing() is None  # followers never publish


def test_set_internal_state_keys(planner: BudgetPlanner, loop: Loop, profile_path: Path) -> None:
    step, replies, ctl = loop
    assert {"dspark_profile_reload", "dspark_live_freeze", "dspark_min_user_tps"} <= set(
        ctl._update_handlers()
    )
    # Freeze: no new versions while frozen, then unfreeze.
    step({"dspark_live_freeze": 1})
    assert planner.live.frozen and replies[-1] is True
    run_steps(planner, observers(), 40, 0.05, planner.last.budget)
    assert planner.live.outgoing() is None
    step({"dspark_live_freeze": 0})
    assert not planner.live.frozen
    # Push a profile: overwrite the file, ask every rank to reload; rank 0 reads it once.
    slower = tuple(2 * s for s in make_profile().model.form.seconds)
    save_profile(make_profile(slower, name="pushed"), profile_path)
    reqs = step({"dspark_profile_reload": 1})
    assert isinstance(reqs[0], StagedProfile) and replies[-1] is True
    assert planner.live.model.form.seconds == slower
    # A broken file is refused, on every rank alike, and the model stays.
    profile_path.write_text("name: [")
    step({"dspark_profile_reload": 1})
    assert replies[-1] is False and planner.live.model.form.seconds == slower
    save_profile(make_profile(), profile_path)
    # SLA floor at run time; a negative floor is refused.
    step({"dspark_min_user_tps": 25.0})
    assert planner.min_user_tps == 25.0
    step({"dspark_min_user_tps": -1})
    assert replies[-1] is False and planner.min_user_tps == 25.0
    step({"dspark_min_user_tps": 0})


def test_server_info_block(planner: BudgetPlanner, plugin: object) -> None:
    from sglang.srt.managers.scheduler_components.internal_state import (
        SchedulerInternalStateController,
    )

    run_steps(planner, observers(), 3, 0.02, planner.last.budget)
    ctl = SchedulerInternalStateController(
        NS(spec_algorithm=NS(is_none=lambda: True)), record_step_time=False
    )
    state: dict = {}
    ctl._add_speculative(state)
    info = state["dspark_plugin"]
    assert info["active"] and info["self_test"].startswith("ok")
    assert info["k_last"] == planner.last.budget and info["measured_step_ms"] == 20.0
    assert np.isfinite(info["predicted_step_ms"]) and info["tiers"] == [4, 8, 16, 24, 32]
