"""Real serving processes on loopback: a small random target + drafter, and a Cluster helper."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.conftest import write_model_pair

READY_TIMEOUT_S = 90


@pytest.fixture(scope="session")
def model_pair(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("serve_model")
    # A long context, so a stream can outlive a kill -9 on a fast machine.
    return write_model_pair(root, chat=True, max_position_embeddings=4096)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Cluster:
    """One router and workers, each its own `launch_server --role` process, on ipc:// sockets."""

    def __init__(
        self,
        model: tuple[Path, Path],
        num_prefill: int = 1,
        num_decode: int = 1,
        extra: tuple[str, ...] = (),
    ) -> None:
        self.dir = Path(tempfile.mkdtemp(prefix="dsp"))  # short: ipc paths max ~100 chars
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        ipc = lambda name: f"ipc://{self.dir}/{name}"
        self.args = [
            "--model-path",
            str(model[0]),
            "--draft-model-path",
            str(model[1]),
            "--port",
            str(self.port),
            "--zmq-api-addr",
            ipc("api"),
            "--zmq-prefill-addrs",
            ",".join(ipc(f"p{i}") for i in range(num_prefill)),
            "--zmq-decode-addrs",
            ",".join(ipc(f"d{i}") for i in range(num_decode)),
            "--heartbeat-interval",
            "0.25",
            "--heartbeat-timeout",
            "2",
            # Seeded parity with the offline engine needs a verify-length policy that does not
            # read measured step times; the lagged default is covered by its own test.
            "--schedule-mode",
            "verify-all",
            *extra,
        ]
        self.procs: dict[str, subprocess.Popen] = {}
        self.logs: dict[str, Path] = {}

    def start(self, role: str, index: int = 0, *more: str) -> subprocess.Popen:
        name = role if role == "router" else f"{role}{index}"
        log = self.dir / f"{name}.log"
        self.logs[name] = log
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        cmd = [
            sys.executable,
            "-m",
            "dspark_sglang.launch_server",
            "--role",
            role,
            "--worker-index",
            str(index),
            *self.args,
            *more,
        ]
        p = subprocess.Popen(cmd, stdout=log.open("w"), stderr=subprocess.STDOUT, env=env)
        self.procs[name] = p
        return p

    def start_all(self, num_prefill: int = 1, num_decode: int = 1) -> Cluster:
        self.start("router")
        for i in range(num_prefill):
            self.start("prefill", i)
        for i in range(num_decode):
            self.start("decode", i)
        # every worker, not just the first of each role: tests that place work on a given
        # worker (least-loaded alternation) must not start while one is still booting
        names = [f"prefill{i}" for i in range(num_prefill)] + [
            f"decode{i}" for i in range(num_decode)
        ]
        self.wait_ready(workers=tuple(names))
        return self

    def wait_ready(self, workers: tuple[str, ...] = (), timeout: float = READY_TIMEOUT_S) -> None:
        """Until /ready is 200 and every named worker is up."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for name, p in self.procs.items():
                if p.poll() is not None and name in (*workers, "router"):
                    raise RuntimeError(f"{name} exited early:\n{self.log(name)}")
            try:
                r = httpx.get(f"{self.url}/ready", timeout=2)
                up = r.json().get("workers", {})
                if r.status_code == 200 and all(up.get(w) == "up" for w in workers):
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise TimeoutError(f"cluster not ready in {timeout}s:\n{self.all_logs()}")

    def log(self, name: str) -> str:
        return self.logs[name].read_text()[-4000:]

    def all_logs(self) -> str:
        return "\n".join(f"--- {n}\n{self.log(n)}" for n in self.logs)

    def metrics(self) -> dict[str, float]:
        text = httpx.get(f"{self.url}/metrics", timeout=5).text
        out = {}
        for line in text.splitlines():
            if line and not line.startswith("#"):
                key, val = line.rsplit(" ", 1)
                out[key] = float(val)
        return out

    def stop(self) -> None:
        for p in self.procs.values():
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in self.procs.values():
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        shutil.rmtree(self.dir, ignore_errors=True)


@pytest.fixture(scope="module")
def cluster(model_pair: tuple[Path, Path]) -> Iterator[Cluster]:
    """router + 1 prefill + 1 decode, DSpark drafter on; shared by a module's tests."""
    c = Cluster(model_pair)
    try:
        yield c.start_all()
    finally:
        c.stop()
