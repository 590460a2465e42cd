"""Incremental detokenizer against full decode on a tiny byte-level BPE; stop-string helpers."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from dspark_sglang.engine.detokenizer import IncrementalDetokenizer, find_stop, stop_holdback

EOT = "<|endoftext|>"
_SENTENCES = [
    "The quick brown fox jumps over the lazy dog.",
    "Speculative decoding drafts tokens and verifies them in one forward pass.",
    "Le café est très chaud, n'est-ce pas ? Déjà vu à l'hôtel.",
    "Grüße aus München: Straße, Äpfel und Öl.",
    "Привет, мир! Как дела?",
    "你好，世界。今天天气很好，我们去公园散步吧。",
    "東京は日本の首都です。ありがとうございます。",
    "안녕하세요, 반갑습니다.",
    "Emoji time 😀🎉🚀 and hearts ❤️💙 plus flags 🇫🇷🇯🇵.",
    "Math: ∑ x² ≤ ∞, π ≈ 3.14159, α β γ δ.",
    "def step(self) -> None:\n    return self.plan()",
]


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    lines = [
        f"{_SENTENCES[i % len(_SENTENCES)]} {_SENTENCES[(i * 7) % len(_SENTENCES)]} {i}"
        for i in range(300)
    ]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=[EOT],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(lines, trainer)
    return tok


def _chunks(ids: list[int], cuts: list[int]) -> list[list[int]]:
    bounds = sorted({c % (len(ids) + 1) for c in cuts} | {0, len(ids)})
    return [ids[a:b] for a, b in itertools.pairwise(bounds)]


def _stream(tok: Tokenizer, prompt: list[int], chunks: list[list[int]], skip: bool) -> str:
    detok = IncrementalDetokenizer(tok, prompt, skip_special_tokens=skip)
    out = "".join(detok.step(chunk) for chunk in chunks)
    assert out == detok.text
    return out


@st.composite
def _output_ids(draw: st.DrawFn, tok: Tokenizer) -> list[int]:
    if draw(st.booleans()):
        # Arbitrary ids: invalid and split UTF-8 byte sequences, special tokens anywhere.
        ids = draw(st.lists(st.integers(0, tok.get_vocab_size() - 1), max_size=40))
    else:
        ids = tok.encode(draw(st.text(max_size=30))).ids
    # End on a complete character, so the invariant's "no trailing incomplete UTF-8" holds.
    return ids + tok.encode("!").ids


@settings(max_examples=150, deadline=None)
@given(data=st.data(), skip=st.booleans(), with_prompt=st.booleans())
def test_streamed_text_equals_full_decode(
    tokenizer: Tokenizer, data: st.DataObject, skip: bool, with_prompt: bool
) -> None:
    ids = data.draw(_output_ids(tokenizer))
    prompt = tokenizer.encode("Prompt: 你好 😀 café ").ids if with_prompt else []
    expected = tokenizer.decode(ids, skip_special_tokens=skip)
    one_by_one = _stream(tokenizer, prompt, [[i] for i in ids], skip)
    cuts = data.draw(st.lists(st.integers(0, 100), max_size=8))
    chunked = _stream(tokenizer, prompt, _chunks(ids, cuts), skip)
    assert one_by_one == expected
    assert chunked == expected


def test_split_multibyte_char_is_held_back(tokenizer: Tokenizer) -> None:
    ids = tokenizer.encode("a🦀b").ids
    detok = IncrementalDetokenizer(tokenizer, [])
    deltas = [detok.step([i]) for i in ids]
    assert len(ids) >= 4  # the crab is not in the corpus, so it stays split into bytes
    assert deltas[0] == "a"
    assert deltas[1:] == [""] * (len(ids) - 3) + ["🦀", "b"]


def test_special_tokens_skipped(tokenizer: Tokenizer) -> None:
    eot = tokenizer.token_to_id(EOT)
    ids = [*tokenizer.encode("ab").ids, eot, *tokenizer.encode("cd").ids, eot]
    assert _stream(tokenizer, [eot], [[i] for i in ids], skip=True) == "abcd"
    kept = _stream(tokenizer, [], [[i] for i in ids], skip=False)
    assert kept == f"ab{EOT}cd{EOT}"


def test_flush_emits_held_back_tail(tokenizer: Tokenizer) -> None:
    ids = tokenizer.encode("x🦀").ids[:-1]  # drop the last byte of the crab
    detok = IncrementalDetokenizer(tokenizer, [])
    assert "".join(detok.step([i]) for i in ids) == "x"
    assert detok.flush() == tokenizer.decode(ids)[1:]
    assert detok.text == tokenizer.decode(ids)
    assert detok.flush() == ""


def test_find_stop() -> None:
    assert find_stop("hello world", ()) is None
    assert find_stop("hello world", ("xyz",)) is None
    assert find_stop("hello world", ("world", "lo")) == 3
    assert find_stop("hello world", ("o",)) == 4
    # A match straddling search_from is still found.
    assert find_stop("abcSTOP", ("STOP",), search_from=5) == 3
    # Text wholly before search_from - max_len + 1 was searched already.
    assert find_stop("STOPxxxxxxxx", ("STOP",), search_from=10) is None
    assert find_stop("xxSTOPxxxxxx", ("STOP", "longer-stop"), search_from=10) == 2


def test_stop_holdback() -> None:
    assert stop_holdback("abcST", ("STOP",)) == 2
    assert stop_holdback("abcS", ("STOP",)) == 1
    assert stop_holdback("ST", ("STOP",)) == 2
    assert stop_holdback("abcSTOP", ("STOP",)) == 0  # a full stop is find_stop's job
    assert stop_holdback("abc", ("STOP",)) == 0
    assert stop_holdback("abc", ()) == 0
    assert stop_holdback("xxab", ("abc", "bz", "xab!")) == 3
    assert stop_holdback("aa", ("aaa",)) == 2
