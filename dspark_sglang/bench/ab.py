"""`python -m dspark_sglang.bench.ab`: engine configurations side by side in one process.

Each configuration is an offline engine (`LLM`) capped at `--concurrency` running requests. A
round gives every engine the same 2c prompts (greedy, `ignore_eos`, a fixed output length), the
engines one after another, the order flipping each round, so a shared machine's drift hits all
of them alike. Reports each configuration's median output tok/s and, per round, its tok/s over the
first configuration's (median and IQR): on a noisy host the paired ratio is the number to read.
Each engine's step records split its time: decode steps that ran the drafter and those that did
not (count, median ms), and the host's milliseconds per step outside the timed step (the
planner's learning, output collection).

`--prompt-format text` sends the first turns as raw completion text, as `bench.sweep` does by
default (the bundled drafter accepts about twice as many tokens there as on chat-templated
prompts, so the two formats put a policy in different regimes); `chat` (default) renders the
model's chat template.

`--fresh-engines` replays what `bench.sweep --fresh-deployments` measures instead: each round
builds every configuration's engine anew (start-up profile included), serves it a warm-up of
`--warmup-prompts` prompts, then times one cell of the same 2c prompts, and closes it; with
`--shuffle-seed S` those prompts are the ones `bench.serving --seed S` sends (the bundled text
prompts in its shuffled order; `bench.sweep` passes `--seed 1`). A warm engine's planner has
learned acceptance and prices over every earlier round; a fresh one starts from its start-up
profile, as each deployment of a `--fresh-deployments` sweep does. Each configuration's report
then adds its decode time at R = c by step kind (`bench.step_kinds`: plain, full, trimmed,
resumed, probe, explore), each kind's share of that time and its tokens per second.

A configuration is a schedule mode (or `no-spec`) with engine options, e.g. `lagged`,
`lagged,overlap=true`, `fixed:3,live_capacity=false`.
"""

from __future__ import annotations

import argparse
import json
import random
import shlex
import sys
import time
from pathlib import Path

import numpy as np

from dspark_sglang.assets import ASSETS_DIR, bundled_target_dir
from dspark_sglang.bench.serving import text_prompts
from dspark_sglang.bench.step_kinds import KINDS, step_kind
from dspark_sglang.bench.steps import _Step
from dspark_sglang.config import ConfigError
from dspark_sglang.engine.engine import LLM
from dspark_sglang.eval import HELDOUT_PROMPTS, load_prompts
from dspark_sglang.hostinfo import host_facts
from dspark_sglang.types import SamplingParams, StepRecord


def _value(text: str) -> object:
    low = text.lower()
    if low in ("true", "false"):
        return low == "true"
    for cast in (int, float):
        try:
            return cast(text)
        except ValueError:
            pass
    return text


def parse_config(spec: str) -> tuple[str, dict[str, object]]:
    """`MODE[,key=value,...]` -> (mode, engine options); ConfigError naming --config."""
    mode, *items = spec.split(",")
    opts: dict[str, object] = {}
    for item in items:
        key, sep, val = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"--config {spec!r}: expected key=value after the mode, got {item!r}")
        opts[key] = _value(val)
    if not mode:
        raise ConfigError(f"--config {spec!r}: empty mode")
    return mode, opts


def make_engine(model: str, drafter: str, mode: str, opts: dict, concurrency: int) -> LLM:
    if mode == "no-spec":
        return LLM(model, max_running_requests=concurrency, **opts)
    opts = {"startup_profile_seconds": 20.0, **opts}
    return LLM(
        model, draft_model=drafter, schedule_mode=mode, max_running_requests=concurrency, **opts
    )


def step_split(recs: list[StepRecord], wall: float) -> dict[str, float]:
    """Decode-only steps with and without the drafter (count, median ms) and the host's ms per
    step outside the timed steps."""
    decode = [r for r in recs if r.num_prefill_tokens == 0 and r.num_decode_reqs > 0]
    drafting = [r.step_seconds for r in decode if r.draft_seconds > 0.0]
    plain = [r.step_seconds for r in decode if r.draft_seconds == 0.0]
    inside = sum(r.step_seconds for r in recs)
    return {
        "steps": len(recs),
        "drafting_steps": len(drafting),
        "plain_steps": len(plain),
        "drafting_step_ms": 1e3 * float(np.median(drafting)) if drafting else float("nan"),
        "plain_step_ms": 1e3 * float(np.median(plain)) if plain else float("nan"),
        "outside_step_ms": 1e3 * (wall - inside) / len(recs) if recs else float("nan"),
    }


def kinds_at(recs: list[StepRecord], num_reqs: int, per_row: int) -> dict[str, dict[str, float]]:
    """Decode steps of exactly `num_reqs` requests by step kind (bench.step_kinds): steps, share
    of those steps' seconds, tokens per second (one per row plus the accepted drafts)."""
    acc: dict[str, list[float]] = {}
    for r in recs:
        if r.num_reqs != num_reqs or r.num_prefill_tokens or r.num_decode_reqs <= 0:
            continue
        s = _Step(
            num_reqs=r.num_reqs,
            num_tokens=r.num_tokens,
            num_prefill_tokens=0,
            num_decode_reqs=r.num_decode_reqs,
            kv_tokens=r.kv_tokens,
            step_seconds=r.step_seconds,
            draft_seconds=r.draft_seconds,
            num_draft_reqs=r.num_draft_reqs,
            num_accepted=r.num_accepted,
            draft_resumed=r.draft_resumed,
            probe=r.probe,
            explored=r.explored,
        )
        a = acc.setdefault(step_kind(s, per_row), [0.0, 0.0, 0.0])
        a[0] += 1
        a[1] += r.step_seconds
        a[2] += r.num_decode_reqs + r.num_accepted
    total = sum(a[1] for a in acc.values())
    return {
        k: {"steps": int(a[0]), "time_share": a[1] / total, "tok_s": a[2] / a[1]}
        for k in KINDS
        if (a := acc.get(k)) is not None and a[1] > 0.0
    }


def sweep_order(prompts: list[str], seed: int) -> list[str]:
    """The prompts in the order `bench.serving --seed SEED` sends them (its shuffle)."""
    order = list(range(len(prompts)))
    random.Random(seed).shuffle(order)
    return [prompts[i] for i in order]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m dspark_sglang.bench.ab", description=__doc__)
    ap.add_argument("--config", action="append", required=True, metavar="MODE[,K=V...]")
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=16)
    ap.add_argument("--output-len", type=int, default=96)
    ap.add_argument("--model-path", default=str(bundled_target_dir()))
    ap.add_argument("--draft-model-path", default=str(ASSETS_DIR / "drafters" / "dspark"))
    ap.add_argument("--dataset", type=Path, default=HELDOUT_PROMPTS)
    ap.add_argument("--prompt-format", choices=("chat", "text"), default="chat")
    ap.add_argument(
        "--fresh-engines",
        action="store_true",
        help="build every engine anew each round (warm-up, then one timed cell), as "
        "bench.sweep --fresh-deployments does",
    )
    ap.add_argument(
        "--warmup-prompts",
        type=int,
        help="prompts each engine serves untimed first (default: the concurrency)",
    )
    ap.add_argument(
        "--shuffle-seed",
        type=int,
        help="text prompts in bench.serving's order for this --seed (bench.sweep: 1)",
    )
    ap.add_argument("--out", type=Path, help="write the report as JSON here")
    args = ap.parse_args(argv)
    if len(args.config) < 2:
        ap.error("--config: give at least two configurations to compare")
    if min(args.concurrency, args.rounds, args.output_len) < 1:
        ap.error("--concurrency, --rounds and --output-len must be >= 1")
    if args.warmup_prompts is not None and args.warmup_prompts < 1:
        ap.error("--warmup-prompts must be >= 1")
    if args.shuffle_seed is not None and args.prompt_format != "text":
        ap.error("--shuffle-seed orders text prompts: add --prompt-format text")
    c = args.concurrency
    warm = args.warmup_prompts or c
    try:
        configs = [parse_config(s) for s in args.config]
        # at least 16 prompts: at c = 1 four made each round two of the same four texts, and
        # the drafter's acceptance on those decided the result (lagged 1.33x verify-all)
        num = max(4 * c, 16)
        if args.prompt_format == "text":
            if not args.dataset.is_file():
                raise ConfigError(f"--dataset {args.dataset} does not exist")
            texts = [p.prompt for p in text_prompts(args.dataset, args.output_len)]
            if args.shuffle_seed is not None:
                texts = sweep_order(texts, args.shuffle_seed)
            prompts = texts[:num]
        else:
            prompts = load_prompts(args.dataset, args.model_path, num)
        engines = [make_engine(args.model_path, args.draft_model_path, m, o, c) for m, o in configs]
    except (ConfigError, TypeError) as e:  # TypeError: an option the engine does not take
        print(f"error: {e}", file=sys.stderr)
        return 2
    sp = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    per_row = [llm.gamma + 1 for llm in engines]
    recs: list[list[StepRecord]] = [[] for _ in engines]

    def warm_up(i: int) -> None:  # excluded from the timing and the step records
        engines[i].on_step = None
        engines[i].generate([prompts[j % len(prompts)] for j in range(warm)], sp)
        engines[i].on_step = recs[i].append

    if not args.fresh_engines:
        for i in range(len(engines)):
            warm_up(i)
    wall = np.zeros(len(engines))
    tok_s = np.zeros((args.rounds, len(engines)))
    for r in range(args.rounds):
        # fresh engines: every round is the sweep's cell, the same 2c prompts a new deployment
        # gets; warm ones: the prompts move on each round
        start = 0 if args.fresh_engines else r * c
        batch = [prompts[(start + i) % len(prompts)] for i in range(2 * c)]
        order = range(len(engines)) if r % 2 == 0 else reversed(range(len(engines)))
        for i in order:
            if args.fresh_engines:
                if r > 0:  # round 0 runs the engines built (and checked) above
                    m, o = configs[i]
                    engines[i] = make_engine(args.model_path, args.draft_model_path, m, o, c)
                warm_up(i)
            t0 = time.perf_counter()
            outs = engines[i].generate(batch, sp)
            dt = time.perf_counter() - t0
            wall[i] += dt
            tok_s[r, i] = sum(len(o.output_ids) for o in outs) / dt
            if args.fresh_engines:
                engines[i].close()
    if not args.fresh_engines:
        for llm in engines:
            llm.close()
    ratio = tok_s / tok_s[:, :1]
    rows = []
    for i, spec in enumerate(args.config):
        q1, med, q3 = np.quantile(ratio[:, i], [0.25, 0.5, 0.75])
        split = step_split(recs[i], float(wall[i]))
        kinds = kinds_at(recs[i], c, per_row[i])
        rows.append(
            {
                "config": spec,
                "median_tok_s": float(np.median(tok_s[:, i])),
                "ratio_median": float(med),
                "ratio_iqr": [float(q1), float(q3)],
                "tok_s_rounds": tok_s[:, i].round(2).tolist(),
                **{k: None if v != v else v for k, v in split.items()},  # NaN: no such step
                "kinds_at_concurrency": kinds,
            }
        )
        print(
            f"{spec:32s} {np.median(tok_s[:, i]):8.1f} tok/s   per-round ratio to "
            f"{args.config[0]}: median {med:.3f} (IQR {q1:.3f}-{q3:.3f})\n"
            f"{'':32s} decode steps: {split['drafting_steps']} drafting "
            f"({split['drafting_step_ms']:.2f} ms), {split['plain_steps']} plain "
            f"({split['plain_step_ms']:.2f} ms); host outside steps "
            f"{split['outside_step_ms']:.2f} ms/step"
        )
        if len(kinds) > 1:
            print(
                f"{'':32s} at R = {c}: "
                + ", ".join(
                    f"{k} {100 * v['time_share']:.1f} % ({v['tok_s']:.0f} tok/s)"
                    for k, v in kinds.items()
                )
            )
    if args.out:
        report = {
            "tool": "dspark_sglang.bench.ab",
            "command": "python -m dspark_sglang.bench.ab " + shlex.join(argv or sys.argv[1:]),
            "host": host_facts(),
            "concurrency": c,
            "rounds": args.rounds,
            "output_len": args.output_len,
            "prompt_format": args.prompt_format,
            "fresh_engines": args.fresh_engines,
            "warmup_prompts": warm,
            "shuffle_seed": args.shuffle_seed,
            "configs": rows,
        }
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
