"""`python -m dspark_sglang.bench.capacity`: how well the live capacity model tracks the engine.

Runs the engine under steady load (closed loop, `--concurrency` requests in flight, speculative
decoding with the chosen schedule mode), records every step's predicted vs measured seconds,
injects a slowdown midway, and reports the step-time MAPE after warm-up, before and after the
slowdown, and how many steps the model took to re-converge. Writes a PNG of predicted vs measured
step time.

Slowdowns: `hog` starts a CPU hog process on every core (on a 2-core host the engine then runs in
OS time slices, so step times turn bimodal); `throttle:F` makes every target forward and drafter
pass take F times as long from then on (the engine sleeps (F-1) x the pass's time after it), a
device that got slower, e.g. thermal throttling or a noisy neighbour on the accelerator.
"""

from __future__ import annotations

import argparse
import json
import math
import multiprocessing as mp
import os
import shlex
import sys
import time
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path

import numpy as np

from dspark_sglang.assets import ASSETS_DIR, bundled_target_dir
from dspark_sglang.engine.engine import LLM
from dspark_sglang.types import SamplingParams, StepRecord


def _hog(stop: mp.Event) -> None:  # type: ignore[valid-type]
    x = 1.0
    while not stop.is_set():  # type: ignore[attr-defined]
        for _ in range(10_000):
            x = x * 1.0000001 + 1e-9


def throttled(fn: Callable, factor: float) -> Callable:
    """fn, taking `factor` times as long (sleeps for the extra time after each call)."""

    def call(*args: object, **kwargs: object) -> object:
        t0 = time.perf_counter()
        out = fn(*args, **kwargs)
        time.sleep((factor - 1.0) * (time.perf_counter() - t0))
        return out

    return call


def parse_slowdown(text: str) -> tuple[str, float]:
    if text == "hog":
        return "hog", math.nan
    kind, _, val = text.partition(":")
    try:
        factor = float(val)
    except ValueError:
        factor = math.nan
    if kind != "throttle" or not factor > 1.0:
        raise argparse.ArgumentTypeError(f"expected hog or throttle:F with F > 1, got {text!r}")
    return kind, factor


def rolling_mape(pred: np.ndarray, meas: np.ndarray, window: int) -> np.ndarray:
    ape = np.abs(pred - meas) / meas
    out = np.full(ape.size, np.nan)
    for i in range(window - 1, ape.size):
        out[i] = float(np.mean(ape[i - window + 1 : i + 1]))
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m dspark_sglang.bench.capacity", description=__doc__)
    ap.add_argument("--model-path", default=str(bundled_target_dir()))
    ap.add_argument("--draft-model-path", default=str(ASSETS_DIR / "drafters" / "dspark"))
    ap.add_argument("--schedule-mode", default="lagged")
    ap.add_argument(
        "--capacity-profile", help="start from this profile (default: profile at start)"
    )
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--steps", type=int, default=900)
    ap.add_argument("--slowdown-at", type=int, default=450, help="step that starts the CPU hog")
    ap.add_argument("--hogs", type=int, default=os.cpu_count() or 2)
    ap.add_argument(
        "--slowdown",
        type=parse_slowdown,
        default="hog",
        help="hog (CPU hog processes, --hogs of them) or throttle:F (passes take F x as long)",
    )
    ap.add_argument("--warmup", type=int, default=100)
    ap.add_argument("--window", type=int, default=50, help="rolling MAPE window (steps)")
    ap.add_argument("--plot", type=Path)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    records: list[StepRecord] = []
    llm = LLM(
        args.model_path,
        draft_model=args.draft_model_path,
        schedule_mode=args.schedule_mode,
        capacity_profile=args.capacity_profile,
        max_running_requests=args.concurrency,
    )
    llm.on_step = records.append
    rng = np.random.default_rng(0)
    stop = mp.Event()
    hogs: list[mp.Process] = []
    slowed = False
    i = 0

    def refill() -> None:
        nonlocal i
        while len(llm.scheduler.running) + len(llm.scheduler.waiting) < args.concurrency:
            prompt = rng.integers(10, 1000, size=int(rng.integers(8, 48))).tolist()
            n = int(rng.integers(32, 160))
            llm.add_request(prompt, SamplingParams(temperature=1.0, seed=i, max_tokens=n))
            i += 1

    try:
        while len(records) < args.steps:
            if len(records) == args.slowdown_at and not slowed:
                slowed = True
                kind, factor = args.slowdown
                if kind == "hog":
                    hogs = [
                        mp.Process(target=_hog, args=(stop,), daemon=True) for _ in range(args.hogs)
                    ]
                    for h in hogs:
                        h.start()
                else:
                    llm.runner.forward = throttled(llm.runner.forward, factor)  # type: ignore[method-assign]
                    llm.runner.draft = throttled(llm.runner.draft, factor)  # type: ignore[method-assign]
            refill()
            llm.step()
    finally:
        stop.set()
        for h in hogs:
            h.join(timeout=5)
    dec = [
        (k, r)
        for k, r in enumerate(records)
        if r.num_prefill_tokens == 0 and not math.isnan(r.predicted_seconds)
    ]
    idx = np.array([k for k, _ in dec])
    pred = np.array([r.predicted_seconds for _, r in dec])
    meas = np.array([r.step_seconds for _, r in dec])
    roll = rolling_mape(pred, meas, args.window)
    before = (idx >= args.warmup) & (idx < args.slowdown_at)
    after_all = idx >= args.slowdown_at
    ape = np.abs(pred - meas) / meas
    reconverge = None
    for j in np.flatnonzero(after_all):
        if (
            j >= args.window - 1
            and roll[j] <= 0.10
            and idx[j - args.window + 1] >= args.slowdown_at
        ):
            reconverge = int(idx[j] - args.slowdown_at)
            break
    slow = float(np.median(meas[after_all]) / np.median(meas[before])) if after_all.any() else None
    report = {
        "tool": "dspark_sglang.bench.capacity",
        "command": "python -m dspark_sglang.bench.capacity " + shlex.join(argv or sys.argv[1:]),
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "slowdown": "hog" if args.slowdown[0] == "hog" else f"throttle:{args.slowdown[1]:g}",
        "steps": len(records),
        "decode_steps_scored": int(idx.size),
        "mape_after_warmup_before_slowdown": float(ape[before].mean()) if before.any() else None,
        "median_step_ms_before": float(np.median(meas[before]) * 1e3) if before.any() else None,
        "slowdown_factor_measured": slow,
        "steps_to_reconverge": reconverge,
        "mape_last_window": float(roll[-1]) if roll.size else None,
        "capacity_versions": int(records[-1].capacity_version) if records else None,
        "drift_events": llm.planner.estimator.drift_events
        if llm.planner and llm.planner.estimator
        else None,
    }
    if args.plot:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(2, 1, figsize=(10, 6), sharex=True)
        ax[0].plot(idx, meas * 1e3, ".", ms=2, label="measured")
        ax[0].plot(idx, pred * 1e3, "-", lw=1, label="predicted (live model)")
        what = "CPU hog" if args.slowdown[0] == "hog" else f"throttle x{args.slowdown[1]:g}"
        ax[0].axvline(args.slowdown_at, color="r", ls="--", lw=0.8, label=f"{what} starts")
        ax[0].set_ylabel("step ms")
        ax[0].legend()
        ax[1].plot(idx, roll * 100, lw=1)
        ax[1].axhline(10, color="k", ls=":", lw=0.8)
        ax[1].set_ylabel(f"rolling MAPE % ({args.window} steps)")
        ax[1].set_xlabel("step")
        fig.tight_layout()
        fig.savefig(args.plot, dpi=110)
    print(json.dumps(report) if args.json else json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
