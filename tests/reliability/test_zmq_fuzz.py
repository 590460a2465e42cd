"""Bad input over ZMQ: a rogue local peer pushes truncated frames, wrong versions and tags,
oversized or inconsistent tensors, semantically bad handoffs and random bytes into every inbox.
Each message is dropped and logged, every process stays up and keeps serving, memory stays flat.
In multi-host mode (HMAC) unsigned or wrongly signed messages never reach a handler.
"""

from __future__ import annotations

import random
import re
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import msgspec
import pytest
import torch
import zmq

from dspark_sglang.config import ServeConfig
from dspark_sglang.serve import messages as m
from dspark_sglang.serve.transport import Security, Sender
from dspark_sglang.types import SamplingParams
from tests.integration.conftest import Cluster
from tests.reliability.conftest import API_KEY, alive, quiet_kv, rss_mb, wait_kv_back

pytestmark = pytest.mark.timeout(300)
WORKERS = ("prefill0", "decode0")
RANDOM_MESSAGES = 1500  # random / bit-flipped messages per round (2 rounds)
BIG_MESSAGES = 4  # oversized-tensor handoffs per round, BIG_TENSOR_BYTES each
BIG_TENSOR_BYTES = 64 << 20
# Bound on RSS growth over both rounds (0.5 GiB of big frames + 3,000 random messages): under
# 1.5 big frames, so one retained frame per message (+512 MB) or per round fails it. Allocator
# steps of ~21 MB per round that later shrink were seen; smaller per-message leaks are below
# this resolution.
RSS_GROWTH_MB = 96
SP = SamplingParams(max_tokens=4)
VOCAB, LAYERS, KV_HEADS, HEAD_DIM, HIDDEN = 128, 3, 2, 16, 64  # tests/conftest.py's model


def frames_of(tensors: list[torch.Tensor]) -> tuple[list[m.TensorMeta], list[bytes]]:
    metas = [m.TensorMeta(str(t.dtype).removeprefix("torch."), tuple(t.shape)) for t in tensors]
    return metas, [t.contiguous().view(torch.uint8).numpy().tobytes() for t in tensors]


def handoff(
    uid: int,
    n: int = 3,
    prompt: list[int] | None = None,
    first: int = 5,
    kv: torch.Tensor | None = None,
    rng: torch.Tensor | None = None,
    ctx: torch.Tensor | None = None,
    params: SamplingParams = SP,
) -> list[bytes]:
    """A Handoff for the test model, well-formed unless an argument says otherwise."""
    tensors = [
        torch.zeros(LAYERS, 2, n, KV_HEADS, HEAD_DIM) if kv is None else kv,
        torch.Generator().get_state() if rng is None else rng,
        torch.zeros(n, HIDDEN) if ctx is None else ctx,
    ]
    metas, bufs = frames_of(tensors)
    ids = [1] * n if prompt is None else prompt
    return [*m.encode(m.Handoff(uid, ids, first, "x", params, metas)), *bufs]


def raw(obj: object) -> list[bytes]:
    return [msgspec.msgpack.encode(obj)]


HAND = dict(  # a Handshake as plain data, from a future protocol version
    version=99,
    model_id="x",
    num_layers=1,
    num_kv_heads=1,
    head_dim=1,
    page_size=1,
    dtype="x",
    draft_taps=[],
    draft_hidden=0,
    gamma=0,
)
REQUEST = m.encode(m.Request(7, [1, 2, 3], SP, 0))[0]

# (name, inbox, frames): every one must be dropped or answered with an error, never crash.
CATALOG: list[tuple[str, str, Callable[[], list[bytes]]]] = [
    ("empty frame", "p0", lambda: [b""]),
    ("truncated header", "p0", lambda: [REQUEST[: len(REQUEST) // 2]]),
    ("header of the wrong type", "d0", lambda: raw(12345)),
    ("unknown tag", "d0", lambda: raw({"type": "Request2", "uid": 1})),
    ("missing fields", "p0", lambda: raw({"type": "Request", "uid": 1})),
    ("wrong field types", "p0", lambda: raw({**_req(), "prompt_ids": "abc"})),
    ("uid of 2**64 - 1", "p0", lambda: raw({**_req(), "uid": 2**64 - 1})),
    ("invalid params", "p0", lambda: raw({**_req(), "params": {"max_tokens": 0}})),
    ("top_k over int64", "p0", lambda: raw({**_req(), "params": {"top_k": 2**63}})),
    ("top_k over int64 in a handoff", "d0", lambda: handoff(9, params=_sp(top_k=2**63))),
    ("empty prompt request", "p0", lambda: raw({**_req(), "prompt_ids": []})),
    ("prompt ids out of vocab", "p0", lambda: raw({**_req(), "prompt_ids": [VOCAB, -1]})),
    ("prompt over the context", "p0", lambda: raw({**_req(), "prompt_ids": [1] * 5000})),
    ("unknown decode index", "p0", lambda: raw({**_req(), "decode": 7})),
    ("frames missing", "d0", lambda: handoff(10)[:2]),
    ("extra frames", "p0", lambda: [REQUEST, b"x", b"y"]),
    ("5000 frames", "d0", lambda: [b"x"] * 5000),
    ("tensor frame of the wrong size", "d0", lambda: [*handoff(11)[:3], b"x"]),
    ("unknown dtype", "d0", lambda: _bad_meta(m.TensorMeta("complex128", (1,)))),
    ("negative shape", "d0", lambda: _bad_meta(m.TensorMeta("float32", (-1, 4)))),
    ("shape of 2**40 elements", "d0", lambda: _bad_meta(m.TensorMeta("float32", (1 << 40,)))),
    ("no tensors", "d0", lambda: m.encode(m.Handoff(12, [1], 1, "", SP, []))),
    ("kv of the wrong shape", "d0", lambda: handoff(13, kv=torch.zeros(LAYERS, 2, 5, 2, 16))),
    ("kv of an int dtype", "d0", lambda: handoff(14, kv=torch.zeros(3, 2, 3, 2, 16).long())),
    ("rng state of the wrong size", "d0", lambda: handoff(15, rng=torch.zeros(7).byte())),
    ("first token over the vocab", "d0", lambda: handoff(16, first=10**6)),
    ("negative first token", "d0", lambda: handoff(17, first=-3)),
    ("prompt ids over the vocab", "d0", lambda: handoff(18, prompt=[VOCAB, 1, 1])),
    ("empty prompt handoff", "d0", lambda: _empty_handoff(19)),
    ("heartbeat of a future version", "api", lambda: raw(_beat("decode9", HAND))),
    ("heartbeat with a bad handshake", "api", lambda: raw(_beat("decode0", {"version": 1}))),
    ("deltas for unknown uids", "api", lambda: m.encode(m.Deltas("decode0", [_delta()]))),
    ("deltas from an unknown worker", "api", lambda: m.encode(m.Deltas("x", [_delta()]))),
    ("abort of an unknown uid", "d0", lambda: m.encode(m.Abort(2**63))),
    ("abort of an unknown uid", "p0", lambda: m.encode(m.Abort(0))),
]


def _req() -> dict:
    return {"type": "Request", "uid": 1, "prompt_ids": [1, 2], "params": {}, "decode": 0}


def _sp(**kw: object) -> SamplingParams:
    # Bypass __post_init__: the point is a value a checked constructor would not build.
    sp = SamplingParams(max_tokens=3)
    for k, v in kw.items():
        object.__setattr__(sp, k, v)
    return sp


def _bad_meta(meta: m.TensorMeta) -> list[bytes]:
    return [*m.encode(m.Handoff(20, [1], 1, "", SP, [meta])), b"\0" * 16]


def _empty_handoff(uid: int) -> list[bytes]:
    metas, bufs = frames_of([torch.Generator().get_state()])
    empty = m.TensorMeta("float32", (LAYERS, 2, 0, KV_HEADS, HEAD_DIM))
    ctx = m.TensorMeta("float32", (0, HIDDEN))
    return [*m.encode(m.Handoff(uid, [], 1, "", SP, [empty, *metas, ctx])), b"", *bufs, b""]


def _beat(worker: str, hand: dict) -> dict:
    return {
        "type": "Heartbeat",
        "worker": worker,
        "boot": 1,
        "hand": hand,
        "running": 0,
        "waiting": 0,
        "free_blocks": 0,
        "total_blocks": 0,
    }


def _delta() -> m.Delta:
    return m.Delta(random.getrandbits(63), [1], "x", finished=random.random() < 0.5)


def random_messages(rng: random.Random, n: int) -> Iterator[list[bytes]]:
    """Random bytes, and valid messages with bytes flipped, cut or appended."""
    seeds = [REQUEST, *handoff(30), *m.encode(m.Abort(5)), *m.encode(m.Deltas("d", [_delta()]))]
    for _ in range(n):
        if rng.random() < 0.4:
            yield [rng.randbytes(rng.randint(0, 300)) for _ in range(rng.randint(1, 4))]
            continue
        b = bytearray(rng.choice(seeds)[:4096])
        for _ in range(rng.randint(1, 4)):
            i = rng.randrange(len(b)) if b else 0
            op = rng.random()
            if op < 0.5 and b:
                b[i] = rng.randrange(256)
            elif op < 0.75:
                del b[i:]
            else:
                b[i:i] = rng.randbytes(rng.randint(1, 8))
        yield [bytes(b)]


@pytest.fixture(scope="module")
def rogue(front: Cluster) -> Iterator[Callable[[str, list[bytes]], None]]:
    """send(inbox, frames) from an unauthenticated local PUSH socket per inbox."""
    socks: dict[str, zmq.Socket] = {}

    def send(inbox: str, frames: list[bytes]) -> None:
        if inbox not in socks:
            socks[inbox] = zmq.Context.instance().socket(zmq.PUSH)
            socks[inbox].linger = 0
            socks[inbox].connect(f"ipc://{front.dir}/{inbox}")
            time.sleep(0.2)  # let the connection complete: PUSH drops nothing once connected
        socks[inbox].send_multipart(frames)

    yield send
    for s in socks.values():
        s.close()


def served(c: Cluster, headers: dict[str, str] | None = None) -> bool:
    r = httpx.post(
        f"{c.url}/v1/completions",
        json={"prompt": "still there?", "max_tokens": 4},
        headers=headers,
        timeout=30,
    )
    return r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4


def worker_rss(c: Cluster) -> dict[str, float]:
    return {n: rss_mb(p.pid) for n, p in c.procs.items()}


def count(c: Cluster, name: str, pattern: str) -> int:
    return len(re.findall(pattern, c.logs[name].read_text()))


def test_catalog_of_bad_messages(front: Cluster, rogue: Callable) -> None:
    base_kv = quiet_kv(front, WORKERS)
    before = {n: count(front, n, "WARNING") for n in ("prefill0", "decode0", "router")}
    for name, inbox, make in CATALOG:
        rogue(inbox, make())
        time.sleep(0.05)
        died = f"a process died at {name!r} (or just before):\n{front.all_logs()}"
        assert all(alive(front).values()), died
    time.sleep(1.0)
    assert all(alive(front).values()), front.all_logs()
    assert served(front)
    after = {n: count(front, n, "WARNING") for n in before}
    # Every dropped message is logged (the rest were answered with an error the router ignored).
    assert after["decode0"] - before["decode0"] >= 15, front.log("decode0")
    assert after["prefill0"] - before["prefill0"] >= 6, front.log("prefill0")
    assert after["router"] - before["router"] >= 2, front.log("router")
    assert httpx.get(f"{front.url}/ready").json()["workers"] == {
        "prefill0": "up",
        "decode0": "up",
    }
    wait_kv_back(front, WORKERS, base_kv)


def test_replayed_request_is_dropped(front: Cluster, rogue: Callable) -> None:
    """HMAC does not stop replays: the same Request twice while the first is still queued."""
    before = count(front, "prefill0", "dropped a duplicate request")
    replay = raw({**_req(), "uid": 99, "prompt_ids": [1] * 40})
    for _ in range(3):
        rogue("p0", replay)
    time.sleep(1.0)
    assert all(alive(front).values()), front.all_logs()
    assert count(front, "prefill0", "dropped a duplicate request") > before
    assert served(front)


def test_random_bytes_and_big_tensors_keep_memory_flat(front: Cluster, rogue: Callable) -> None:
    """Two identical rounds of random / damaged messages and 64 MiB handoffs whose frames match
    their header but not the model: every process stays up, RSS stays within RSS_GROWTH_MB."""
    served(front)  # warm: first-request allocations are not a leak
    base_kv = quiet_kv(front, WORKERS)
    n = BIG_TENSOR_BYTES // (LAYERS * 2 * KV_HEADS * HEAD_DIM * 4)  # tokens of a 64 MiB KV
    big = handoff(40, n=n, prompt=[1] * n)
    rss = [worker_rss(front)]
    for seed in (1, 1):
        for i, frames in enumerate(random_messages(random.Random(seed), RANDOM_MESSAGES)):
            rogue(("p0", "d0", "api")[i % 3], frames)
        for _ in range(BIG_MESSAGES):
            rogue("d0", big)
        time.sleep(1.5)
        assert all(alive(front).values()), front.all_logs()
        assert served(front)
        rss.append(worker_rss(front))
    grow = lambda a, b: {k: round(b[k] - a[k], 1) for k in a}
    first, second = grow(rss[0], rss[1]), grow(rss[1], rss[2])
    print(f"[reliability] rogue ZMQ memory (MB): round 1 {first}, round 2 {second}")
    assert max(grow(rss[0], rss[2]).values()) < RSS_GROWTH_MB, (first, second)
    wait_kv_back(front, WORKERS, base_kv)


def test_multi_host_mode_refuses_unsigned_and_wrongly_signed_peers(
    secure: Cluster, tmp_path: Path
) -> None:
    """HMAC cluster on tcp://0.0.0.0: a Refuse would stop a worker and an impersonating
    heartbeat would fail decode0's requests, if either got through."""
    inboxes: dict[str, str] = secure.inboxes  # type: ignore[attr-defined]
    wrong = tmp_path / "wrong.key"
    wrong.write_text("not-the-cluster-secret-0123456789")
    forged = Security(ServeConfig(hmac_key_file=str(wrong)))
    beat = raw(_beat("decode0", HAND))
    per_inbox = {
        "router": [beat, m.encode(m.Deltas("decode0", [_delta()]))],
        "prefill0": [m.encode(m.Refuse("rogue")), [REQUEST]],
        "decode0": [m.encode(m.Refuse("rogue")), handoff(50)],
    }
    key = {"Authorization": f"Bearer {API_KEY}"}
    sent = 0
    for name, msgs in per_inbox.items():
        plain = zmq.Context.instance().socket(zmq.PUSH)
        plain.linger = 0
        plain.connect(inboxes[name])
        signed = Sender(inboxes[name], forged)
        time.sleep(0.3)
        for frames in msgs:
            for _ in range(5):
                plain.send_multipart(frames)
                assert signed.send(frames)
                sent += 2
        for frames in random_messages(random.Random(3), 200):
            plain.send_multipart(frames)
        time.sleep(0.5)  # linger is 0: let the queues drain before closing
        plain.close()
        signed.close()
    time.sleep(1.5)
    assert all(alive(secure).values()), secure.all_logs()
    assert served(secure, key)
    assert httpx.get(f"{secure.url}/ready", headers=key).json()["workers"] == {
        "prefill0": "up",
        "decode0": "up",
    }
    for name in ("prefill0", "decode0"):
        assert count(secure, name, "bad or missing HMAC") >= 20, secure.log(name)
    metrics = httpx.get(f"{secure.url}/metrics", headers=key).text
    rejected = float(re.search(r"^dspark_rejected_messages (\S+)", metrics, re.M).group(1))
    assert rejected >= 20 + 200, metrics
