"""`python -m dspark_sglang.eval`: offline tau and confidence metrics, DeepSpec protocol.

deepspec_spec.md §4: temperature 1, first user turn only (chat template, generation prompt),
verify-all, per-sample seed = seed + index, stop on the target's EOS ids, tau pooled over rounds.
Requests run batched, which is equivalent to DeepSpec's batch size 1 here: every request samples
from its own generator, so its tokens do not depend on its batch neighbours.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import numpy as np

from dspark_sglang.algo.calibrate import position_metrics
from dspark_sglang.assets import ASSETS_DIR, bundled_target_dir
from dspark_sglang.chat_template import render_chat
from dspark_sglang.config import ConfigError
from dspark_sglang.engine.engine import LLM
from dspark_sglang.engine.speculative import RoundRecord
from dspark_sglang.types import SamplingParams

DRAFTERS_DIR = ASSETS_DIR / "drafters"
HELDOUT_PROMPTS = ASSETS_DIR / "heldout_prompts.jsonl"


def load_prompts(path: Path, model_path: str, num: int | None) -> list[str]:
    """jsonl rows of {"turns": [...]} (chat, first turn), {"prompt": ...} or {"text": ...}."""
    if not path.is_file():
        raise ConfigError(f"--dataset {path} does not exist")
    out = []
    for line_no, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            raise ConfigError(f"--dataset {path}:{line_no} is not JSON") from None
        if "turns" in row:
            msg = [{"role": "user", "content": row["turns"][0]}]
            out.append(render_chat(model_path, msg, add_generation_prompt=True))
        elif "prompt" in row or "text" in row:
            out.append(row.get("prompt", row.get("text")))
        else:
            raise ConfigError(f"--dataset {path}:{line_no} has no 'turns', 'prompt' or 'text'")
        if num is not None and len(out) >= num:
            break
    if not out:
        raise ConfigError(f"--dataset {path} holds no prompts")
    return out


def summarize(rounds: list[RoundRecord], gamma: int, sts: np.ndarray | None) -> dict:
    """DeepSpec metrics (§4.3, §4.4) from round records."""
    n_rounds = len(rounds)
    lens = np.array([r.verify_len for r in rounds], dtype=np.int64)
    acc = np.array([r.num_accepted for r in rounds], dtype=np.int64)
    committed = sum(r.committed for r in rounds)
    survival_at = []
    for k in range(gamma):
        proposed = int((lens > k).sum())
        survival_at.append(float((acc > k).sum() / proposed) if proposed else None)
    conditional = [
        (s / survival_at[k - 1] if k and survival_at[k - 1] else s) if s is not None else None
        for k, s in enumerate(survival_at)
    ]
    out: dict = {
        "tau": committed / n_rounds if n_rounds else 0.0,
        "rounds": n_rounds,
        "mean_proposal": float(lens.mean()) if n_rounds else 0.0,
        "verify_rate": committed / (lens.sum() + n_rounds) if n_rounds else 0.0,
        "accept_rate_at_k": survival_at,
        "conditional_acceptance": conditional,
    }
    if rounds and rounds[0].conf_logits:
        logits = np.array([r.conf_logits for r in rounds], dtype=np.float64)
        for name, temps in (("raw", None), ("sts", sts)):
            if name == "sts" and temps is None:
                continue
            out[f"confidence_{name}"] = [
                {
                    k: (None if isinstance(v, float) and math.isnan(v) else v)
                    for k, v in m.__dict__.items()
                }
                for m in position_metrics(logits, lens, acc, temps)
            ]
    return out


def evaluate(
    model_path: str, draft_path: str, prompts: list[str], args: argparse.Namespace
) -> dict:
    llm = LLM(
        model_path,
        draft_model=draft_path,
        schedule_mode="verify-all",
        record_rounds=True,
        seed=args.seed,
        max_running_requests=args.batch_size,
        kv_cache_bytes=args.kv_cache_bytes,
    )
    params = [
        SamplingParams(
            temperature=args.temperature, seed=args.seed + i, max_tokens=args.max_new_tokens
        )
        for i in range(len(prompts))
    ]
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=not args.json)
    wall = time.perf_counter() - t0
    sts_file = Path(draft_path) / "sts.json"
    sts = np.array(json.loads(sts_file.read_text())["temperatures"]) if sts_file.is_file() else None
    assert llm.rounds is not None
    res = summarize(llm.rounds, llm.gamma, sts)
    res["output_tokens"] = sum(len(o.output_ids) for o in outs)
    res["wall_seconds"] = wall
    return res


def plot_per_position(
    per_position: dict[str, list[float | None]], tau: dict[str, float], path: Path
) -> None:
    """Paper Fig. 2: P(draft k accepted | drafts < k accepted) per drafter."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for name, cond in per_position.items():
        ks = [k + 1 for k, c in enumerate(cond) if c is not None]
        ax.plot(ks, [c for c in cond if c is not None], "o-", label=f"{name} (tau {tau[name]:.3f})")
    ax.set_xlabel("draft position k")
    ax.set_ylabel("conditional acceptance")
    ax.set_ylim(0, 1)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m dspark_sglang.eval", description=__doc__)
    ap.add_argument("--model-path", default=str(bundled_target_dir()))
    ap.add_argument("--draft-model-path", help="drafter folder (default: the bundled DSpark)")
    ap.add_argument(
        "--compare-drafters",
        action="store_true",
        help="evaluate the bundled DSpark and DFlash-variant drafters side by side",
    )
    ap.add_argument("--dataset", type=Path, help="jsonl prompts (default: bundled held-out code)")
    ap.add_argument("--num-prompts", type=int, default=None)
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--seed", type=int, default=980406)
    ap.add_argument(
        "--batch-size",
        type=int,
        default=32,
        help="requests in flight (no effect on results: per-request generators)",
    )
    ap.add_argument("--kv-cache-bytes", type=int, default=512 << 20)
    ap.add_argument("--json", action="store_true", help="print one JSON line")
    ap.add_argument(
        "--plot", type=Path, metavar="PNG", help="per-position conditional acceptance (Fig. 2)"
    )
    args = ap.parse_args(argv)
    if args.num_prompts is not None and args.num_prompts < 1:
        ap.error("--num-prompts must be >= 1")
    if args.max_new_tokens < 1:
        ap.error("--max-new-tokens must be >= 1")
    try:
        dataset = args.dataset or HELDOUT_PROMPTS
        prompts = load_prompts(dataset, args.model_path, args.num_prompts)
        if args.compare_drafters:
            drafters = {n: str(DRAFTERS_DIR / n) for n in ("dspark", "dflash")}
        else:
            drafters = {"dspark": args.draft_model_path or str(DRAFTERS_DIR / "dspark")}
        results = {n: evaluate(args.model_path, p, prompts, args) for n, p in drafters.items()}
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    report = {
        "tau": {n: r["tau"] for n, r in results.items()},
        "per_position": {n: r["conditional_acceptance"] for n, r in results.items()},
        "num_prompts": len(prompts),
        "dataset": str(dataset),
        "temperature": args.temperature,
        "results": results,
    }
    if args.plot:
        plot_per_position(report["per_position"], report["tau"], args.plot)
    if args.json:
        print(json.dumps(report))
    else:
        for n, r in results.items():
            cond = ", ".join("-" if c is None else f"{c:.2f}" for c in r["conditional_acceptance"])
            print(f"{n:8s} tau {r['tau']:.3f}  rounds {r['rounds']}  cond. acceptance [{cond}]")
    return 0


if __name__ == "__main__":
    sys.exit(main())
