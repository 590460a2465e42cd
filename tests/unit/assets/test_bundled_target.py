"""The bundled tiny MoE target: a valid HF folder, equal logits in transformers and our engine."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer

from dspark_sglang.assets import bundled_target_dir
from dspark_sglang.assets.__main__ import main as assets_main
from dspark_sglang.models.attention import ForwardContext, forward_context, packed_causal_metadata
from dspark_sglang.models.loader import load_target

# Written for this test, so it is held out from the stdlib training corpus by construction.
SNIPPET = '''import os


def count_lines(path):
    """Return the number of lines in the text file at *path*."""
    if not os.path.exists(path):
        raise FileNotFoundError(path)
    with open(path, encoding="utf-8") as f:
'''
TARGET_BUDGET_BYTES = 20 << 20  # the drafters share the 32 MiB package-data budget


@pytest.fixture(scope="module")
def model_dir() -> Path:
    path = bundled_target_dir()
    assert (path / "config.json").is_file(), f"bundled model missing at {path}; make tiny-model"
    return path


def test_is_a_complete_hf_folder_within_budget(
    model_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    names = {"config.json", "model.safetensors", "generation_config.json", "tokenizer.json"}
    assert names | {"tokenizer_config.json"} <= {p.name for p in model_dir.iterdir()}
    assert sum(p.stat().st_size for p in model_dir.iterdir()) < TARGET_BUDGET_BYTES
    cfg = json.loads((model_dir / "config.json").read_text())
    tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    assert cfg["vocab_size"] == tok.get_vocab_size()
    want_eos = [tok.token_to_id("<|im_end|>"), tok.token_to_id("<|endoftext|>")]
    assert cfg["eos_token_id"] == want_eos
    assert tok.token_to_id("<|mask|>") == cfg["vocab_size"] - 1
    assets_main(["path"])
    assert capsys.readouterr().out.strip() == str(model_dir)


def test_transformers_and_our_loader_agree(model_dir: Path) -> None:
    from transformers import AutoModelForCausalLM

    tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    ids = torch.tensor(tok.encode(SNIPPET, add_special_tokens=False).ids)
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    ours = load_target(model_dir, dtype="float32")
    with torch.no_grad():
        want = hf(input_ids=ids[None]).logits[0]
        with forward_context(ForwardContext(packed_causal_metadata([len(ids)], "cpu"), None)):
            got = ours.compute_logits(ours(ids, torch.arange(len(ids)))[0])
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


def test_greedy_continuation_is_not_degenerate(model_dir: Path) -> None:
    from dspark_sglang import LLM, SamplingParams

    llm = LLM(str(model_dir))
    (out,) = llm.generate([SNIPPET], SamplingParams(temperature=0.0, max_tokens=48))
    ids = out.output_ids
    assert len(ids) >= 16, out.text
    most_common = max(ids.count(t) for t in set(ids))
    assert len(set(ids)) >= 8 and most_common <= len(ids) // 2, out.text
