"""Target training: a few steps lower the loss; the export loads in transformers and our loader."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open
from tokenizers import Tokenizer

from dspark_sglang.models.attention import ForwardContext, forward_context, packed_causal_metadata
from dspark_sglang.models.loader import load_target
from dspark_sglang.train.export import export_target
from dspark_sglang.train.target import TrainSettings, new_model, tiny_moe_config, train
from dspark_sglang.train.tokenizer import special_ids
from tests.unit.train.conftest import SMALL_VOCAB

SMALL = dict(
    hidden_size=32,
    intermediate_size=64,
    moe_intermediate_size=24,
    num_hidden_layers=2,
    num_attention_heads=2,
    num_key_value_heads=1,
    head_dim=16,
    num_experts=4,
    num_experts_per_tok=2,
)


def small_config(tokenizer_dir: Path) -> dict[str, object]:
    tok = Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json"))
    return tiny_moe_config(tok.get_vocab_size(), special_ids(tok), **SMALL)


def test_a_few_steps_lower_the_loss(small_tokenizer_dir: Path) -> None:
    torch.manual_seed(0)
    model = new_model(small_config(small_tokenizer_dir), seed=0)
    g = torch.Generator().manual_seed(0)
    windows = torch.randint(0, 64, (4, 17), generator=g)  # 4 sequences to memorise
    s = TrainSettings(steps=30, batch_size=2, seq_len=16, lr=1e-2, eval_every=29, eval_windows=4)
    log: list[dict[str, float]] = []
    summary = train(model, windows, windows, s, log)
    assert summary["steps"] == 30 and summary["tokens_seen"] == 30 * 2 * 16
    first = sum(r["loss"] for r in log[:3]) / 3
    last = sum(r["loss"] for r in log[-3:]) / 3
    assert last < first - 1.0, (first, last)
    assert log[-1]["heldout_loss"] < log[0]["loss"]


def test_export_loads_in_transformers_and_our_loader(
    small_tokenizer_dir: Path, tmp_path: Path
) -> None:
    from transformers import AutoModelForCausalLM, Qwen3MoeForCausalLM

    cfg = small_config(small_tokenizer_dir)
    model = new_model(cfg, seed=1)
    with torch.no_grad():  # larger weights than the init so the logits discriminate
        for p in model.parameters():
            p.mul_(5.0)
    out = tmp_path / "export"
    export_target(model, cfg, small_tokenizer_dir, out, dtype="float32")

    with safe_open(str(out / "model.safetensors"), framework="pt") as f:
        keys = set(f.keys())
    assert "lm_head.weight" not in keys  # tied
    assert "model.layers.1.mlp.experts.3.gate_proj.weight" in keys
    assert not any(k.endswith(("gate_up_proj", "experts.down_proj")) for k in keys)
    written = json.loads((out / "config.json").read_text())
    assert written["num_experts"] == written["num_local_experts"] == 4
    assert written["eos_token_id"] == [SMALL_VOCAB - 2, SMALL_VOCAB - 4]  # <|im_end|>, eot
    assert (out / "tokenizer.json").is_file() and (out / "generation_config.json").is_file()

    hf = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    assert isinstance(hf, Qwen3MoeForCausalLM)
    ours = load_target(out, dtype="float32")
    ids = torch.randint(0, SMALL_VOCAB, (2, 19), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        want = hf(input_ids=ids).logits.reshape(-1, SMALL_VOCAB)
        meta = packed_causal_metadata([19, 19], "cpu")
        positions = torch.arange(19).repeat(2)
        with forward_context(ForwardContext(meta, None)):
            got = ours.compute_logits(ours(ids.reshape(-1), positions)[0])
        with forward_context(ForwardContext(meta, None)):
            before = model.eval().compute_logits(model(ids.reshape(-1), positions)[0])
    torch.testing.assert_close(got, want, atol=2e-4, rtol=1e-4)
    torch.testing.assert_close(got, before, atol=1e-5, rtol=1e-5)  # export is lossless in fp32
    assert got.argmax(-1).unique().numel() > 3  # the comparison is not between constant rows
