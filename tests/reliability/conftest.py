"""Reliability fixtures: the integration suite's `Cluster` and model pair, reused; process and KV
probes; two shared clusters (a loopback one for fuzzing and soak, a secured multi-host one).

Bounds are module constants so docs/reliability.md can quote them.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.integration import conftest as integration
from tests.integration.conftest import Cluster, free_port
from tests.integration.test_faults import wait_for

model_pair = integration.model_pair  # the integration suite's fixture: random target + drafter

API_KEY = "reliability-test-key"
HMAC_SECRET = "0123456789abcdef-reliability"
FRONT_MAX_LEN = 64  # context of the fuzz/soak cluster: every valid request is short
FRONT_MAX_PENDING = 48  # its in-flight cap: a soak at concurrency 64 must see 429s
SETTLE_S = 15.0  # after load or a fault, KV pools must be full again within this
FRESH_S = 0.6  # > 2 heartbeat intervals (Cluster passes 0.25 s): worker gauges are this stale


def rss_mb(pid: int) -> float:
    """Resident set size of a process, from /proc (no psutil)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"no VmRSS for pid {pid}")


def alive(c: Cluster) -> dict[str, bool]:
    return {name: p.poll() is None for name, p in c.procs.items()}


def kv_used(c: Cluster, workers: tuple[str, ...]) -> dict[str, float]:
    """KV blocks in use per worker, from its last heartbeat."""
    mt = c.metrics()
    blocks = lambda g, w: mt.get(f'dspark_{g}{{worker="{w}"}}', -1.0)
    return {w: blocks("kv_pool_blocks", w) - blocks("kv_pool_free_blocks", w) for w in workers}


def quiet_kv(c: Cluster, workers: tuple[str, ...], timeout: float = SETTLE_S) -> dict[str, float]:
    """KV blocks in use once nothing is in flight anywhere and two fresh heartbeats agree: the
    baseline a test's own traffic must return to. A bare `kv_used` right after a response can
    still count that request's blocks (heartbeats are up to FRESH_S stale), and a baseline of 1
    then never comes back once the blocks are freed."""

    def idle() -> bool:
        mt = c.metrics()
        if mt["dspark_inflight_requests"] != 0:
            return False
        g = lambda name, w: mt.get(f'dspark_{name}{{worker="{w}"}}', -1.0)
        return all(
            g("worker_up", w) == 1 and g("running_requests", w) == 0 and g("queue_depth", w) == 0
            for w in workers
        )

    deadline = time.monotonic() + timeout
    time.sleep(FRESH_S)
    wait_for(idle, timeout, "cluster not idle")
    prev = kv_used(c, workers)
    while time.monotonic() < deadline:
        time.sleep(FRESH_S)
        now = kv_used(c, workers)
        if now == prev:
            return now
        prev = now
    raise AssertionError(f"KV blocks in use kept changing while idle: {prev}")


def settled(c: Cluster, used: dict[str, float]) -> bool:
    """Router holds no request; each worker is up, runs and queues nothing, and holds `used`
    KV blocks (its baseline: 0 is a full pool)."""
    mt = c.metrics()
    if mt["dspark_inflight_requests"] != 0:
        return False
    for w, n in used.items():
        g = lambda name, w=w: mt.get(f'dspark_{name}{{worker="{w}"}}', -1.0)
        if g("worker_up") != 1 or g("running_requests") != 0 or g("queue_depth") != 0:
            return False
        if g("kv_pool_blocks") - g("kv_pool_free_blocks") != n:
            return False
    return True


def wait_kv_back(
    c: Cluster,
    workers: tuple[str, ...],
    baseline: dict[str, float] | None = None,
    timeout: float = SETTLE_S,
) -> float:
    """Seconds until `settled` at `baseline` (default: full pools); at least FRESH_S, so no
    heartbeat from before the caller's last request can pass for a settled worker."""
    used = baseline or dict.fromkeys(workers, 0.0)
    t0 = time.monotonic()
    time.sleep(FRESH_S)
    try:
        wait_for(lambda: settled(c, used), timeout, "KV not back to baseline")
    except AssertionError:
        now = kv_used(c, workers)
        raise AssertionError(f"KV blocks in use {now}, baseline {used}, after {timeout}s") from None
    return time.monotonic() - t0


def wait_up(url: str, timeout: float = 90.0, key: str | None = None) -> None:
    """Until /ready is 200 (with the API key when the server needs one)."""
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{url}/ready", headers=headers, timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise TimeoutError(f"{url} not ready within {timeout}s")


@pytest.fixture(scope="session")
def front(model_pair: tuple[Path, Path]) -> Iterator[Cluster]:
    """router + 1 prefill + 1 decode on ipc://, DSpark drafter on, a 64-token context and an
    in-flight cap of 48: the target of HTTP fuzzing, rogue ZMQ peers and the soak."""
    c = Cluster(
        model_pair,
        extra=(
            "--max-model-len",
            str(FRONT_MAX_LEN),
            "--max-pending-requests",
            str(FRONT_MAX_PENDING),
            "--request-timeout",
            "30",
        ),
    )
    try:
        yield c.start_all()
    finally:
        c.stop()


@pytest.fixture(scope="session")
def secure(model_pair: tuple[Path, Path]) -> Iterator[Cluster]:
    """Multi-host mode on one host: every ZMQ inbox binds tcp://0.0.0.0 and every message is
    HMAC-signed; the HTTP API needs a Bearer key. No drafter (faster start)."""
    c = Cluster(model_pair)
    key = c.dir / "hmac.key"
    key.write_text(HMAC_SECRET)
    api, pre, dec = (f"tcp://0.0.0.0:{free_port()}" for _ in range(3))
    c.args += [
        "--zmq-api-addr",
        api,
        "--zmq-prefill-addrs",
        pre,
        "--zmq-decode-addrs",
        dec,
        "--zmq-hmac-key-file",
        str(key),
        "--api-key",
        API_KEY,
        "--speculative-algorithm",
        "none",
    ]
    c.inboxes = {  # type: ignore[attr-defined]
        n: a.replace("0.0.0.0", "127.0.0.1")
        for n, a in (("router", api), ("prefill0", pre), ("decode0", dec))
    }
    try:
        for role in ("router", "prefill", "decode"):
            c.start(role)
        wait_up(c.url, key=API_KEY)
        yield c
    finally:
        c.stop()
