"""Faults over real processes (2 prefill + 2 decode workers): saturation, a stalled prefill
worker, kill -9 of a decode worker mid-stream, a restarted worker, a mismatched worker."""

from __future__ import annotations

import json
import os
import signal
import time
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path

import httpx
import pytest

from tests.integration.conftest import Cluster

pytestmark = pytest.mark.timeout(300)
LONG = {"prompt": "go", "max_tokens": 3500, "ignore_eos": True, "stream": True}


@pytest.fixture(scope="module")
def pd(model_pair: tuple[Path, Path]) -> Iterator[Cluster]:
    # decode2 is configured but only started by the handshake test.
    c = Cluster(model_pair, num_prefill=2, num_decode=3, extra=("--max-pending-requests", "4"))
    try:
        c.start("router")
        for role, i in (("prefill", 0), ("prefill", 1), ("decode", 0), ("decode", 1)):
            c.start(role, i)
        c.wait_ready(workers=("prefill0", "prefill1", "decode0", "decode1"))
        yield c
    finally:
        c.stop()


def open_stream(stack: ExitStack, c: Cluster, body: dict) -> Iterator[str]:
    r = stack.enter_context(
        httpx.stream("POST", f"{c.url}/v1/completions", json=body, timeout=httpx.Timeout(10.0))
    )
    assert r.status_code == 200, r.read()
    lines = (ln for ln in r.iter_lines() if ln.startswith("data: "))
    assert "text" in next(lines)  # the first token arrived: the request is on a decode worker
    return lines


def idle(c: Cluster, workers: tuple[str, ...]) -> bool:
    mt = c.metrics()
    return mt["dspark_inflight_requests"] == 0 and all(
        mt[f'dspark_kv_pool_free_blocks{{worker="{w}"}}']
        == mt[f'dspark_kv_pool_blocks{{worker="{w}"}}']
        for w in workers
    )


def wait_for(cond: object, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not cond():  # type: ignore[operator]
        assert time.monotonic() < deadline, what
        time.sleep(0.2)


def test_saturation_is_429_with_retry_after(pd: Cluster) -> None:
    with ExitStack() as stack:
        streams = [open_stream(stack, pd, LONG) for _ in range(4)]  # (a dropped one disconnects)
        r = httpx.post(f"{pd.url}/v1/completions", json={"prompt": "x"}, timeout=10)
        assert r.status_code == 429 and r.headers["retry-after"] == "1"
        assert all("text" in next(s) for s in streams)
    wait_for(lambda: idle(pd, ("decode0", "decode1")), 10, "KV not freed after 4 disconnects")


def test_stalled_prefill_worker_requests_are_retried(pd: Cluster) -> None:
    os.kill(pd.procs["prefill0"].pid, signal.SIGSTOP)
    try:
        t0 = time.monotonic()
        r = httpx.post(
            f"{pd.url}/v1/completions", timeout=30, json={"prompt": "retry me", "max_tokens": 8}
        )
        assert r.status_code == 200, r.text
        ext = r.json()["dspark"]
        assert ext["prefill"] == "prefill1" and ext["attempts"] == 2
        assert time.monotonic() - t0 < 10
    finally:
        os.kill(pd.procs["prefill0"].pid, signal.SIGCONT)
    # It resumes, finds its stale request aborted, and rejoins with the same process.
    pd.wait_ready(workers=("prefill0",), timeout=10)
    wait_for(lambda: idle(pd, ("prefill0", "decode0", "decode1")), 10, "stale work not freed")


def test_kill9_decode_mid_stream(pd: Cluster) -> None:
    with ExitStack() as stack:
        a = open_stream(stack, pd, LONG)  # least-loaded: decode0
        b = open_stream(stack, pd, LONG)  # decode1
        pd.procs["decode0"].send_signal(signal.SIGKILL)
        t0 = time.monotonic()
        events = [json.loads(ln[6:]) for ln in a if ln != "data: [DONE]"]
        assert "error" in events[-1] and "decode0" in events[-1]["error"]["message"]
        assert time.monotonic() - t0 < 10
        for _ in range(20):  # the other stream is untouched
            assert "text" in next(b)
    assert httpx.get(f"{pd.url}/health").status_code == 200
    r = httpx.post(f"{pd.url}/v1/completions", json={"prompt": "x", "max_tokens": 4}, timeout=30)
    assert r.status_code == 200 and r.json()["dspark"]["decode"] == "decode1"
    # A restarted decode worker rejoins the running router and serves again.
    pd.start("decode", 0)
    pd.wait_ready(workers=("decode0",))
    r = httpx.post(f"{pd.url}/v1/completions", json={"prompt": "x", "max_tokens": 4}, timeout=30)
    assert r.status_code == 200 and r.json()["dspark"]["decode"] == "decode0"
    wait_for(lambda: idle(pd, ("prefill0", "prefill1", "decode0", "decode1")), 10, "KV leak")


def test_mismatched_worker_is_refused(pd: Cluster) -> None:
    p = pd.start("decode", 2, "--page-size", "8")
    assert p.wait(120) != 0
    assert "page_size" in pd.log("decode2")
    ready = httpx.get(f"{pd.url}/ready").json()["workers"]
    assert "page_size is 16 on the router but 8 on the worker" in ready["decode2"]
