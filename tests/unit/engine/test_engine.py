"""The reference engine end to end on small random checkpoints (no speculation)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from dspark_sglang import LLM, SamplingParams
from dspark_sglang.config import ConfigError
from tests.conftest import VOCAB, hf_reference, write_char_tokenizer, write_hf_model

GREEDY = SamplingParams(temperature=0.0, max_tokens=12)


def prompts(n: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [
        torch.randint(
            0, VOCAB, (int(torch.randint(1, 20, (1,), generator=g)),), generator=g
        ).tolist()
        for _ in range(n)
    ]


def hf_greedy(hf: torch.nn.Module, prompt: list[int], n: int) -> list[int]:
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            ids.append(int(hf(input_ids=torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt) :]


def test_greedy_generate_equals_hf_argmax(hf_model_dir: Path) -> None:
    hf = hf_reference(hf_model_dir)
    llm = LLM(str(hf_model_dir), num_blocks=64, page_size=4, chunked_prefill_size=8)
    ps = prompts(6)
    outs = llm.generate(ps, GREEDY)
    for p, o in zip(ps, outs, strict=True):
        assert o.output_ids == hf_greedy(hf, p, 12)
        assert o.finish_reason == "length"
    assert llm.pool.num_free_blocks == llm.pool.num_blocks


def test_seeded_sampling_is_reproducible_and_batch_independent(hf_model_dir: Path) -> None:
    llm = LLM(str(hf_model_dir), num_blocks=64)
    sp = SamplingParams(temperature=0.9, top_p=0.95, top_k=40, seed=1234, max_tokens=10)
    alone = llm.generate([[5, 6, 7]], sp)[0].output_ids
    again = llm.generate([[5, 6, 7]], sp)[0].output_ids
    others = SamplingParams(temperature=1.0, max_tokens=10)
    mixed = llm.generate([[1, 2], [5, 6, 7], [9] * 7], [others, sp, others])[1].output_ids
    other_seed = llm.generate([[5, 6, 7]], SamplingParams(temperature=0.9, seed=99, max_tokens=10))
    assert alone == again == mixed
    assert other_seed[0].output_ids != alone  # the seed matters (10 tokens of a 128 vocab)


def test_max_tokens_and_stop_token_ids(hf_model_dir: Path) -> None:
    llm = LLM(str(hf_model_dir), num_blocks=64)
    base = llm.generate([[3, 4, 5]], SamplingParams(temperature=0.0, max_tokens=9))[0]
    assert len(base.output_ids) == 9 and base.finish_reason == "length"
    stop_tok = base.output_ids[4]
    cut = base.output_ids.index(stop_tok) + 1
    o = llm.generate(
        [[3, 4, 5]], SamplingParams(temperature=0.0, max_tokens=9, stop_token_ids=(stop_tok,))
    )[0]
    assert o.output_ids == base.output_ids[:cut] and o.finish_reason == "stop"


def test_stop_strings_trim_text(tmp_path: Path) -> None:
    path = write_hf_model(tmp_path / "m", moe=True, seed=3)
    write_char_tokenizer(path)
    llm = LLM(str(path), num_blocks=64)
    base = llm.generate(["hello"], SamplingParams(temperature=0.0, max_tokens=16))[0]
    assert len(base.text) >= 8, base.text
    stop = base.text[5:7]
    first = base.text.index(stop)
    o = llm.generate(["hello"], SamplingParams(temperature=0.0, max_tokens=16, stop=(stop,)))[0]
    assert o.finish_reason == "stop"
    assert o.text == base.text[:first]
    assert o.output_ids == base.output_ids[: len(o.output_ids)]


def test_preemption_under_tiny_kv_budget_completes_everything(hf_model_dir: Path) -> None:
    ps = prompts(8, seed=7)
    big = LLM(str(hf_model_dir), num_blocks=256, page_size=4)
    want = [o.output_ids for o in big.generate(ps, GREEDY)]
    # 12 blocks x 4 tokens = 48 KV slots for 8 requests of up to 31 tokens each.
    tiny = LLM(str(hf_model_dir), num_blocks=12, page_size=4, chunked_prefill_size=6)
    outs = tiny.generate(ps, GREEDY)
    assert [o.output_ids for o in outs] == want
    assert sum(o.num_preemptions for o in outs) > 0
    assert tiny.pool.num_free_blocks == tiny.pool.num_blocks


def test_continuous_batching_admits_new_requests_mid_flight(hf_model_dir: Path) -> None:
    hf = hf_reference(hf_model_dir)
    llm = LLM(str(hf_model_dir), num_blocks=64, max_running_requests=2)
    ps = prompts(5, seed=11)
    ids = [llm.add_request(ps[0], GREEDY), llm.add_request(ps[1], GREEDY)]
    done = {}
    steps = 0
    while llm.has_unfinished():
        steps += 1
        if steps == 3:  # arrive while the first two decode
            ids += [llm.add_request(p, GREEDY) for p in ps[2:]]
        assert len(llm.scheduler.running) <= 2
        for o in llm.step():
            if o.finished:
                done[o.seq_id] = o.output_ids
    assert [done[i] for i in ids] == [hf_greedy(hf, p, 12) for p in ps]


def test_abort_frees_kv(hf_model_dir: Path) -> None:
    llm = LLM(str(hf_model_dir), num_blocks=64)
    sid = llm.add_request([1, 2, 3], SamplingParams(max_tokens=50))
    llm.step()
    llm.abort(sid)
    outs = llm.step()
    assert [(o.seq_id, o.finish_reason) for o in outs] == [(sid, "abort")]
    assert llm.pool.num_free_blocks == llm.pool.num_blocks and not llm.has_unfinished()


@pytest.mark.parametrize(
    ("kwargs", "prompt", "match"),
    [
        ({"max_model_len": 16}, list(range(16)), "context limit is 16"),
        ({"num_blocks": 2, "page_size": 4}, [1, 2, 3], "pool holds only 8"),
        ({}, [VOCAB + 5], "out of range"),
        ({}, [], "prompt is empty"),
        ({}, "text", "no tokenizer.json"),
    ],
)
def test_bad_requests_get_clear_errors(
    hf_model_dir: Path, kwargs: dict, prompt: list[int] | str, match: str
) -> None:
    llm = LLM(str(hf_model_dir), **kwargs)
    with pytest.raises(ConfigError, match=match):
        llm.add_request(prompt, SamplingParams(max_tokens=20))
    assert not llm.has_unfinished()


def test_bad_engine_options(hf_model_dir: Path) -> None:
    with pytest.raises(ConfigError, match="unknown option 'bogus'"):
        LLM(str(hf_model_dir), bogus=1)
    with pytest.raises(ConfigError, match="max_position_embeddings"):
        LLM(str(hf_model_dir), max_model_len=10**6)
    with pytest.raises(ConfigError, match="holds no block"):
        LLM(str(hf_model_dir), kv_cache_bytes=100)


def test_deferred_draft_context_keeps_the_newest_row_of_a_reused_slot() -> None:
    from dspark_sglang.engine.engine import _last_of_each

    slots = torch.tensor([4, 7, 4, 9, 7, 4])
    assert _last_of_each(slots).tolist() == [3, 4, 5]  # 9 once, 7 and 4 from their last rows
    # distinct slots (no block reused between two flushes): nothing to resolve, write them as is
    assert _last_of_each(torch.tensor([4, 7, 9])) is None
    assert _last_of_each(torch.tensor([], dtype=torch.long)) is None


def test_verified_rows_skip_exactly_the_rejected_drafts() -> None:
    from dspark_sglang.engine.engine import _kept_rows

    # three sequences of 3, 1 and 4 rows: the first kept 2 (one draft rejected), the third 1
    assert _kept_rows([(2, 3), (5, 8)], 8).tolist() == [0, 1, 3, 4]
    assert _kept_rows([], 3).tolist() == [0, 1, 2]
    assert _kept_rows([(0, 2)], 2).dtype == np.int64


def test_skipped_rounds_add_up_as_rounds_that_verified_nothing() -> None:
    from dspark_sglang.engine.speculative import SpecStats

    one_by_one, at_once = SpecStats(gamma=4), SpecStats(gamma=4)
    for committed in (1, 1, 2):
        one_by_one.add_round(0, 0, committed)
    at_once.add_skipped_rounds(3, 4)
    assert at_once.as_dict() == one_by_one.as_dict()
    assert (
        at_once.rounds == 3 and at_once.verify_tokens == 3 and at_once.tau == pytest.approx(4 / 3)
    )


class _FakeClock:
    """engine.time for start-up profiling: seconds advance only as the fake timers say."""

    def __init__(self) -> None:
        self.now = 0.0

    def perf_counter(self) -> float:
        return self.now


def _fake_profiling(monkeypatch: pytest.MonkeyPatch) -> tuple[dict, dict]:
    """Fake forward and drafter timers on a fake clock. Each grid point's second timing is 10x
    its true price (a slow spell of the host); returns (timings per point, fit inputs)."""
    from collections import Counter

    from dspark_sglang.engine import engine as engine_mod

    clock = _FakeClock()
    calls: Counter = Counter()
    fit_in: dict = {}

    def price(p) -> float:  # p: a GridPoint
        return 1e-3 * (1 + p.num_reqs + 0.1 * p.num_tokens + 1e-3 * p.ctx)

    def fake_point(runner, pool, p, repeats, warmup, gen) -> dict:
        calls[p] += 1
        clock.now += 0.01 * (repeats + warmup)
        return {"median_s": price(p) * (10.0 if calls[p] == 2 else 1.0)}

    def fake_draft(runner, pool, n, ctx, repeats, warmup, gen) -> float:
        clock.now += 0.01 * (repeats + warmup)
        return 1e-3 * n

    real_fit = engine_mod.fit_additive

    def spy(r, b, c, s):
        fit_in.update(r=r.copy(), b=b.copy(), s=s.copy(), price=price)
        return real_fit(r, b, c, s)

    monkeypatch.setattr(engine_mod, "time", clock)
    monkeypatch.setattr(engine_mod, "time_point", fake_point)
    monkeypatch.setattr(engine_mod, "time_draft", fake_draft)
    monkeypatch.setattr(engine_mod, "fit_additive", spy)
    return calls, fit_in


def _lagged(tmp_path: Path, budget_s: float, rounds: int = 5) -> LLM:
    from tests.conftest import write_model_pair

    target, drafter = write_model_pair(tmp_path)
    return LLM(
        str(target),
        draft_model=str(drafter),
        schedule_mode="lagged",
        num_blocks=128,
        page_size=4,
        max_running_requests=4,
        startup_profile_seconds=budget_s,
        startup_profile_rounds=rounds,
    )


def test_startup_profile_prices_each_point_at_its_median_over_rounds(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With budget to spare, every grid point is timed in --startup-profile-rounds rounds and
    priced at its median: one slow spell per point (10x) leaves the fit's inputs at the true
    prices. One round (the old single pass) keeps the spell out too: it is the second timing."""
    calls, fit_in = _fake_profiling(monkeypatch)
    llm = _lagged(tmp_path, budget_s=100.0)
    assert llm.startup_rounds == llm.config.draft.startup_profile_rounds == 5
    assert calls and set(calls.values()) == {5}
    want = sorted(fit_in["price"](p) for p in calls)
    assert sorted(fit_in["s"].tolist()) == pytest.approx(want)
    draft = llm.planner.capacity.draft  # plain floats: a live profile writes it as YAML
    assert all(type(x) is float for x in (*draft.knots, *draft.values))


def test_startup_profile_keeps_to_its_budget(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A budget spent in round 0 runs no further round (and round 0 still times one point)."""
    calls, _ = _fake_profiling(monkeypatch)
    llm = _lagged(tmp_path, budget_s=1e-6)
    assert llm.startup_rounds == 1
    assert list(calls.values()) == [1]  # the cheapest point, once
    assert llm.planner is not None and llm.planner.capacity is not None


def test_one_startup_round_is_the_single_pass(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls, fit_in = _fake_profiling(monkeypatch)
    llm = _lagged(tmp_path, budget_s=100.0, rounds=1)
    assert llm.startup_rounds == 1 and set(calls.values()) == {1}
    assert sorted(fit_in["s"].tolist()) == pytest.approx(sorted(fit_in["price"](p) for p in calls))
