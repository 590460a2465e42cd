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

A configuration is a schedule mode (or `no-spec`) with engine options, e.g. `lagged`,
`lagged,overlap=true`, `fixed:3,live_capacity=false`.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import time
from pathlib import Path

import numpy as np

from dspark_sglang.assets import ASSETS_DIR, bundled_target_dir
from dspark_sglang.bench.serving import text_prompts
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
    ap.add_argument("--out", type=Path, help="write the report as JSON here")
    args = ap.parse_args(argv)
    if len(args.config) < 2:
        ap.error("--config: give at least two configurations to compare")
    if min(args.concurrency, args.rounds, args.output_len) < 1:
        ap.error("--concurrency, --rounds and --output-len must be >= 1")
    c = args.concurrency
    try:
        configs = [parse_config(s) for s in args.config]
        # at least 16 prompts: at c = 1 four made each round two of the same four texts, and
        # the drafter's acceptance on those decided the result (lagged 1.33x verify-all)
        num = max(4 * c, 16)
        if args.prompt_format == "text":
            if not args.dataset.is_file():
                raise ConfigError(f"--dataset {args.dataset} does not exist")
            prompts = [p.prompt for p in text_prompts(args.dataset, args.output_len)][:num]
        else:
            prompts = load_prompts(args.dataset, args.model_path, num)
        engines = [make_engine(args.model_path, args.draft_model_path, m, o, c) for m, o in configs]
    except (ConfigError, TypeError) as e:  # TypeError: an option the engine does not take
        print(f"error: {e}", file=sys.stderr)
        return 2
    sp = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    for llm in engines:  # warm-up, excluded
        llm.generate(prompts[:c], sp)
    recs: list[list[StepRecord]] = [[] for _ in engines]
    for llm, rs in zip(engines, recs, strict=True):
        llm.on_step = rs.append
    wall = np.zeros(len(engines))
    tok_s = np.zeros((args.rounds, len(engines)))
    for r in range(args.rounds):
        batch = [prompts[(r * c + i) % len(prompts)] for i in range(2 * c)]
        order = range(len(engines)) if r % 2 == 0 else reversed(range(len(engines)))
        for i in order:
            t0 = time.perf_counter()
            outs = engines[i].generate(batch, sp)
            dt = time.perf_counter() - t0
            wall[i] += dt
            tok_s[r, i] = sum(len(o.output_ids) for o in outs) / dt
    for llm in engines:
        llm.close()
    ratio = tok_s / tok_s[:, :1]
    rows = []
    for i, spec in enumerate(args.config):
        q1, med, q3 = np.quantile(ratio[:, i], [0.25, 0.5, 0.75])
        split = step_split(recs[i], float(wall[i]))
        rows.append(
            {
                "config": spec,
                "median_tok_s": float(np.median(tok_s[:, i])),
                "ratio_median": float(med),
                "ratio_iqr": [float(q1), float(q3)],
                "tok_s_rounds": tok_s[:, i].round(2).tolist(),
                **{k: None if v != v else v for k, v in split.items()},  # NaN: no such step
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
    if args.out:
        report = {
            "tool": "dspark_sglang.bench.ab",
            "command": "python -m dspark_sglang.bench.ab " + shlex.join(argv or sys.argv[1:]),
            "host": host_facts(),
            "concurrency": c,
            "rounds": args.rounds,
            "output_len": args.output_len,
            "prompt_format": args.prompt_format,
            "configs": rows,
        }
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
