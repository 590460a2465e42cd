"""Router fault handling against scripted workers: the test process plays prefill0 and decode0
on the wire (heartbeats, Requests in, Deltas out), so it can fail links on cue.

The case: right after a decode worker (re)joins, a prefill worker's PUSH socket to it may not
be connected yet (ZMQ reconnects every 100 ms), so the first handoffs report "decode0 is
unreachable". The router must retry with a backoff, not burn every attempt in a millisecond.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import zmq

from dspark_sglang.config import Config, DraftConfig, ModelConfig
from dspark_sglang.serve import messages as m
from tests.integration.conftest import Cluster
from tests.reliability.conftest import wait_up

pytestmark = pytest.mark.timeout(120)
LINK_DOWN_S = 0.1  # the prefill -> decode link heals this long after the first handoff


class FakeWorkers:
    """prefill0 + decode0 in this process. A Request that arrives within LINK_DOWN_S of the
    first one is answered "decode0 is unreachable"; later ones complete with one token."""

    def __init__(self, c: Cluster, model: tuple[Path, Path]) -> None:
        cfg = Config(ModelConfig(str(model[0])), draft=DraftConfig(path=str(model[1])))
        self.hand = m.expected_handshake(cfg)
        ctx = zmq.Context.instance()
        self.inbox = ctx.socket(zmq.PULL)
        self.inbox.bind(f"ipc://{c.dir}/p0")
        self.decode_inbox = ctx.socket(zmq.PULL)  # the router's Aborts land here
        self.decode_inbox.bind(f"ipc://{c.dir}/d0")
        self.out = ctx.socket(zmq.PUSH)
        self.out.linger = 0
        self.out.connect(f"ipc://{c.dir}/api")
        self.requests: list[tuple[float, int]] = []  # (arrival, uid)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        next_beat = 0.0
        while not self._stop.is_set():
            if time.monotonic() >= next_beat:
                for name in ("prefill0", "decode0"):
                    hb = m.Heartbeat(name, 1, self.hand, 0, 0, 64, 64)
                    self.out.send_multipart(m.encode(hb))
                next_beat = time.monotonic() + 0.2
            while self.decode_inbox.poll(0):
                self.decode_inbox.recv_multipart()
            if not self.inbox.poll(20):
                continue
            msg, _ = m.decode(self.inbox.recv_multipart())
            if not isinstance(msg, m.Request):
                continue
            now = time.monotonic()
            self.requests.append((now, msg.uid))
            if now - self.requests[0][0] < LINK_DOWN_S:
                err = "decode0 is unreachable from prefill0"
                d = m.Delta(msg.uid, [], "", True, error=err, status=503)
                self.out.send_multipart(m.encode(m.Deltas("prefill0", [d])))
            else:
                d = m.Delta(msg.uid, [7], "x", True, "length", num_output=1)
                self.out.send_multipart(m.encode(m.Deltas("decode0", [d])))

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        for s in (self.inbox, self.decode_inbox, self.out):
            s.close()


@pytest.fixture
def scripted(model_pair: tuple[Path, Path]) -> Iterator[tuple[Cluster, FakeWorkers]]:
    c = Cluster(model_pair)
    c.start("router")
    fake = FakeWorkers(c, model_pair)
    try:
        wait_up(c.url, timeout=60)
        yield c, fake
    finally:
        fake.close()
        c.stop()


def test_unreachable_decode_right_after_join_is_retried_with_backoff(
    scripted: tuple[Cluster, FakeWorkers],
) -> None:
    c, fake = scripted
    r = httpx.post(f"{c.url}/v1/completions", json={"prompt": "hi", "max_tokens": 1}, timeout=30)
    gaps = [round(b[0] - a[0], 3) for a, b in zip(fake.requests, fake.requests[1:], strict=False)]
    print(f"[reliability] scripted unreachable decode: attempts={len(fake.requests)} gaps={gaps}")
    assert r.status_code == 200, r.text
    assert r.json()["dspark"]["attempts"] == 2
    assert gaps[0] >= LINK_DOWN_S
