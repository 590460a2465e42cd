"""Transport over inproc://: delivery, non-blocking sends to absent peers, HMAC, bind policy."""

from __future__ import annotations

import itertools
import time
from pathlib import Path

import pytest

from dspark_sglang.config import ConfigError, ServeConfig, is_loopback_addr
from dspark_sglang.serve import messages as m
from dspark_sglang.serve.transport import Receiver, Security, Sender

_n = itertools.count()


def addr() -> str:
    return f"inproc://t{next(_n)}"


def test_push_pull_round_trip_with_raw_frames() -> None:
    a, sec = addr(), Security(ServeConfig())
    rx = Receiver(a, sec)
    tx = Sender(a, sec)
    assert tx.send([*m.encode(m.Abort(5)), b"\x01\x02"])
    frames = rx.recv(1000)
    assert frames is not None and bytes(frames[1]) == b"\x01\x02"
    assert rx.recv(0) is None
    tx.close()
    rx.close()


def test_send_to_an_absent_peer_does_not_block(tmp_path: Path) -> None:
    # ipc, not inproc: inproc queues for a peer that has not bound yet.
    a, sec = f"ipc://{tmp_path}/s", Security(ServeConfig())
    tx = Sender(a, sec)
    assert not tx.send(m.encode(m.Abort(1)))
    rx = Receiver(a, sec)
    deadline = time.monotonic() + 5
    while not tx.send(m.encode(m.Abort(2))):
        assert time.monotonic() < deadline
        time.sleep(0.01)
    assert m.decode(rx.recv(1000))[0] == m.Abort(2)  # nothing queued from before the bind
    tx.close()
    rx.close()


def test_connected_turns_true_only_once_the_peer_is_reachable(tmp_path: Path) -> None:
    a, sec = f"ipc://{tmp_path}/c", Security(ServeConfig())
    tx = Sender(a, sec)
    assert not tx.connected
    rx = Receiver(a, sec)
    deadline = time.monotonic() + 5
    while not tx.connected:
        assert time.monotonic() < deadline
        time.sleep(0.005)
    assert tx.send(m.encode(m.Abort(3)))  # connected means the next send is taken
    assert m.decode(rx.recv(1000))[0] == m.Abort(3)
    tx.close()
    rx.close()


def _hmac(tmp_path: Path, secret: str) -> Security:
    f = tmp_path / f"{secret}.key"
    f.write_text(secret)
    return Security(ServeConfig(hmac_key_file=str(f)))


def test_hmac_accepts_the_secret_and_drops_everything_else(tmp_path: Path) -> None:
    a = addr()
    good = _hmac(tmp_path, "correct-horse-battery")
    rx = Receiver(a, good)
    plain = Sender(a, Security(ServeConfig()))
    wrong = Sender(a, _hmac(tmp_path, "another-long-secret"))
    right = Sender(a, good)
    assert plain.send(m.encode(m.Abort(1))) and wrong.send(m.encode(m.Abort(2)))
    assert right.send(m.encode(m.Abort(3)))
    frames = rx.recv(1000)
    assert frames is not None and m.decode(frames)[0] == m.Abort(3)
    assert rx.rejected == 2
    for s in (plain, wrong, right, rx):
        s.close()


def test_short_or_missing_hmac_key_is_a_config_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="16 bytes"):
        _hmac(tmp_path, "short")
    with pytest.raises(ConfigError, match="does not exist"):
        Security(ServeConfig(hmac_key_file=str(tmp_path / "none")))


def test_offhost_addresses_need_a_secret() -> None:
    assert is_loopback_addr("tcp://127.0.0.1:5") and is_loopback_addr("ipc:///tmp/x")
    assert is_loopback_addr("tcp://[::1]:5") and not is_loopback_addr("tcp://0.0.0.0:5")
    assert not is_loopback_addr("tcp://*:5") and not is_loopback_addr("tcp://10.0.0.2:5")
    with pytest.raises(ConfigError, match="--zmq-curve-dir or --zmq-hmac-key-file"):
        ServeConfig(decode_addrs=("tcp://10.0.0.2:30102",))
    # The transport refuses on its own too, whatever built the config.
    with pytest.raises(ConfigError, match="refusing to bind"):
        Receiver("tcp://0.0.0.0:0", Security(ServeConfig()))


def test_serve_config_validation() -> None:
    with pytest.raises(ConfigError, match="distinct"):
        ServeConfig(prefill_addrs=("tcp://127.0.0.1:1",), decode_addrs=("tcp://127.0.0.1:1",))
    with pytest.raises(ConfigError, match="heartbeat"):
        ServeConfig(heartbeat_interval_s=5, heartbeat_timeout_s=1)
    with pytest.raises(ConfigError, match="tcp://"):
        ServeConfig(api_addr="udp://x")
