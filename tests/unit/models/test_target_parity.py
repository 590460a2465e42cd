"""Our Qwen3 / Qwen3-MoE over the paged cache vs transformers' full recompute (fp32)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from dspark_sglang.config import CacheConfig, ModelConfig
from dspark_sglang.engine import batch as batch_mod
from dspark_sglang.engine.batch import build_batch
from dspark_sglang.engine.block_pool import BlockPool
from dspark_sglang.engine.runner import ModelRunner
from dspark_sglang.engine.sequence import Sequence
from dspark_sglang.models import attention
from dspark_sglang.types import SamplingParams, ScheduledSeq, StepPlan
from tests.conftest import VOCAB, hf_reference

ATOL = 2e-4


class Driver:
    """Feeds arbitrary ragged batches straight to the runner, bypassing the scheduler."""

    def __init__(
        self, path: Path, page_size: int = 4, taps: tuple[int, ...] = (), num_blocks: int = 96
    ) -> None:
        self.runner = ModelRunner(
            ModelConfig(str(path), tap_layer_ids=taps),
            CacheConfig(page_size=page_size, num_blocks=num_blocks),
        )
        self.pool = BlockPool(self.runner.num_blocks, page_size)
        self.seqs: dict[int, Sequence] = {}

    def new(self) -> int:
        sid = len(self.seqs)
        self.seqs[sid] = Sequence(sid, [], SamplingParams(), arrival=sid)
        return sid

    def run(
        self, items: list[tuple[int, list[int]]], tap_rows: torch.Tensor | None = None
    ) -> tuple[list[torch.Tensor], torch.Tensor | None]:
        plan = []
        for sid, toks in items:
            seq = self.seqs[sid]
            plan.append(ScheduledSeq(sid, seq.num_cached, len(toks), sample=True))
            seq.prompt_ids += toks
            self.pool.grow(seq.block_table, seq.num_tokens)
        batch = build_batch(StepPlan(tuple(plan)), self.seqs, self.pool.page_size, "cpu")
        batch.sample_rows = torch.arange(batch.num_tokens)
        out = self.runner.forward(batch, tap_rows=tap_rows)
        for sid, _ in items:
            self.seqs[sid].num_cached = self.seqs[sid].num_tokens
        sizes = [len(t) for _, t in items]
        return list(out.logits.split(sizes)), out.taps

    def rollback(self, sid: int, n: int) -> None:
        seq = self.seqs[sid]
        keep = seq.num_tokens - n
        seq.prompt_ids = seq.prompt_ids[:keep]
        seq.num_cached = keep
        self.pool.shrink(seq.block_table, keep)


def reference_logits(hf: torch.nn.Module, tokens: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf(input_ids=torch.tensor([tokens])).logits[0].float()


def rand_tokens(g: torch.Generator, n: int) -> list[int]:
    return torch.randint(0, VOCAB, (n,), generator=g).tolist()


def test_prefill_matches(hf_model_dir: Path) -> None:
    hf = hf_reference(hf_model_dir)
    d = Driver(hf_model_dir)
    g = torch.Generator().manual_seed(1)
    toks = rand_tokens(g, 23)
    (logits,), _ = d.run([(d.new(), toks)])
    torch.testing.assert_close(logits, reference_logits(hf, toks), atol=ATOL, rtol=1e-4)


def test_step_by_step_decode_matches(hf_model_dir: Path) -> None:
    hf = hf_reference(hf_model_dir)
    d = Driver(hf_model_dir, page_size=3)
    g = torch.Generator().manual_seed(2)
    toks = rand_tokens(g, 5)
    sid = d.new()
    d.run([(sid, toks)])
    for _ in range(12):
        nxt = rand_tokens(g, 1)
        (logits,), _ = d.run([(sid, nxt)])
        toks += nxt
        torch.testing.assert_close(logits[0], reference_logits(hf, toks)[-1], atol=ATOL, rtol=1e-4)


def test_ragged_batch_matches_full_recompute(hf_model_dir: Path) -> None:
    """One forward mixing a prefill chunk, a fresh prompt, a decode and a multi-token append."""
    hf = hf_reference(hf_model_dir)
    d = Driver(hf_model_dir, page_size=4)
    g = torch.Generator().manual_seed(3)
    a, b, c, e = d.new(), d.new(), d.new(), d.new()
    hist = {a: rand_tokens(g, 9), b: rand_tokens(g, 6), c: rand_tokens(g, 13)}
    d.run([(s, t) for s, t in hist.items()])  # warm the cache with ragged prefills
    new = {a: rand_tokens(g, 7), b: rand_tokens(g, 1), c: rand_tokens(g, 5), e: rand_tokens(g, 10)}
    outs, _ = d.run([(s, t) for s, t in new.items()])
    for (s, t), got in zip(new.items(), outs, strict=True):
        full = hist.get(s, []) + t
        want = reference_logits(hf, full)[-len(t) :]
        torch.testing.assert_close(got, want, atol=ATOL, rtol=1e-4)


def test_grouped_attention_matches_full_recompute(hf_model_dir: Path, monkeypatch) -> None:
    """Contexts of very different lengths run as several padded groups (the floor that merges
    small groups is lifted so this small batch splits); logits still match, row for row."""
    monkeypatch.setattr(attention, "MIN_GROUP_CELLS", 0)
    hf = hf_reference(hf_model_dir)
    d = Driver(hf_model_dir, page_size=4, num_blocks=160)
    g = torch.Generator().manual_seed(5)
    ids = [d.new() for _ in range(5)]
    hist = dict(zip(ids, [rand_tokens(g, n) for n in (3, 40, 9, 130, 20)], strict=True))
    d.run([(s, t) for s, t in hist.items()])
    new = dict(zip(ids, [rand_tokens(g, n) for n in (1, 6, 1, 2, 30)], strict=True))
    batch_groups = []
    real = attention.ragged_metadata

    def spy(*args, **kwargs):
        meta = real(*args, **kwargs)
        batch_groups.append(len(meta.groups))
        return meta

    monkeypatch.setattr(batch_mod, "ragged_metadata", spy)
    outs, _ = d.run([(s, t) for s, t in new.items()])
    assert batch_groups[-1] >= 3
    for (s, t), got in zip(new.items(), outs, strict=True):
        want = reference_logits(hf, hist[s] + t)[-len(t) :]
        torch.testing.assert_close(got, want, atol=ATOL, rtol=1e-4)


def _prefilled(
    path: Path, seed: int, lens: tuple[int, ...]
) -> tuple[torch.nn.Module, Driver, torch.Generator, list[int], dict[int, list[int]]]:
    """The HF reference, a driver whose requests prefilled random prompts of these lengths, the
    generator, the request ids and their token histories."""
    hf = hf_reference(path)
    d = Driver(path, page_size=4, num_blocks=160)
    g = torch.Generator().manual_seed(seed)
    ids = [d.new() for _ in lens]
    hist = dict(zip(ids, [rand_tokens(g, n) for n in lens], strict=True))
    d.run([(s, t) for s, t in hist.items()])
    return hf, d, g, ids, hist


def test_decode_rows_folded_per_kv_head_match_full_recompute(
    hf_model_dir: Path, monkeypatch
) -> None:
    """Decode-only groups run their query heads as rows of the KV head they share (no K/V
    expansion): one group of all rows, then several of very different contexts, row for row."""
    hf, d, g, ids, hist = _prefilled(hf_model_dir, 7, (5, 7, 6, 90, 30, 12))
    for floor in (attention.MIN_GROUP_CELLS, 0):  # merged into one group, then split
        monkeypatch.setattr(attention, "MIN_GROUP_CELLS", floor)
        new = {s: rand_tokens(g, 1) for s in ids}
        outs, _ = d.run([(s, t) for s, t in new.items()])
        for (s, t), got in zip(new.items(), outs, strict=True):
            hist[s] += t
            torch.testing.assert_close(
                got[0], reference_logits(hf, hist[s])[-1], atol=ATOL, rtol=1e-4
            )


def test_verify_rows_grouped_by_query_count_match_full_recompute(
    hf_model_dir: Path, monkeypatch
) -> None:
    """A ragged verify (equal contexts, 1 to 8 new tokens a row) runs one padded group per query
    class (VERIFY_Q_RATIO; the merge floor lifted); logits still match, row for row."""
    monkeypatch.setattr(attention, "MIN_GROUP_CELLS", 0)
    hf, d, g, ids, hist = _prefilled(hf_model_dir, 6, (30, 28, 31, 29, 30, 27))
    new = dict(zip(ids, [rand_tokens(g, n) for n in (8, 1, 5, 2, 7, 3)], strict=True))
    batch_groups = []
    real = attention.ragged_metadata

    def spy(*args, **kwargs):
        meta = real(*args, **kwargs)
        batch_groups.append(sorted(gr.max_q for gr in meta.groups))
        return meta

    monkeypatch.setattr(batch_mod, "ragged_metadata", spy)
    outs, _ = d.run([(s, t) for s, t in new.items()])
    assert batch_groups[-1] == [1, 2, 3, 5, 8]  # {8, 7}, {5}, {3}, {2}, {1}
    for (s, t), got in zip(new.items(), outs, strict=True):
        want = reference_logits(hf, hist[s] + t)[-len(t) :]
        torch.testing.assert_close(got, want, atol=ATOL, rtol=1e-4)


def test_rollback_then_append_matches(hf_model_dir: Path) -> None:
    hf = hf_reference(hf_model_dir)
    d = Driver(hf_model_dir, page_size=4)
    g = torch.Generator().manual_seed(4)
    sid = d.new()
    toks = rand_tokens(g, 10)
    d.run([(sid, toks)])
    d.run([(sid, rand_tokens(g, 6))])  # verify-like append, then reject all 6 ...
    d.rollback(sid, 6)
    assert len(d.seqs[sid].block_table) == d.pool.blocks_for(10)
    nxt = rand_tokens(g, 3)  # ... and continue on a different branch
    (logits,), _ = d.run([(sid, nxt)])
    torch.testing.assert_close(logits, reference_logits(hf, toks + nxt)[-3:], atol=ATOL, rtol=1e-4)


# The last layer is left out: HF's final hidden_states entry is post-norm (DeepSpec forbids it too).
@pytest.mark.parametrize("taps", [(-1, 0, 1), (1,)])
def test_hidden_state_taps_follow_deepspec(hf_model_dir: Path, taps: tuple[int, ...]) -> None:
    """Tap id L = residual output of layer L = HF hidden_states[L + 1]; -1 = embeddings."""
    hf = hf_reference(hf_model_dir)
    d = Driver(hf_model_dir, taps=taps)
    g = torch.Generator().manual_seed(5)
    toks = rand_tokens(g, 11)
    rows = torch.tensor([0, 4, 10])
    _, got = d.run([(d.new(), toks)], tap_rows=rows)
    with torch.no_grad():
        hs = hf(input_ids=torch.tensor([toks]), output_hidden_states=True).hidden_states
    want = torch.cat([hs[lid + 1][0, rows] for lid in taps], dim=-1)
    assert got is not None and got.shape == (3, len(taps) * d.runner.arch.hidden_size)
    torch.testing.assert_close(got, want, atol=ATOL, rtol=1e-4)


def test_moe_routed_counts(tmp_path: Path) -> None:
    from tests.conftest import write_hf_model

    d = Driver(write_hf_model(tmp_path / "m", moe=True))
    sid = d.new()
    d.seqs[sid].prompt_ids += list(range(5))
    d.pool.grow(d.seqs[sid].block_table, 5)
    plan = StepPlan((ScheduledSeq(sid, 0, 5, True),))
    out = d.runner.forward(build_batch(plan, d.seqs, d.pool.page_size, "cpu"))
    # 5 tokens x top-2 x 2 MoE layers (layer 1 is mlp_only)
    assert out.expert_counts is not None and int(out.expert_counts.sum()) == 5 * 2 * 2


def test_packed_training_forward_matches_and_has_gradients(hf_model_dir: Path) -> None:
    """No-cache mode (training): packed causal sequences equal HF per-sequence logits."""
    from dspark_sglang.models.attention import (
        ForwardContext,
        forward_context,
        packed_causal_metadata,
    )
    from dspark_sglang.models.loader import load_target

    hf = hf_reference(hf_model_dir)
    model = load_target(hf_model_dir)
    g = torch.Generator().manual_seed(8)
    seqs = [rand_tokens(g, n) for n in (7, 12, 3)]
    ids = torch.tensor([t for s in seqs for t in s])
    pos = torch.cat([torch.arange(len(s)) for s in seqs])
    meta = packed_causal_metadata([len(s) for s in seqs], "cpu")
    with forward_context(ForwardContext(meta, None)):
        hidden, _ = model(ids, pos)
    logits = model.compute_logits(hidden)
    want = torch.cat([reference_logits(hf, s) for s in seqs])
    torch.testing.assert_close(logits, want, atol=ATOL, rtol=1e-4)
    logits.logsumexp(-1).sum().backward()
    assert model.model.layers[0].self_attn.q_proj.weight.grad is not None
