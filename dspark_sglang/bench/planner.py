"""`python -m dspark_sglang.bench.planner`: host time the engine's verify-length planner adds to
every decode step, by phase, for each schedule mode.

Drives `engine.planner.VerifyPlanner` the way the engine's step does (lagged: budget, then
draft_rows or a probe, or skip; then plan; then observe with the step's record) without a model:
draft confidences are Beta(4, 1.5) draws (a trained head's spread), each verified draft is
accepted with its own confidence, and each step's record carries the capacity model's own time
for it, so the live estimator sees a steady engine. On the CPU engine a step is 10–40 ms, so a
millisecond here is a few percent of throughput; on a GPU the lagged K runs on the overlap thread
but plan and observe do not.

`--evict-mb N` runs a stand-in for the engine's torch work where the engine runs it (the drafter
before `plan`, the forward between `plan` or `skip` and `observe`): a matrix product over N MB of
weights. Untimed; what it changes is the state the planner's next phase finds the caches in. In
the engine the planner runs right after that work, and its numpy calls cost about 3x what the
same calls cost back to back (replayed planner calls from the CPU engine, 2026-12-04: 185 µs a
step warm, 650-705 with a 16 MB product between phases, 600 timed inside the engine at c = 2);
0 (default) times the warm planner.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch

from dspark_sglang.algo.verify_budget import parse_schedule_mode
from dspark_sglang.capacity_profile import load_profile
from dspark_sglang.config import ConfigError, DraftConfig
from dspark_sglang.engine.planner import VerifyPlanner
from dspark_sglang.hostinfo import host_facts
from dspark_sglang.types import StepRecord

PHASES = ("budget", "rows", "skip", "plan", "observe")
DEFAULT_PROFILE = Path("engine_profiles/cpu-tiny-moe.yaml")


def _logits(rng: np.random.Generator, num_reqs: int, gamma: int) -> np.ndarray:
    p = np.clip(rng.beta(4.0, 1.5, (num_reqs, gamma)), 1e-6, 1.0 - 1e-6)
    return np.log(p / (1.0 - p))


def _record(
    step: int, num_reqs: int, tokens: int, ctx: int, seconds: float, **drafted: float
) -> StepRecord:
    """A decode step's record as the engine writes it (no prefill), timed as the model prices it."""
    return StepRecord(
        step=step,
        num_reqs=num_reqs,
        num_tokens=tokens,
        num_prefill_tokens=0,
        num_decode_reqs=num_reqs,
        kv_tokens=ctx,
        step_seconds=float(seconds),
        verify_budget_k=tokens - num_reqs,
        **drafted,  # type: ignore[arg-type]
    )


class Evictor:
    """The engine's torch work between planner phases, as a stand-in: x [64, 1024] times a
    weight of `mb` MB (a forward streams its weights through the caches; its MKL and ATen code
    takes the instruction caches). mb = 0: nothing."""

    def __init__(self, mb: int) -> None:
        cols = mb * (1 << 20) // (4 * 1024)
        self.x = torch.randn(64, 1024) if cols else None
        self.w = torch.randn(1024, cols) if cols else None
        self.sink = 0.0

    def __call__(self) -> None:
        if self.x is not None:
            self.sink += float((self.x @ self.w)[0, 0])


def run_mode(
    mode: str,
    num_reqs: int,
    steps: int,
    gamma: int,
    profile: Path,
    seed: int,
    evict: Evictor | None = None,
    replan_every: int = DraftConfig().replan_every,
) -> dict[str, object]:
    """One planner fed `steps` synthetic steps at R = num_reqs; ns per phase summed. `evict`
    runs where the engine runs the drafter and the forward. As a server configures it: the
    capacity-driven modes (sync, lagged) get the profile and the live estimator, the others
    neither (a server gives them a capacity model only with --capacity-profile)."""
    evict = evict or Evictor(0)
    cap = load_profile(profile).model
    sched = parse_schedule_mode(mode)
    priced = cap if sched.name in ("sync", "lagged") else None
    p = VerifyPlanner(sched, gamma, priced, None, True, 0.0, False, True, replan_every=replan_every)
    rng = np.random.default_rng(seed)
    ids = list(range(num_reqs))
    max_len = np.full(num_reqs, gamma)
    ctx = 256 * num_reqs
    ns = dict.fromkeys(PHASES, 0)
    per_step = np.empty(steps)
    drafted = verified = 0
    for s in range(steps):
        ctx += num_reqs
        took = dict.fromkeys(PHASES, 0)
        rows: np.ndarray | None = None
        k = None
        if p.plans_before_drafting:
            t = time.perf_counter_ns()
            k = p.budget(ids, max_len, ctx)
            took["budget"] = time.perf_counter_ns() - t
            if k == 0 and not p.should_probe():
                t = time.perf_counter_ns()
                plan = p.skip(ids, max_len, ctx)
                took["skip"] = time.perf_counter_ns() - t
                evict()  # the forward
                rec = _record(s, num_reqs, num_reqs, ctx, cap.predict(num_reqs, num_reqs, ctx))
                none = np.zeros(0, np.int64)
                t = time.perf_counter_ns()
                p.observe(none, none, rec, [])
                took["observe"] = time.perf_counter_ns() - t
                per_step[s] = sum(took.values())
                for name, v in took.items():
                    ns[name] += v
                continue
            t = time.perf_counter_ns()
            rows = p.draft_rows(ids, k, max_len) if k else p.probe_rows(num_reqs)
            took["rows"] = time.perf_counter_ns() - t
        sel = np.arange(num_reqs) if rows is None else np.asarray(rows)
        whole = None if rows is None or sel.size == num_reqs else (ids, max_len, ctx)
        sub_ids = [ids[i] for i in sel]
        conf_logits = _logits(rng, sel.size, gamma)
        evict()  # the drafter
        t = time.perf_counter_ns()
        plan = p.plan(sub_ids, conf_logits, max_len[sel], ctx, k, whole)
        took["plan"] = time.perf_counter_ns() - t
        lens = plan.lengths
        evict()  # the forward
        # each verified draft accepted with its own confidence, until the first rejection
        ok = rng.random((sel.size, gamma)) < 1.0 / (1.0 + np.exp(-conf_logits))
        run_len = np.where(ok.all(axis=1), gamma, np.argmin(ok, axis=1))
        acc = np.minimum(run_len, lens).astype(np.int64)
        drafted += 1
        verified += int(lens.sum())
        tokens = num_reqs + int(lens.sum())
        rec = _record(
            s,
            num_reqs,
            tokens,
            ctx,
            cap.predict(num_reqs, tokens, ctx, draft_rows=int(sel.size)),
            draft_seconds=float(cap.draft_seconds(int(sel.size))),
            num_draft_reqs=int(sel.size),
            num_accepted=int(acc.sum()),
        )
        t = time.perf_counter_ns()
        p.observe(lens, acc, rec, sub_ids)
        took["observe"] = time.perf_counter_ns() - t
        per_step[s] = sum(took.values())
        for name, v in took.items():
            ns[name] += v
    p.close()
    return {
        "mode": mode,
        "R": num_reqs,
        "steps": steps,
        "drafting_steps": drafted,
        "verify_tokens_per_step": round(verified / steps, 2),
        "pinned_steps": p.pinned_steps,
        "mean_us": round(float(per_step.mean()) / 1e3, 1),
        "median_us": round(float(np.median(per_step)) / 1e3, 1),
        **{f"{name}_us": round(v / steps / 1e3, 1) for name, v in ns.items()},
    }


def _ints(text: str, flag: str) -> list[int]:
    try:
        vals = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ConfigError(f"{flag}: expected comma-separated integers, got {text!r}") from None
    if not vals or min(vals) < 1:
        raise ConfigError(f"{flag}: expected positive integers, got {text!r}")
    return vals


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m dspark_sglang.bench.planner",
        description="Host µs per decode step spent in the verify-length planner, by phase "
        "(mean over steps; lagged: budget = its K, rows = draft_rows/probe_rows, skip = a K = 0 "
        "step), with the modes' decisions on synthetic confidences.",
    )
    parser.add_argument("--modes", default="lagged,sync,verify-all")
    parser.add_argument("--reqs", default="1,8,64", help="batch sizes R")
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--gamma", type=int, default=7, help="draft tokens per request")
    parser.add_argument("--profile", type=Path, default=DEFAULT_PROFILE, help="engine profile YAML")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--evict-mb",
        type=int,
        default=0,
        help="MB of weights a stand-in matrix product streams where the engine runs the drafter "
        "and the forward (untimed): the planner then runs with the caches as the engine leaves "
        "them; 0 = back to back (warm)",
    )
    parser.add_argument(
        "--replan-every",
        type=int,
        default=DraftConfig().replan_every,
        help="lagged: the server's --lagged-replan-every (1 = a K search every step; default "
        "%(default)s)",
    )
    parser.add_argument("--json", action="store_true", help="print one JSON line")
    args = parser.parse_args(argv)
    if args.steps < 1:
        parser.error("--steps must be >= 1")
    if args.gamma < 1:
        parser.error("--gamma must be >= 1")
    if args.evict_mb < 0:
        parser.error("--evict-mb must be >= 0")
    if args.replan_every < 1:
        parser.error("--replan-every must be >= 1")
    if not args.profile.is_file():
        parser.error(f"--profile {args.profile}: no such file")
    try:
        reqs = _ints(args.reqs, "--reqs")
    except ConfigError as e:
        parser.error(str(e))
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    for m in modes:
        try:
            parse_schedule_mode(m)
        except ConfigError as e:
            parser.error(f"--modes: {e}")
    if not modes:
        parser.error("--modes: no mode given")
    evict = Evictor(args.evict_mb)
    rows = [
        run_mode(m, r, args.steps, args.gamma, args.profile, args.seed, evict, args.replan_every)
        for r in reqs
        for m in modes
    ]
    if args.json:
        meta = {
            "command": "python -m dspark_sglang.bench.planner " + " ".join(argv or sys.argv[1:]),
            "profile": str(args.profile),
            "evict_mb": args.evict_mb,
            "replan_every": args.replan_every,
            "numpy": np.__version__,
            "host": host_facts(),
        }
        print(json.dumps({"results": rows, "meta": meta}))
        return 0
    head = f"{'mode':<12}{'R':>4}{'drafting':>9}{'verify/step':>12}{'mean_us':>9}"
    print(head + "".join(f"{n + '_us':>11}" for n in PHASES))
    for r in rows:
        line = (
            f"{r['mode']:<12}{r['R']:>4}{r['drafting_steps']:>9}"
            f"{r['verify_tokens_per_step']:>12.2f}{r['mean_us']:>9.1f}"
        )
        print(line + "".join(f"{r[n + '_us']:>11.1f}" for n in PHASES))
    return 0


if __name__ == "__main__":
    sys.exit(main())
