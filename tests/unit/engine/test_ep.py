"""Expert parallelism: two ranks over gloo on loopback reproduce one rank exactly, account routed
pairs per rank, and fail loudly (never hang) when a rank dies or stalls."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from dspark_sglang import LLM, SamplingParams
from dspark_sglang.config import ArchConfig, CacheConfig, ConfigError, ModelConfig, ParallelConfig
from dspark_sglang.engine.batch import build_batch
from dspark_sglang.engine.block_pool import BlockPool
from dspark_sglang.engine.ep import RANK_FAILURE_EXIT, LeaderRunner, RankFailure
from dspark_sglang.engine.runner import ModelRunner
from dspark_sglang.engine.sequence import Sequence, Status
from dspark_sglang.models import attention
from dspark_sglang.types import SamplingParams as SP
from dspark_sglang.types import ScheduledSeq, StepPlan, StepRecord
from tests.conftest import VOCAB, write_drafter, write_hf_model
from tests.unit.engine.test_speculative import ContinuationDrafter

GREEDY = SamplingParams(temperature=0.0, max_tokens=16)
KV = dict(num_blocks=96, page_size=4)


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("ep")
    target = write_hf_model(root / "target", moe=True)  # 6 experts, top-2; layer 1 is dense
    return target, write_drafter(root / "drafter", target, block_size=4)


@pytest.fixture(scope="module")
def ep2(pair: tuple[Path, Path]) -> Iterator[LLM]:
    llm = LLM(str(pair[0]), ep_size=2, chunked_prefill_size=8, **KV)
    yield llm
    llm.close()


@pytest.fixture(scope="module")
def ep2_spec(pair: tuple[Path, Path]) -> Iterator[LLM]:
    # sync mode: start-up capacity profiling runs through the EP ranks and fits the EP term
    llm = LLM(
        str(pair[0]),
        draft_model=str(pair[1]),
        ep_size=2,
        schedule_mode="sync",
        startup_profile_seconds=3.0,
        **KV,
    )
    yield llm
    llm.close()


@pytest.fixture(scope="module")
def ep2_verify_all(pair: tuple[Path, Path]) -> Iterator[LLM]:
    # every draft verified, whatever a start-up profile on a noisy host would say
    llm = LLM(str(pair[0]), draft_model=str(pair[1]), ep_size=2, schedule_mode="verify-all", **KV)
    yield llm
    llm.close()


def prompts(n: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [
        torch.randint(
            0, VOCAB, (int(torch.randint(2, 20, (1,), generator=g)),), generator=g
        ).tolist()
        for _ in range(n)
    ]


def two_forwards(runner: ModelRunner, pool: BlockPool) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """A ragged prefill of three sequences, then a 3-token verify-like step on top of it;
    (logits of every row, expert counts) of each."""
    g = torch.Generator().manual_seed(1)
    lens = (11, 6, 17)
    seqs: dict[int, Sequence] = {}
    for i, n in enumerate(lens):
        seq = Sequence(i, torch.randint(0, VOCAB, (n,), generator=g).tolist(), SP(), arrival=i)
        seq.status = Status.RUNNING
        pool.grow(seq.block_table, n)
        seqs[i] = seq
    out = []
    try:
        prefill = StepPlan(tuple(ScheduledSeq(i, 0, n - 3, True) for i, n in enumerate(lens)))
        verify = StepPlan(tuple(ScheduledSeq(i, n - 3, 3, True) for i, n in enumerate(lens)))
        for plan in (prefill, verify):
            batch = build_batch(plan, seqs, runner.page_size, runner.device)
            batch = replace(batch, sample_rows=torch.arange(batch.num_tokens))
            if attention.MIN_GROUP_CELLS == 0:
                assert len(batch.attn.groups) > 1
            res = runner.forward(batch)
            assert res.expert_counts is not None
            out.append((res.logits, res.expert_counts.clone()))
    finally:
        for seq in seqs.values():
            pool.release(seq.block_table)
    return out


def test_ep2_logits_and_routing_equal_one_rank(
    pair: tuple[Path, Path], ep2: LLM, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Lift the merge floor so these short sequences run as several attention groups, and the
    # followers must rebuild that grouped metadata from the wire.
    monkeypatch.setattr(attention, "MIN_GROUP_CELLS", 0)
    assert isinstance(ep2.runner, LeaderRunner)
    one = ModelRunner(ModelConfig(str(pair[0])), CacheConfig(**KV))
    ref = two_forwards(one, BlockPool(one.num_blocks, one.page_size))
    got = two_forwards(ep2.runner, ep2.pool)
    for (ref_logits, ref_counts), (logits, counts) in zip(ref, got, strict=True):
        torch.testing.assert_close(logits, ref_logits, rtol=1e-5, atol=1e-5)
        assert counts.tolist() == ref_counts.tolist()


def test_ep2_greedy_generations_and_load_accounting(pair: tuple[Path, Path], ep2: LLM) -> None:
    ps = prompts(6)
    ref_recs: list[StepRecord] = []
    one = LLM(str(pair[0]), chunked_prefill_size=8, **KV)
    one.on_step = ref_recs.append
    ref = one.generate(ps, GREEDY)
    recs: list[StepRecord] = []
    ep2.on_step = recs.append
    try:
        got = ep2.generate(ps, GREEDY)
    finally:
        ep2.on_step = None
    assert [o.output_ids for o in got] == [o.output_ids for o in ref]
    arch = ArchConfig.from_model_path(pair[0])
    moe_layers = sum(arch.is_moe_layer(i) for i in range(arch.num_hidden_layers))
    assert len(recs) == len(ref_recs)
    for rec, r1 in zip(recs, ref_recs, strict=True):
        per_expert, per_rank = rec.routed_tokens_per_expert, rec.routed_tokens_per_rank
        assert per_expert == r1.routed_tokens_per_expert  # the same routing as one rank
        assert r1.routed_tokens_per_rank == ()
        assert len(per_rank) == 2
        assert (
            sum(per_rank)
            == sum(per_expert)
            == rec.num_tokens * arch.num_experts_per_tok * (moe_layers)
        )
        assert per_rank == (sum(per_expert[:3]), sum(per_expert[3:]))  # contiguous blocks


@pytest.mark.parametrize("drafter", ["random", "continuation"])
def test_speculative_ep2_stays_lossless(
    pair: tuple[Path, Path], ep2_spec: LLM, ep2_verify_all: LLM, drafter: str
) -> None:
    # the random drafter under the capacity-driven sync schedule; the continuation drafter
    # (long accepted prefixes, so multi-token verify rows for sure) under verify-all
    if drafter == "continuation":
        ep2_spec = ep2_verify_all
    ps = prompts(5, seed=2)
    ref = LLM(str(pair[0]), **KV).generate(ps, GREEDY)
    if drafter == "continuation":  # long accepted prefixes: multi-token verify rows
        want = {tuple(p): o.output_ids for p, o in zip(ps, ref, strict=True)}
        ep2_spec.runner.draft = ContinuationDrafter(ep2_spec, want, bad=0.3)  # type: ignore[method-assign]
    try:
        got = ep2_spec.generate(ps, GREEDY)
    finally:
        ep2_spec.runner.__dict__.pop("draft", None)
    assert [o.output_ids for o in got] == [o.output_ids for o in ref]
    if drafter == "continuation":
        assert sum(o.spec_accepted for o in got) > 0


def test_startup_profile_fits_the_ep_term(ep2_spec: LLM) -> None:
    assert ep2_spec.planner is not None and ep2_spec.planner.capacity is not None
    moe = ep2_spec.planner.capacity.moe
    assert moe is not None and (moe.ep_size, moe.num_experts, moe.top_k) == (2, 6, 2)
    assert list(moe.load.values) == sorted(moe.load.values) and moe.load.values[-1] > 0
    assert ep2_spec.planner.capacity.predict(4, 12) > 0


def _running_engine(path: Path, timeout_s: float) -> LLM:
    llm = LLM(str(path), ep_size=2, ep_timeout_s=timeout_s, **KV)
    for p in prompts(3, seed=4):
        llm.add_request(p, SamplingParams(temperature=0.0, max_tokens=64))
    llm.step()
    return llm


def test_killed_rank_fails_the_engine_with_a_clear_error(pair: tuple[Path, Path]) -> None:
    llm = _running_engine(pair[0], timeout_s=10.0)
    assert isinstance(llm.runner, LeaderRunner)
    follower = llm.runner.followers.procs[0]
    os.kill(follower.pid, signal.SIGKILL)
    t0 = time.monotonic()
    with pytest.raises(RankFailure, match=r"rank 1 \(pid \d+\) exited with signal SIGKILL"):
        for _ in range(100):
            llm.step()
    assert time.monotonic() - t0 < 10.0
    with pytest.raises(RankFailure):  # and it stays failed
        llm.step()
    llm.close()


def test_stalled_rank_times_out(pair: tuple[Path, Path]) -> None:
    llm = _running_engine(pair[0], timeout_s=2.0)
    assert isinstance(llm.runner, LeaderRunner)
    follower = llm.runner.followers.procs[0]
    os.kill(follower.pid, signal.SIGSTOP)
    t0 = time.monotonic()
    try:
        with pytest.raises(RankFailure, match="collective failed"):
            llm.step()
        assert time.monotonic() - t0 < 2.0 + 5.0
    finally:
        llm.close()  # kills the stopped rank
    assert follower.poll() is not None


def test_worker_exits_when_a_rank_dies_while_idle(pair: tuple[Path, Path]) -> None:
    code = (
        "import sys, time\n"
        "from dspark_sglang import LLM\n"
        f"llm = LLM({str(pair[0])!r}, ep_size=2, exit_on_rank_failure=True, num_blocks=32)\n"
        "print(llm.runner.followers.procs[0].pid, flush=True)\n"
        "time.sleep(60)\n"
    )
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(
        [sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env
    )
    try:
        assert proc.stdout is not None and proc.stderr is not None
        os.kill(int(proc.stdout.readline()), signal.SIGKILL)
        t0 = time.monotonic()
        assert proc.wait(timeout=10) == RANK_FAILURE_EXIT
        assert time.monotonic() - t0 < 3.0
        assert b"expert-parallel rank 1" in proc.stderr.read()
    finally:
        proc.kill()
        proc.wait()


def test_ep_config_errors(pair: tuple[Path, Path], tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="--ep-size"):
        ParallelConfig(ep_size=0)
    dense = write_hf_model(tmp_path / "dense", moe=False)
    with pytest.raises(ConfigError, match="needs a MoE target"):
        LLM(str(dense), ep_size=2, num_blocks=8)
    with pytest.raises(ConfigError, match="must divide the target's num_experts 6"):
        LLM(str(pair[0]), ep_size=4, num_blocks=8)


def test_launch_server_passes_ep_size(pair: tuple[Path, Path]) -> None:
    from dspark_sglang.launch_server import build_parser, config_from_args

    args = build_parser().parse_args(["--model-path", str(pair[0]), "--ep-size", "2"])
    cfg = config_from_args(args)
    assert cfg.parallel.ep_size == 2 and cfg.parallel.exit_on_rank_failure
    one = config_from_args(build_parser().parse_args(["--model-path", str(pair[0])]))
    assert one.parallel == ParallelConfig(exit_on_rank_failure=True)


def test_profile_ep_benchmark_runs(pair: tuple[Path, Path], tmp_path: Path) -> None:
    import json

    from dspark_sglang.profile import main

    out = tmp_path / "ep.json"
    argv = ["--ep-size", "2", "--model-path", str(pair[0]), "--batch-sizes", "1,4"]
    argv += ["--context-len", "4", "--repeats", "1", "--warmup", "0", "--rounds", "1"]
    assert main([*argv, "--output", str(out), "--plot", str(tmp_path / "ep.png")]) == 0
    rep = json.loads(out.read_text())
    for view in ("critical_path", "wall_p25"):
        for name in ("balanced", "skewed"):
            r = rep[view][name]
            assert len(r["measured_ms"]) == len(r["predicted_ep_aware_ms"]) == 2
            assert r["mape_ep_aware"] >= 0
    assert rep["routing"]["skewed"]["rank_shares"][0] > rep["routing"]["balanced"]["rank_shares"][0]
    assert (tmp_path / "ep.png").stat().st_size > 0
