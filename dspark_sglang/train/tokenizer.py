"""Byte-level BPE tokenizer (Qwen-style pre-tokenizer, ChatML specials) trained with `tokenizers`.

Writes an HF `tokenizer.json` + `tokenizer_config.json`; decoding round-trips any text exactly.
The special tokens take the last ids, as in Qwen, so the drafter mask token is the final row.
"""

from __future__ import annotations

import argparse
import json
import re
from collections.abc import Iterator
from pathlib import Path

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

from dspark_sglang.train.corpus import read_texts

ENDOFTEXT, IM_START, IM_END, MASK = "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|mask|>"
SPECIAL_TOKENS = (ENDOFTEXT, IM_START, IM_END, MASK)
# Qwen2/3's split: single digits, letters with one leading non-letter, newline runs, and
# whitespace runs that leave the last space to the next word (code indentation stays one token).
QWEN_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# Qwen2.5's ChatML without the default system prompt; extra kwargs (enable_thinking) are ignored.
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
_SPECIAL_RE = re.compile("|".join(re.escape(s) for s in SPECIAL_TOKENS))


def new_tokenizer() -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN_PATTERN), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    return tok


def train_tokenizer(texts: list[str], vocab_size: int) -> Tokenizer:
    tok = new_tokenizer()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size - len(SPECIAL_TOKENS),
        min_frequency=2,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )

    def plain(batch: int = 256) -> Iterator[list[str]]:
        # Special-token strings are added afterwards; keep BPE from learning merges inside them.
        for i in range(0, len(texts), batch):
            yield [_SPECIAL_RE.sub("\n", t) for t in texts[i : i + batch]]

    tok.train_from_iterator(plain(), trainer=trainer, length=len(texts))
    tok.add_special_tokens(list(SPECIAL_TOKENS))
    if tok.get_vocab_size() != vocab_size:
        raise RuntimeError(f"trained vocab has {tok.get_vocab_size()} tokens, wanted {vocab_size}")
    return tok


def special_ids(tok: Tokenizer) -> dict[str, int]:
    ids = {s: tok.token_to_id(s) for s in SPECIAL_TOKENS}
    if None in ids.values():
        raise ValueError(f"tokenizer lacks special tokens: {ids}")
    return ids  # type: ignore[return-value]


def tokenizer_config(tok: Tokenizer, max_length: int) -> dict[str, object]:
    ids = special_ids(tok)
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "added_tokens_decoder": {
            str(i): {
                "content": s,
                "lstrip": False,
                "normalized": False,
                "rstrip": False,
                "single_word": False,
                "special": True,
            }
            for s, i in ids.items()
        },
        "additional_special_tokens": [IM_START, IM_END, MASK],
        "bos_token": None,
        "eos_token": IM_END,
        "pad_token": ENDOFTEXT,
        "unk_token": None,
        "mask_token": MASK,
        "add_bos_token": False,
        "add_prefix_space": False,
        "clean_up_tokenization_spaces": False,
        "split_special_tokens": False,
        "errors": "replace",
        "model_max_length": max_length,
        "chat_template": CHAT_TEMPLATE,
    }


def save_tokenizer(tok: Tokenizer, out: Path, max_length: int = 4096) -> None:
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer.json"))
    cfg = tokenizer_config(tok, max_length)
    (out / "tokenizer_config.json").write_text(json.dumps(cfg, indent=2, ensure_ascii=False))


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--corpus", type=Path, required=True, help="directory holding train.jsonl")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--vocab-size", type=int, default=4096, help="including the special tokens")


def main(args: argparse.Namespace) -> None:
    texts = read_texts(args.corpus / "train.jsonl")
    tok = train_tokenizer(texts, args.vocab_size)
    save_tokenizer(tok, args.out)
    heldout = read_texts(args.corpus / "heldout.jsonl")
    n_chars = sum(len(t) for t in heldout)
    n_tokens = sum(len(e.ids) for e in tok.encode_batch(heldout, add_special_tokens=False))
    stats = {"vocab_size": tok.get_vocab_size(), **special_ids(tok)}
    print(json.dumps({**stats, "heldout_chars_per_token": round(n_chars / n_tokens, 3)}))
