"""`python -m dspark_sglang.train prompts`: the bundled held-out prompt set (code to continue).

Windows of whole lines from the held-out corpus files, so no prompt was seen in training.
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path


def heldout_prompts(heldout: Path, num: int, lines: int, seed: int) -> list[str]:
    texts = [
        json.loads(x)["text"]
        for x in heldout.read_text().splitlines()
        if x and not json.loads(x).get("source", "").startswith("chat:")
    ]
    rng = random.Random(seed)
    out: list[str] = []
    while len(out) < num:
        body = rng.choice(texts).splitlines(keepends=True)
        if len(body) < lines + 4:
            continue
        start = rng.randrange(0, len(body) - lines)
        window = "".join(body[start : start + lines])
        if window.strip() and len(window) < 1200:
            out.append(window)
    return out


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--heldout", type=Path, required=True, help="heldout.jsonl from `corpus`")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--num", type=int, default=128)
    p.add_argument("--lines", type=int, default=12)
    p.add_argument("--seed", type=int, default=0)


def main(args: argparse.Namespace) -> None:
    prompts = heldout_prompts(args.heldout, args.num, args.lines, args.seed)
    args.out.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in prompts))
    print(f"wrote {len(prompts)} prompts to {args.out}")
