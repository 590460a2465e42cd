"""`python -m dspark_sglang.bench.offline`: batch-1 decoding speed, no-spec vs drafters.

Every configuration generates the same prompts one request at a time (c = 1) in the same process;
repeats interleave the configurations so machine drift hits all of them alike. Reports medians of
output tokens/s, the speed-up over no-spec measured in the same run, tau and the accept-length
histogram (gpt-fast's closing block).
"""

from __future__ import annotations

import argparse
import json
import shlex
import statistics
import sys
import time
from collections import Counter
from datetime import UTC, datetime
from pathlib import Path

import torch

from dspark_sglang.assets import ASSETS_DIR, bundled_target_dir
from dspark_sglang.config import ConfigError
from dspark_sglang.engine.engine import LLM
from dspark_sglang.eval import HELDOUT_PROMPTS, load_prompts
from dspark_sglang.hostinfo import cpu_model
from dspark_sglang.types import SamplingParams


def run_config(llm: LLM, prompts: list[str], max_new: int, temperature: float, seed: int) -> dict:
    tokens, rounds_before = 0, len(llm.rounds or [])
    steps_before = llm.stats.steps
    t0 = time.perf_counter()
    for i, p in enumerate(prompts):
        sp = SamplingParams(temperature=temperature, seed=seed + i, max_tokens=max_new)
        tokens += len(llm.generate([p], sp)[0].output_ids)
    wall = time.perf_counter() - t0
    rounds = (llm.rounds or [])[rounds_before:]
    return {
        "tokens": tokens,
        "seconds": wall,
        "tok_s": tokens / wall,
        "rounds": len(rounds),
        "committed": sum(r.committed for r in rounds),
        "hist": Counter(r.committed for r in rounds),
        "steps": llm.stats.steps - steps_before,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m dspark_sglang.bench.offline", description=__doc__)
    ap.add_argument("--model-path", default=str(bundled_target_dir()))
    ap.add_argument(
        "--drafter",
        action="append",
        default=None,
        metavar="NAME=PATH",
        help="drafter to compare (repeatable); default: the bundled dspark and dflash",
    )
    ap.add_argument("--dataset", type=Path, default=HELDOUT_PROMPTS)
    ap.add_argument("--num-prompts", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--schedule-mode", default="verify-all")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    if args.num_prompts < 1 or args.repeats < 1 or args.max_new_tokens < 1:
        ap.error("--num-prompts, --repeats and --max-new-tokens must be >= 1")
    drafters = {}
    for item in args.drafter or [
        f"{n}={ASSETS_DIR / 'drafters' / n}" for n in ("dspark", "dflash")
    ]:
        name, sep, path = item.partition("=")
        if not sep:
            ap.error(f"--drafter expects NAME=PATH, got {item!r}")
        drafters[name] = path
    try:
        prompts = load_prompts(args.dataset, args.model_path, args.num_prompts)
        engines = {"no-spec": LLM(args.model_path, max_running_requests=1)}
        for name, path in drafters.items():
            engines[name] = LLM(
                args.model_path,
                draft_model=path,
                max_running_requests=1,
                schedule_mode=args.schedule_mode,
                record_rounds=True,
                startup_profile_seconds=10.0,
            )
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    for llm in engines.values():  # warm-up, excluded
        run_config(llm, prompts[:1], 16, args.temperature, args.seed)
    runs: dict[str, list[dict]] = {n: [] for n in engines}
    for _ in range(args.repeats):
        for name, llm in engines.items():
            runs[name].append(
                run_config(llm, prompts, args.max_new_tokens, args.temperature, args.seed)
            )
    base = statistics.median(r["tok_s"] for r in runs["no-spec"])
    results = {}
    for name, rs in runs.items():
        hist = sum((r["hist"] for r in rs), Counter())
        rounds = sum(r["rounds"] for r in rs)
        results[name] = {
            "median_tok_s": statistics.median(r["tok_s"] for r in rs),
            "speedup_vs_nospec": statistics.median(r["tok_s"] for r in rs) / base,
            "tau": sum(r["committed"] for r in rs) / rounds if rounds else 1.0,
            "median_step_ms": statistics.median(
                1000 * r["seconds"] / max(r["steps"] or r["tokens"], 1) for r in rs
            ),
            "accept_length_hist": dict(sorted(hist.items())),
            "tok_s_runs": [r["tok_s"] for r in rs],
        }
    report = {
        "tool": "dspark_sglang.bench.offline",
        "command": "python -m dspark_sglang.bench.offline " + shlex.join(argv or sys.argv[1:]),
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "hardware": {"cpu": cpu_model(), "threads": torch.get_num_threads()},
        "model": args.model_path,
        "num_prompts": len(prompts),
        "max_new_tokens": args.max_new_tokens,
        "temperature": args.temperature,
        "schedule_mode": args.schedule_mode,
        "repeats": args.repeats,
        "results": results,
    }
    if args.json:
        print(json.dumps(report))
        return 0
    print(f"{'config':10s} {'tok/s':>8s} {'speedup':>8s} {'tau':>6s} {'step ms':>8s}")
    for name, r in results.items():
        print(
            f"{name:10s} {r['median_tok_s']:8.1f} {r['speedup_vs_nospec']:8.2f} "
            f"{r['tau']:6.2f} {r['median_step_ms']:8.2f}"
        )
    for name, r in results.items():
        if r["accept_length_hist"]:
            print(
                f"{name} accept-length histogram: {r['accept_length_hist']}  "
                f"mean accepted {r['tau'] - 1:.2f}"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
