"""A small BPE tokenizer trained on synthetic code, shared by the train tests."""

from __future__ import annotations

from pathlib import Path

import pytest

SMALL_VOCAB = 320

CODE = '''def add(a, b):
    """Return the sum of a and b."""
    return a + b


class Counter:
    def __init__(self, start=0):
        self.value = start

    def increment(self, step=1):
        self.value += step
        return self.value
'''


@pytest.fixture(scope="session")
def small_tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from dspark_sglang.train.tokenizer import save_tokenizer, train_tokenizer

    texts = [CODE.replace("a", c) for c in "abcdefgh"] + [f"x_{i} = {i} * 2\n" for i in range(50)]
    out = tmp_path_factory.mktemp("tokenizer")
    save_tokenizer(train_tokenizer(texts, SMALL_VOCAB), out)
    return out
