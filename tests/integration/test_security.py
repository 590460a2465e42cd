"""Multi-host mode: off-host ZMQ addresses need CurveZMQ or HMAC; unauthenticated peers are
refused. A router process alone is enough: the test plays the worker's side of the wire."""

from __future__ import annotations

import contextlib
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import zmq

from dspark_sglang.config import Config, DraftConfig, ModelConfig, ServeConfig
from dspark_sglang.serve import messages as m
from dspark_sglang.serve.transport import Security, Sender, generate_curve_keys
from tests.integration.conftest import Cluster, free_port

pytestmark = pytest.mark.timeout(120)


def heartbeat(model: tuple[Path, Path]) -> list[bytes]:
    cfg = Config(ModelConfig(str(model[0])), draft=DraftConfig(path=str(model[1])))
    hand = m.expected_handshake(cfg)
    return m.encode(m.Heartbeat("decode0", 1, hand, 0, 0, 8, 8))


@pytest.fixture
def router(model_pair: tuple[Path, Path], request: pytest.FixtureRequest) -> Iterator[Cluster]:
    """A router whose inbox binds every interface, secured as the test parameter says."""
    c = Cluster(model_pair)
    port = free_port()
    secret: list[str]
    if request.param == "hmac":
        key = c.dir / "hmac.key"
        key.write_text("0123456789abcdef-secret")
        secret = ["--zmq-hmac-key-file", str(key)]
    else:
        generate_curve_keys(str(c.dir / "curve"))
        secret = ["--zmq-curve-dir", str(c.dir / "curve")]
    c.args += ["--zmq-api-addr", f"tcp://0.0.0.0:{port}", "--heartbeat-timeout", "60", *secret]
    c.start("router")
    c.inbox, c.secret = f"tcp://127.0.0.1:{port}", secret  # type: ignore[attr-defined]
    deadline = time.monotonic() + 30
    while True:
        try:
            if httpx.get(f"{c.url}/health", timeout=1).status_code == 200:
                break
        except httpx.HTTPError:
            assert time.monotonic() < deadline, c.all_logs()
            time.sleep(0.2)
    yield c
    c.stop()


def test_offhost_bind_without_secret_is_refused(model_pair: tuple[Path, Path]) -> None:
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "dspark_sglang.launch_server",
            "--role",
            "router",
            "--model-path",
            str(model_pair[0]),
            "--zmq-api-addr",
            "tcp://0.0.0.0:45999",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 2
    assert "--zmq-curve-dir" in r.stderr and "--zmq-hmac-key-file" in r.stderr


def decode0_up(c: Cluster) -> float:
    return c.metrics()['dspark_worker_up{worker="decode0"}']


@pytest.mark.parametrize("router", ["hmac", "curve"], indirect=True)
def test_unauthenticated_peer_is_refused(router: Cluster, model_pair: tuple[Path, Path]) -> None:
    rogue = zmq.Context.instance().socket(zmq.PUSH)
    rogue.linger = 0
    rogue.connect(router.inbox)  # type: ignore[attr-defined]
    for _ in range(5):
        # Under CURVE the router rejects the handshake, and once libzmq drops that connection a
        # PUSH with no peer blocks on send: a blocking send hung here until the test timed out.
        with contextlib.suppress(zmq.Again):
            rogue.send_multipart(heartbeat(model_pair), flags=zmq.NOBLOCK)
    time.sleep(1.0)
    assert decode0_up(router) == 0.0
    rogue.close()
    flag, value = router.secret  # type: ignore[attr-defined]
    kind = "hmac_key_file" if flag == "--zmq-hmac-key-file" else "curve_dir"
    sec = Security(ServeConfig(**{kind: value}))
    peer = Sender(router.inbox, sec)  # type: ignore[attr-defined]
    deadline = time.monotonic() + 10
    while decode0_up(router) != 1.0:
        assert time.monotonic() < deadline, "an authenticated peer was not accepted"
        peer.send(heartbeat(model_pair))
        time.sleep(0.2)
    peer.close()
    if flag == "--zmq-hmac-key-file":
        assert router.metrics()["dspark_rejected_messages"] >= 5
