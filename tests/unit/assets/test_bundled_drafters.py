"""The bundled DSpark and DFlash-variant drafters: DeepSpec layout, size budget, they draft well."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from dspark_sglang import LLM, SamplingParams
from dspark_sglang.assets import ASSETS_DIR, bundled_target_dir
from dspark_sglang.models.loader import load_drafter, load_target, read_draft_arch
from tests.unit.models.test_drafter import expected_keys

DRAFTERS = ASSETS_DIR / "drafters"
BUDGET = 32 << 20  # all bundled artifacts together (issue: <= 32 MiB)


@pytest.mark.parametrize("name", ["dspark", "dflash"])
def test_deepspec_keys_and_loading(name: str) -> None:
    path = DRAFTERS / name
    assert (path / "config.json").is_file(), f"bundled drafter missing at {path}; make tiny-model"
    cfg = read_draft_arch(path)
    assert cfg.kind == name and cfg.block_size == 7 and len(cfg.target_layer_ids) == 3
    from safetensors import safe_open

    with safe_open(str(path / "model.safetensors"), framework="pt") as f:
        stored = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}  # noqa: SIM118
    # DeepSpec's table minus the two frozen copies of the target's embedding / LM head, which the
    # loader aliases from the target instead of storing them twice (deepspec_spec.md §2.3).
    want = expected_keys(cfg)
    del want["embed_tokens.weight"], want["lm_head.weight"]
    assert stored == want
    drafter = load_drafter(path, load_target(bundled_target_dir()))
    assert drafter.lm_head.weight.shape == (cfg.vocab_size, cfg.hidden_size)


def test_bundle_fits_the_budget() -> None:
    files = [p for p in ASSETS_DIR.rglob("*") if p.is_file() and "__pycache__" not in p.parts]
    assert sum(p.stat().st_size for p in files) <= BUDGET


def test_sts_file_is_valid_when_present() -> None:
    sts = DRAFTERS / "dspark" / "sts.json"
    if sts.is_file():
        import json

        temps = np.array(json.loads(sts.read_text())["temperatures"])
        assert temps.shape == (7,) and (temps > 0).all()


def test_bundled_pair_greedy_identity_and_real_acceptance() -> None:
    target = str(bundled_target_dir())
    prompts = ["import os\nimport sys\n\n\ndef main(", "class Stack:\n    def __init__(self):\n"]
    sp = SamplingParams(temperature=0.0, max_tokens=48)
    base = LLM(target).generate(prompts, sp)
    spec = LLM(target, draft_model=str(DRAFTERS / "dspark"), schedule_mode="verify-all")
    outs = spec.generate(prompts, sp)
    assert [o.output_ids for o in outs] == [o.output_ids for o in base]
    assert spec.stats.tau > 1.5  # the trained drafter is far better than chance


def test_chi_square_second_token_matches_the_target() -> None:
    """T=1 on the bundled pair: the second token (the first one that comes out of a verify
    round) follows the target's exact marginal sum_x1 p(x1) p(x2 | x1)."""
    from dspark_sglang.models.attention import (
        ForwardContext,
        forward_context,
        packed_causal_metadata,
    )
    from tests.unit.engine.test_speculative import chi_square_pvalue

    target_dir = str(bundled_target_dir())
    llm = LLM(
        target_dir,
        draft_model=str(DRAFTERS / "dspark"),
        schedule_mode="verify-all",
        max_running_requests=512,
        max_num_batched_tokens=8192,
    )
    assert llm.tokenizer is not None
    prompt = llm.tokenizer.encode("def add(a, b):\n    return", add_special_tokens=False).ids
    n = 6000
    # max_tokens 6 leaves room for a 4-draft round after the first token; x2 is that round's
    # first committed token (an accepted draft or the bonus).
    outs = llm.generate(
        [prompt] * n, [SamplingParams(temperature=1.0, seed=i, max_tokens=6) for i in range(n)]
    )
    x2 = np.bincount(
        [o.output_ids[1] for o in outs if len(o.output_ids) >= 2],
        minlength=llm.runner.arch.vocab_size,
    )
    model = load_target(target_dir)
    vocab = model.cfg.vocab_size
    with torch.no_grad():
        seqs = [[*prompt, a] for a in range(vocab)]
        ids = torch.tensor([t for s in seqs for t in s])
        pos = torch.arange(len(prompt) + 1).repeat(vocab)
        meta = packed_causal_metadata([len(prompt) + 1] * vocab, "cpu")
        with forward_context(ForwardContext(meta, None)):
            hidden, _ = model(ids, pos)
        rows = hidden.view(vocab, len(prompt) + 1, -1)
        p1 = torch.softmax(model.compute_logits(rows[0, -2]).double(), -1)  # P(x1)
        p2 = torch.softmax(model.compute_logits(rows[:, -1]).double(), -1)  # P(x2 | x1)
    eos = set(llm.scheduler.eos_ids)
    keep = torch.ones(vocab, dtype=torch.bool)
    keep[list(eos)] = False  # a request whose first token is EOS has no second token
    joint = (p1 * keep)[:, None] * p2
    want = (joint.sum(0) / joint.sum()).numpy() * x2.sum()
    big = want >= 5
    obs = np.append(x2[big], x2[~big].sum())
    exp = np.append(want[big], want[~big].sum())
    p_value = chi_square_pvalue(obs, exp)
    assert p_value > 1e-4, p_value
    # The first draft of a round was accepted often enough for the test to exercise acceptance
    # as well as the residual path.
    assert llm.stats.passed[0] > 0.2 * llm.stats.at_risk[0]
