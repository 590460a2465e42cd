"""Text corpus from the running interpreter's standard library sources (PSF licence).

Deterministic: sorted file list, seeded shuffle, held-out split by file. Writes `train.jsonl` and
`heldout.jsonl` with `{"text", "source"}` records; nothing is downloaded.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import random
import sysconfig
from pathlib import Path

MAX_FILE_BYTES = 256_000  # drops generated tables such as pydoc_data/topics.py
MAX_LINE_CHARS = 1000  # drops embedded binary blobs (test_bz2's compressed data)
SKIP_TOP = ("site-packages", "lib-dynload", "config-")  # third-party code and build files

# A few documents become one chat turn so the ChatML template is something the target has seen.
CHAT_PROMPT = "Continue this Python code from `{source}`:\n{head}"
CHAT_HEAD_LINES = 20
CHAT_TAIL_LINES = 60


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def source_files(root: Path) -> list[tuple[str, str]]:
    """-> sorted (relative path, text) of the usable `.py` files under `root`."""
    out = []
    for p in sorted(root.rglob("*.py")):
        rel = p.relative_to(root).as_posix()
        if rel.startswith(SKIP_TOP) or "__pycache__" in rel or p.stat().st_size > MAX_FILE_BYTES:
            continue
        try:
            text = p.read_bytes().decode("utf-8")
        except UnicodeDecodeError:  # test fixtures written in legacy encodings on purpose
            continue
        if "\x00" in text or any(len(line) > MAX_LINE_CHARS for line in text.splitlines()):
            continue
        if text.strip():
            out.append((rel, text))
    return out


def chat_record(source: str, text: str) -> dict[str, str] | None:
    """One ChatML exchange: the user shows the head of a file, the assistant continues it."""
    lines = text.splitlines(keepends=True)
    if len(lines) < CHAT_HEAD_LINES + 5:
        return None
    head = "".join(lines[:CHAT_HEAD_LINES])
    tail = "".join(lines[CHAT_HEAD_LINES : CHAT_HEAD_LINES + CHAT_TAIL_LINES])
    user = CHAT_PROMPT.format(source=source, head=head)
    chat = f"<|im_start|>user\n{user}<|im_end|>\n<|im_start|>assistant\n{tail}<|im_end|>\n"
    return {"text": chat, "source": f"chat:{source}"}


def build_corpus(
    root: Path, out: Path, seed: int, heldout_frac: float, chat_frac: float
) -> dict[str, int | str]:
    files = source_files(root)
    rng = random.Random(seed)
    rng.shuffle(files)
    num_heldout = max(1, math.ceil(heldout_frac * len(files)))
    out.mkdir(parents=True, exist_ok=True)
    stats: dict[str, int | str] = {}
    for split, part in (("heldout", files[:num_heldout]), ("train", files[num_heldout:])):
        records = [{"text": text, "source": f"stdlib/{rel}"} for rel, text in part]
        for rel, text in part:
            chat = chat_record(f"stdlib/{rel}", text) if rng.random() < chat_frac else None
            if chat is not None:
                records.append(chat)
        with (out / f"{split}.jsonl").open("w", encoding="utf-8") as f:
            for r in records:
                f.write(json.dumps(r, ensure_ascii=False) + "\n")
        stats[f"{split}_files"] = len(part)
        stats[f"{split}_records"] = len(records)
        stats[f"{split}_chars"] = sum(len(r["text"]) for r in records)
        # A fingerprint to compare corpora across machines (it changes with the Python version).
        digest = hashlib.sha256((out / f"{split}.jsonl").read_bytes()).hexdigest()[:16]
        stats[f"{split}_sha256"] = digest
    return stats


def read_texts(path: Path) -> list[str]:
    with path.open(encoding="utf-8") as f:
        return [json.loads(line)["text"] for line in f]


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", type=Path, required=True, help="output directory for the jsonl files")
    p.add_argument("--root", type=Path, default=None, help="source tree (default: the stdlib)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--heldout-frac", type=float, default=0.02, help="fraction of files held out")
    p.add_argument("--chat-frac", type=float, default=0.1, help="files also emitted as a chat turn")


def main(args: argparse.Namespace) -> None:
    root = args.root or stdlib_root()
    stats = build_corpus(root, args.out, args.seed, args.heldout_frac, args.chat_frac)
    print(json.dumps({"root": str(root), "out": str(args.out), **stats}))
