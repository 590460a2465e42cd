"""Byte-level BPE: exact round trip, special token ids at the end, ChatML template."""

from __future__ import annotations

from pathlib import Path

import pytest
from tokenizers import Tokenizer

from dspark_sglang.train.tokenizer import SPECIAL_TOKENS
from tests.unit.train.conftest import SMALL_VOCAB

TEXTS = [
    "def f(x):\n    return x + 1  # done\n",
    "\tmixed\r\nline endings\n\n\n   trailing   ",
    "héllo wörld, 日本語のテキスト, emoji 🙂🚀, ∑ x² ≤ ∞",
    "a literal <|im_end|> and <|endoftext|> inside text",
    "",
    " leading space and \x00 control \x7f bytes",
]


def load(path: Path) -> Tokenizer:
    return Tokenizer.from_file(str(path / "tokenizer.json"))


@pytest.mark.parametrize("text", TEXTS)
def test_round_trip_is_exact(small_tokenizer_dir: Path, text: str) -> None:
    tok = load(small_tokenizer_dir)
    ids = tok.encode(text, add_special_tokens=False).ids
    assert tok.decode(ids, skip_special_tokens=False) == text


def test_special_tokens_take_the_last_ids(small_tokenizer_dir: Path) -> None:
    tok = load(small_tokenizer_dir)
    assert tok.get_vocab_size() == SMALL_VOCAB
    for i, s in enumerate(SPECIAL_TOKENS):
        assert tok.token_to_id(s) == SMALL_VOCAB - len(SPECIAL_TOKENS) + i
        assert tok.encode(s, add_special_tokens=False).ids == [tok.token_to_id(s)]
    assert tok.token_to_id("<|mask|>") == SMALL_VOCAB - 1
    # BPE learned no merges inside the special strings (they were stripped from training text).
    assert not any("im_start" in t for t in tok.get_vocab() if t not in SPECIAL_TOKENS)


def test_chat_template_renders_chatml(small_tokenizer_dir: Path) -> None:
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(small_tokenizer_dir)
    assert (hf.eos_token, hf.pad_token) == ("<|im_end|>", "<|endoftext|>")
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi 🙂"}]
    text = hf.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    assert text == (
        "<|im_start|>system\nBe brief.<|im_end|>\n"
        "<|im_start|>user\nHi 🙂<|im_end|>\n<|im_start|>assistant\n"
    )
    # transformers and the engine's plain `tokenizers` load agree on the ids.
    assert hf.encode(text) == load(small_tokenizer_dir).encode(text, add_special_tokens=False).ids
