"""Corpus: deterministic, held out by file, skips files the tokenizer should never see."""

from __future__ import annotations

import json
from pathlib import Path

from dspark_sglang.train.corpus import build_corpus


def write_tree(root: Path) -> None:
    for i in range(40):
        (root / "pkg").mkdir(parents=True, exist_ok=True)
        lines = "".join(f"value_{j} = {i} + {j}\n" for j in range(30))
        (root / "pkg" / f"mod_{i:02d}.py").write_text(f'"""Module {i}."""\n{lines}')
    (root / "latin1.py").write_bytes("name = 'caf\xe9'\n".encode("latin-1"))
    (root / "blob.py").write_text("data = '" + "x" * 5000 + "'\n")
    (root / "site-packages").mkdir()
    (root / "site-packages" / "third_party.py").write_text("x = 1\n")


def records(path: Path) -> list[dict[str, str]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_split_by_file_is_deterministic(tmp_path: Path) -> None:
    write_tree(tmp_path / "src")
    a = build_corpus(tmp_path / "src", tmp_path / "a", seed=3, heldout_frac=0.1, chat_frac=0.5)
    build_corpus(tmp_path / "src", tmp_path / "b", seed=3, heldout_frac=0.1, chat_frac=0.5)
    assert (a["heldout_files"], a["train_files"]) == (4, 36)
    for split in ("train", "heldout"):
        assert (tmp_path / "a" / f"{split}.jsonl").read_text() == (
            tmp_path / "b" / f"{split}.jsonl"
        ).read_text()
    train, held = records(tmp_path / "a" / "train.jsonl"), records(tmp_path / "a" / "heldout.jsonl")
    plain = lambda rs: {r["source"] for r in rs if not r["source"].startswith("chat:")}
    assert not plain(train) & plain(held)
    # chat records come from their own split's files and follow the ChatML layout
    for rs in (train, held):
        for r in rs:
            if r["source"].startswith("chat:"):
                assert r["source"].removeprefix("chat:") in plain(rs)
                assert r["text"].startswith("<|im_start|>user\n")
                assert r["text"].endswith("<|im_end|>\n")
    sources = plain(train) | plain(held)
    assert not {"stdlib/latin1.py", "stdlib/blob.py", "stdlib/site-packages/third_party.py"} & (
        sources
    )
