"""The only file that names SGLang's dotted paths (STYLE §3). `self_test` checks that every name we
hook or read exists with the signature we were written against; `install` registers the hooks with
SGLang's HookRegistry. Each hook is a few lines that hand SGLang's objects to adapt.py.

    REPLACE  dspark_planner.HostConfidenceBudgetPlanner          our K (adapt.make_planner_class)
    AROUND   dspark_planner.build_sps_cost_table                 SGLang's table = our profile
    AROUND   DSparkVerifyPlanner.prepare_verify_budget / compute_budget_sync   batch KV tokens
    AFTER    DsparkStepObservers.observe_verify_step / note_*    step times -> live model
    AFTER    SchedulerBatchResultProcessor._resolve_spec_v2_tokens            acceptance -> prior
    AROUND   SchedulerRequestReceiver.recv_requests              leader ships model updates
    AFTER    SchedulerRequestReceiver._pull_raw_reqs             leader stages a profile reload
    AROUND   Scheduler.process_input_requests                    every rank applies them
    AFTER    SchedulerInternalStateController._update_handlers / _add_speculative   control
"""

from __future__ import annotations

import inspect
import logging
import pkgutil
from importlib.metadata import PackageNotFoundError, version
from typing import Any

import numpy as np

from dspark_sglang.sglang_plugin import adapt, control
from dspark_sglang.sglang_plugin.live_model import ModelUpdate, StagedProfile

log = logging.getLogger("dspark_sglang.sglang_plugin")
SGLANG_VERSION = "0.5.23"

_DS = "sglang.srt.speculative.dspark_components."
PLANNER = _DS + "dspark_planner."
OBSERVERS = _DS + "dspark_observability.DsparkStepObservers."
_MGR = "sglang.srt.managers."
RECEIVER = _MGR + "scheduler_components.request_receiver.SchedulerRequestReceiver."
CONTROLLER = _MGR + "scheduler_components.internal_state.SchedulerInternalStateController."
RESULTS = _MGR + "scheduler_components.batch_result_processor.SchedulerBatchResultProcessor."
SCHEDULER = _MGR + "scheduler.Scheduler."

# Everything we patch or call, with the parameters the hooks rely on (checked before patching).
SIGNATURES: dict[str, str] = {
    PLANNER + "HostConfidenceBudgetPlanner.__init__": "self sps_table cfg model_runner "
    "relay_lag_steps",
    PLANNER + "HostConfidenceBudgetPlanner.compute_budget": "self confidence generation "
    "current_generation req_pool_indices_cpu",
    PLANNER + "HostConfidenceBudgetPlanner._shift_to_lag": "self confidence generation "
    "req_pool_indices_cpu",
    PLANNER + "build_sps_cost_table": "verify_num_draft_tokens",
    PLANNER + "DSparkVerifyPlanner.prepare_verify_budget": "self batch future_map",
    PLANNER + "DSparkVerifyPlanner.compute_budget_sync": "self confidence prefix_lens "
    "req_pool_indices",
    OBSERVERS + "observe_verify_step": "self forward_ct reqs bs proposal_folded verify_ids_2d "
    "target_logits layout confidence confidence_raw prefix_lens draft_tokens draft_block "
    "sampling_info correct_len cap_trim_lens bonus commit_lens verify_token_budget "
    "req_pool_indices verify_tier_num_tokens dp_tier_num_tokens",
    OBSERVERS + "note_prefill_step": "self",
    OBSERVERS + "note_idle_decode_step": "self",
    RESULTS + "_resolve_spec_v2_tokens": "self result batch",
    RECEIVER + "recv_requests": "self local_reqs",
    RECEIVER + "_pull_raw_reqs": "self",
    SCHEDULER + "process_input_requests": "self recv_reqs",
    CONTROLLER + "_update_handlers": "self",
    CONTROLLER + "_add_speculative": "self state",
}
# msgspec structs we build or read, with the fields we use.
FIELDS: dict[str, str] = {
    PLANNER + "VerifyBudgetDecision": "budget predicted_step_seconds predicted_theta",
    PLANNER + "DSparkScheduleConfig": "gamma min_verify_len max_verify_len survival_eps",
    _DS + "dspark_sps.SpsCostTable": "sample_batch_tokens sample_steps_per_sec max_batch_tokens",
    _DS + "dspark_sps.SpsAdditiveCostTable": "bias_seconds bs_probes alpha_seconds m_probes "
    "theta_seconds",
    _MGR + "io_struct.SetInternalStateReq": "server_args",
    "sglang.srt.speculative.ragged_verify.RaggedVerifyLayout": "graph_num_tokens",
}
NAMES = (
    _DS + "dspark_sps.is_uninitialized_sps_table",
    _MGR + "scheduler_components.internal_state.UpdateRejected",
    "sglang.srt.runtime_context.get_parallel",
    "sglang.srt.plugins.hook_registry.HookRegistry",
)


class PluginRefused(RuntimeError):
    """This SGLang is not the one the hooks were written against."""


def self_test(expected_version: str = SGLANG_VERSION) -> None:
    """Raise PluginRefused naming every problem: version, missing names, changed signatures."""
    try:
        found = version("sglang")
    except PackageNotFoundError:
        found = "not installed"
    problems = [f"sglang {found} is installed; this plugin supports {expected_version}"]
    problems = problems if found != expected_version else []
    for path in (*SIGNATURES, *FIELDS, *NAMES):
        try:
            obj = pkgutil.resolve_name(path)
            got = tuple(inspect.signature(obj).parameters) if path in SIGNATURES else ()
        except (ImportError, AttributeError, ValueError, TypeError) as e:
            problems.append(f"{path}: missing ({type(e).__name__}: {e})")
            continue
        if path in SIGNATURES and got != tuple(SIGNATURES[path].split()):
            problems.append(f"{path}: signature {got}, expected ({SIGNATURES[path]})")
        have = getattr(obj, "__struct_fields__", ())
        if lost := [f for f in FIELDS.get(path, "").split() if f not in have]:
            problems.append(f"{path}: fields {lost} are gone")
    if problems:
        raise PluginRefused(
            "dspark_sglang's SGLang plugin refuses to install its hooks:\n  - "
            + "\n  - ".join(problems)
            + f"\nInstall sglang=={expected_version}, or leave 'dspark' out of SGLANG_PLUGINS to"
            " run SGLang's own planner."
        )


class _State:
    """This process's plugin: config from install(); the planner once SGLang builds its own
    (decode servers in compact / cap-accept mode)."""

    config: control.PluginConfig | None = None
    planner: adapt.BudgetPlanner | None = None


STATE = _State()


def _arg(args: tuple, kwargs: dict, i: int, name: str) -> Any:
    return kwargs[name] if name in kwargs else args[i]


def _is_leader() -> bool:
    """The rank that receives requests for its attention group (SGLang broadcasts from it)."""
    from sglang.srt.runtime_context import get_parallel

    try:
        p = get_parallel()
        return p.pp_rank == 0 and p.attn_tp_rank == 0 and p.attn_cp_rank == 0
    except (RuntimeError, ValueError, AttributeError):  # not published: a single process
        return True


def _graph_tiers(model_runner: Any) -> tuple[int, ...]:
    runner = getattr(model_runner, "decode_cuda_graph_runner", None)
    if runner is None or not getattr(runner, "ragged_verify_mode", False):
        return ()
    return tuple(runner.capture_num_tokens)


def _attach(sglang_planner: Any) -> adapt.BudgetPlanner:
    """Build this process's BudgetPlanner from SGLang's freshly built one."""
    import msgspec

    cfg = STATE.config or control.PluginConfig.from_env()
    table = msgspec.to_builtins(sglang_planner.sps_table)
    leader = _is_leader()
    STATE.planner = adapt.BudgetPlanner(
        cfg,
        sglang_planner.cfg,
        adapt.load_model(cfg, table),
        leader=leader,
        tiers=_graph_tiers(getattr(sglang_planner, "_model_runner", None)),
        metrics=control.Metrics.maybe() if leader else None,
    )
    log.info("dspark: our planner is in charge (profile %s, leader %s)", cfg.profile, leader)
    return STATE.planner


def _build_table(original: Any, *args: Any, **kwargs: Any) -> Any:
    import msgspec
    from sglang.srt.speculative.dspark_components import dspark_sps

    from dspark_sglang.sglang_convert import sps_for_sglang

    cfg = STATE.config
    data = sps_for_sglang(cfg.profile) if cfg and cfg.profile else None
    if data is None:
        table = original(*args, **kwargs)
        if cfg and cfg.live and dspark_sps.is_uninitialized_sps_table(table):
            # A flat table would switch SGLang's ragged scheduler off for good; keep it on and
            # let the live model learn the curve per graph tier.
            data = {"sample_batch_tokens": [1, 2], "sample_steps_per_sec": [1.0, 1.0]}
            data["max_batch_tokens"] = table.max_batch_tokens
        else:
            return table
    cls = dspark_sps.SpsAdditiveCostTable if "bias_seconds" in data else dspark_sps.SpsCostTable
    return msgspec.convert(data, cls)


def _prepare_budget(original: Any, self: Any, *args: Any, **kwargs: Any) -> Any:
    p, batch = STATE.planner, _arg(args, kwargs, 0, "batch")
    if p is not None and getattr(batch, "seq_lens_cpu", None) is not None:
        p.note_batch(int(batch.seq_lens_cpu.sum()))
    return original(self, *args, **kwargs)


def _budget_sync(original: Any, self: Any, **kwargs: Any) -> Any:
    if STATE.planner is not None:  # overlap off: confidence.to("cpu") syncs here anyway
        STATE.planner.note_batch(int(kwargs["prefix_lens"].sum()))
    return original(self, **kwargs)


def _observe_step(result: Any, self: Any, **kwargs: Any) -> None:
    if STATE.planner is not None:
        layout = kwargs["layout"]
        tokens = None if layout is None else int(layout.graph_num_tokens)
        STATE.planner.observe_step(int(kwargs["bs"]), kwargs["verify_token_budget"], tokens)


def _non_decode_step(result: Any, self: Any) -> None:
    if STATE.planner is not None:
        STATE.planner.reset_clock()


def _acceptance(result: Any, self: Any, *args: Any, **kwargs: Any) -> None:
    out = _arg(args, kwargs, 0, "result")
    accepted = getattr(out, "num_correct_drafts_per_req_cpu", None)
    if STATE.planner is not None and accepted is not None:
        rows = None if out.cap_lens is None else np.asarray(out.cap_lens.tolist())  # host copy
        STATE.planner.observe_acceptance(rows, np.asarray(accepted, np.int64))


def _recv_requests(original: Any, self: Any, local_reqs: list | None = None) -> Any:
    update = STATE.planner.live.outgoing() if STATE.planner is not None else None
    if update is not None:  # rides the broadcast SGLang already does (local_reqs)
        local_reqs = [*(local_reqs or []), update]
    return original(self, local_reqs=local_reqs)


def _pull_raw_reqs(result: Any, self: Any) -> Any:
    if STATE.planner is None or not result:
        return None
    from sglang.srt.managers.io_struct import SetInternalStateReq

    out = []
    for req in result:
        if isinstance(req, SetInternalStateReq) and control.KEY_RELOAD in req.server_args:
            out.append(STATE.planner.stage_profile())  # before the request it belongs to
        out.append(req)
    return out


def _process_input(original: Any, self: Any, recv_reqs: list) -> Any:
    ours = [r for r in recv_reqs if isinstance(r, ModelUpdate | StagedProfile)]
    if ours:
        for msg in ours:
            if STATE.planner is not None:
                STATE.planner.receive(msg)
        recv_reqs = [r for r in recv_reqs if not isinstance(r, ModelUpdate | StagedProfile)]
    return original(self, recv_reqs)


def _update_handlers(result: dict, self: Any) -> dict | None:
    if STATE.planner is None:
        return None
    from sglang.srt.managers.scheduler_components.internal_state import UpdateRejected

    return {**result, **control.update_handlers(STATE.planner, UpdateRejected)}


def _server_info(result: Any, self: Any, state: dict) -> None:
    p = STATE.planner
    state["dspark_plugin"] = (
        p.snapshot()
        if p is not None
        else {
            "active": False,
            "why": "no DSpark budget planner (SGLANG_RAGGED_VERIFY_MODE=static?)",
        }
    )
    state["dspark_plugin"]["self_test"] = f"ok: sglang {SGLANG_VERSION}"


def install(cfg: control.PluginConfig) -> None:
    """Register every hook; SGLang's load_plugins() applies them after all plugins ran."""
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType
    from sglang.srt.speculative.dspark_components import dspark_planner

    STATE.config = cfg
    planner_cls = adapt.make_planner_class(
        dspark_planner.HostConfidenceBudgetPlanner, dspark_planner.VerifyBudgetDecision, _attach
    )
    around, after = HookType.AROUND, HookType.AFTER
    for target, hook, kind in (
        (PLANNER + "HostConfidenceBudgetPlanner", planner_cls, HookType.REPLACE),
        (PLANNER + "build_sps_cost_table", _build_table, around),
        (PLANNER + "DSparkVerifyPlanner.prepare_verify_budget", _prepare_budget, around),
        (PLANNER + "DSparkVerifyPlanner.compute_budget_sync", _budget_sync, around),
        (OBSERVERS + "observe_verify_step", _observe_step, after),
        (OBSERVERS + "note_prefill_step", _non_decode_step, after),
        (OBSERVERS + "note_idle_decode_step", _non_decode_step, after),
        (RESULTS + "_resolve_spec_v2_tokens", _acceptance, after),
        (RECEIVER + "recv_requests", _recv_requests, around),
        (RECEIVER + "_pull_raw_reqs", _pull_raw_reqs, after),
        (SCHEDULER + "process_input_requests", _process_input, around),
        (CONTROLLER + "_update_handlers", _update_handlers, after),
        (CONTROLLER + "_add_speculative", _server_info, after),
    ):
        HookRegistry.register(target, hook, kind)
