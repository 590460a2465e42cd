"""`python -m dspark_sglang.calibrate`: fit STS temperatures for a drafter (paper §3.2.1).

Runs the evaluation protocol (T = 1, verify-all, held-out prompts) to collect rounds, labels
each verified position with the *sampled* acceptance event, fits one temperature per position
left to right (algo/calibrate.fit_sts), writes `sts.json` next to the drafter and a reliability
diagram before/after.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from datetime import UTC, datetime
from pathlib import Path

import numpy as np

from dspark_sglang.algo.calibrate import fit_sts, position_metrics, survival
from dspark_sglang.assets import ASSETS_DIR, bundled_target_dir
from dspark_sglang.config import ConfigError
from dspark_sglang.engine.engine import LLM
from dspark_sglang.eval import HELDOUT_PROMPTS, load_prompts
from dspark_sglang.types import SamplingParams


def collect(
    model: str, drafter: str, prompts: list[str], max_new: int, seed: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    llm = LLM(
        model,
        draft_model=drafter,
        schedule_mode="verify-all",
        record_rounds=True,
        max_running_requests=32,
    )
    params = [
        SamplingParams(temperature=1.0, seed=seed + i, max_tokens=max_new)
        for i in range(len(prompts))
    ]
    llm.generate(prompts, params, use_tqdm=True)
    rounds = [r for r in llm.rounds or [] if r.conf_logits]
    if not rounds:
        raise ConfigError(f"drafter {drafter} has no confidence head; nothing to calibrate")
    logits = np.array([r.conf_logits for r in rounds], dtype=np.float64)
    lens = np.array([r.verify_len for r in rounds], dtype=np.int64)
    acc = np.array([r.num_accepted for r in rounds], dtype=np.int64)
    return logits, lens, acc


def reliability_png(
    path: Path, logits: np.ndarray, lens: np.ndarray, acc: np.ndarray, temps: np.ndarray
) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 4.5), sharey=True)
    bins = np.linspace(0, 1, 11)
    for ax, (title, t) in zip(axes, (("raw", None), ("STS", temps)), strict=True):
        surv = survival(logits, t)
        for k in range(logits.shape[1]):
            rows = lens > k
            p, y = surv[rows, k], (acc[rows] > k).astype(float)
            idx = np.clip(np.digitize(p, bins) - 1, 0, len(bins) - 2)
            xs = [p[idx == b].mean() for b in range(len(bins) - 1) if (idx == b).sum() >= 20]
            ys = [y[idx == b].mean() for b in range(len(bins) - 1) if (idx == b).sum() >= 20]
            ax.plot(xs, ys, marker="o", ms=3, label=f"k={k + 1}")
        ax.plot([0, 1], [0, 1], "k--", lw=0.8)
        ax.set_title(f"{title}: predicted survival vs realised prefix acceptance")
        ax.set_xlabel("predicted prod_{i<=k} c_i")
    axes[0].set_ylabel("fraction of rounds with drafts 1..k accepted")
    axes[1].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m dspark_sglang.calibrate", description=__doc__)
    ap.add_argument("--model-path", default=str(bundled_target_dir()))
    ap.add_argument("--draft-model-path", default=str(ASSETS_DIR / "drafters" / "dspark"))
    ap.add_argument("--dataset", type=Path, default=HELDOUT_PROMPTS)
    ap.add_argument("--num-prompts", type=int, default=None)
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--plot", type=Path, help="reliability diagram PNG (before/after)")
    ap.add_argument("--dry-run", action="store_true", help="fit and report, write no sts.json")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    try:
        prompts = load_prompts(args.dataset, args.model_path, args.num_prompts)
        logits, lens, acc = collect(
            args.model_path, args.draft_model_path, prompts, args.max_new_tokens, args.seed
        )
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    temps = fit_sts(logits, lens, acc)
    before = position_metrics(logits, lens, acc)
    after = position_metrics(logits, lens, acc, temps)
    report = {
        "temperatures": temps.tolist(),
        "rounds": len(lens),
        "ece_before": [m.ece for m in before],
        "ece_after": [m.ece for m in after],
        "auroc_before": [m.auroc for m in before],
        "auroc_after": [m.auroc for m in after],
        "command": "python -m dspark_sglang.calibrate " + shlex.join(argv or sys.argv[1:]),
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "dataset": str(args.dataset),
    }
    if not args.dry_run:
        (Path(args.draft_model_path) / "sts.json").write_text(json.dumps(report, indent=2))
    if args.plot:
        reliability_png(args.plot, logits, lens, acc, temps)
    if args.json:
        print(json.dumps(report))
    else:
        for k, (b, a, t) in enumerate(zip(before, after, temps, strict=True)):
            print(f"k={k + 1}  T={t:.3f}  ECE {b.ece:.4f} -> {a.ece:.4f}  AUROC {a.auroc:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
