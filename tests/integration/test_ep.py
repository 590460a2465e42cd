"""`launch_server --ep-size 2` over real processes: every prefill/decode worker runs two expert-
parallel ranks; PD serving stays exact, and a dead rank takes its worker down (docs/ep.md)."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from dspark_sglang import LLM, SamplingParams
from dspark_sglang.engine.ep import RANK_FAILURE_EXIT
from tests.integration.conftest import Cluster

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def ep_cluster(model_pair: tuple[Path, Path]) -> Iterator[Cluster]:
    c = Cluster(model_pair, extra=("--ep-size", "2"))
    try:
        yield c.start_all()
    finally:
        c.stop()


def test_greedy_pd_with_ep2_equals_single_process_engine(
    ep_cluster: Cluster, model_pair: tuple[Path, Path]
) -> None:
    prompts = ["hello world", "The quick brown fox", "z" * 30]
    want = LLM(str(model_pair[0])).generate(prompts, SamplingParams(temperature=0.0, max_tokens=20))
    for p, w in zip(prompts, want, strict=True):
        body = {"prompt": p, "max_tokens": 20, "temperature": 0}
        r = httpx.post(f"{ep_cluster.url}/v1/completions", json=body, timeout=60)
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"] == w.text


def test_a_dead_rank_takes_its_worker_down(ep_cluster: Cluster) -> None:
    decode = ep_cluster.procs["decode0"]
    children = Path(f"/proc/{decode.pid}/task/{decode.pid}/children").read_text().split()
    assert len(children) == 1  # the rank-1 follower
    os.kill(int(children[0]), signal.SIGKILL)
    assert decode.wait(timeout=10) == RANK_FAILURE_EXIT
    assert "expert-parallel rank 1" in ep_cluster.log("decode0")
    deadline = time.monotonic() + 10
    while httpx.get(f"{ep_cluster.url}/ready", timeout=5).json()["workers"]["decode0"] == "up":
        assert time.monotonic() < deadline, "router still lists decode0 as up"
        time.sleep(0.2)
