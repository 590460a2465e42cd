"""ZMQ PUSH/PULL from ServeConfig addresses, with CurveZMQ or HMAC peer authentication.

The only module that imports zmq. Senders never block: a peer that is down or full reads as
"not sent" and the caller decides (retry elsewhere, report an error).
"""

from __future__ import annotations

import hashlib
import hmac
import logging
from pathlib import Path

import zmq
import zmq.auth
from zmq.auth.thread import ThreadAuthenticator

from dspark_sglang.config import ConfigError, ServeConfig, is_loopback_addr

log = logging.getLogger(__name__)
CURVE_CERT = "cluster"  # <curve_dir>/cluster.key_secret, shared by every process of a deployment
_auth: ThreadAuthenticator | None = None


def generate_curve_keys(curve_dir: str) -> None:
    """Create the cluster certificate; copy the folder to every host of the deployment."""
    Path(curve_dir).mkdir(parents=True, exist_ok=True)
    zmq.auth.create_certificates(curve_dir, CURVE_CERT)


class Security:
    """One deployment secret: a CurveZMQ cluster certificate or an HMAC key (or none)."""

    def __init__(self, cfg: ServeConfig) -> None:
        self.curve: tuple[bytes, bytes] | None = None
        self.hmac_key: bytes | None = None
        self.max_bytes = cfg.max_message_bytes
        if cfg.curve_dir:
            f = Path(cfg.curve_dir) / f"{CURVE_CERT}.key_secret"
            if not f.is_file():
                raise ConfigError(f"--zmq-curve-dir {cfg.curve_dir} has no {f.name}")
            public, secret = zmq.auth.load_certificate(f)
            self.curve = (public, secret)
            _start_authenticator(cfg.curve_dir)
        if cfg.hmac_key_file:
            f = Path(cfg.hmac_key_file)
            if not f.is_file():
                raise ConfigError(f"--zmq-hmac-key-file {f} does not exist")
            key = f.read_bytes().strip()
            if len(key) < 16:
                raise ConfigError("--zmq-hmac-key-file must hold at least 16 bytes of secret")
            self.hmac_key = key

    @property
    def enabled(self) -> bool:
        return self.curve is not None or self.hmac_key is not None

    def mac(self, frames: list) -> bytes:
        assert self.hmac_key is not None
        h = hmac.new(self.hmac_key, digestmod=hashlib.sha256)
        for f in frames:  # length-prefixed, so frame boundaries are authenticated too
            b = memoryview(f)
            h.update(b.nbytes.to_bytes(8, "little"))
            h.update(b)
        return h.digest()


def _start_authenticator(curve_dir: str) -> None:
    # ZAP: a CURVE server accepts only clients whose public key is in curve_dir.
    global _auth
    if _auth is None:
        _auth = ThreadAuthenticator(zmq.Context.instance())
        _auth.start()
        _auth.configure_curve(domain="*", location=curve_dir)


def _socket(kind: int, sec: Security) -> zmq.Socket:
    sock = zmq.Context.instance().socket(kind)
    sock.linger = 0
    if kind == zmq.PULL:
        sock.setsockopt(zmq.MAXMSGSIZE, sec.max_bytes)
    else:
        # Queue only on live connections: a message never waits for a restarted peer.
        sock.setsockopt(zmq.IMMEDIATE, 1)
    return sock


class Sender:
    def __init__(self, addr: str, sec: Security) -> None:
        self.addr = addr
        self.sec = sec
        self.sock = _socket(zmq.PUSH, sec)
        if sec.curve is not None:
            self.sock.curve_serverkey = sec.curve[0]
            self.sock.curve_publickey, self.sock.curve_secretkey = sec.curve
        self.sock.connect(addr)

    @property
    def connected(self) -> bool:
        """A send would be queued now: with IMMEDIATE, only once the connection to the peer is up
        (ZMQ connects asynchronously and retries every 100 ms, so a peer that just bound and said
        hello may not be reachable yet)."""
        return bool(self.sock.poll(0, zmq.POLLOUT))

    def send(self, frames: list) -> bool:
        if self.sec.hmac_key is not None:
            frames = [self.sec.mac(frames), *frames]
        try:
            self.sock.send_multipart(frames, flags=zmq.NOBLOCK, copy=False)
            return True
        except zmq.Again:
            return False

    def close(self) -> None:
        self.sock.close()


class Receiver:
    def __init__(self, addr: str, sec: Security) -> None:
        if not sec.enabled and not is_loopback_addr(addr):
            raise ConfigError(
                f"refusing to bind {addr} without --zmq-curve-dir or --zmq-hmac-key-file"
            )
        self.sec = sec
        self.sock = _socket(zmq.PULL, sec)
        if sec.curve is not None:
            self.sock.curve_server = True
            self.sock.curve_publickey, self.sock.curve_secretkey = sec.curve
        self.sock.bind(addr)
        self.rejected = 0  # messages dropped for a bad or missing MAC

    def recv(self, timeout_ms: int) -> list[memoryview] | None:
        """One authenticated message, or None when none arrived within the timeout."""
        while self.sock.poll(timeout_ms):
            frames = [memoryview(f) for f in self.sock.recv_multipart(copy=False)]
            if self.sec.hmac_key is None:
                return frames
            if len(frames) > 1 and hmac.compare_digest(bytes(frames[0]), self.sec.mac(frames[1:])):
                return frames[1:]
            self.rejected += 1
            log.warning("dropped a message with a bad or missing HMAC")
            timeout_ms = 0
        return None

    def close(self) -> None:
        self.sock.close()
