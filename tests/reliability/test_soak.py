"""Overload and soak: 2,000 requests at concurrency 32 then 64 against an in-flight cap of 48,
with random cancellations and mid-stream disconnects.

Every request is accounted for by the client (completed, cancelled, or errored; none lost, none
answered twice) and by the server (its per-outcome counters add up to what it admitted); 429s
carry Retry-After; RSS and KV usage return to their baseline afterwards.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections import Counter
from dataclasses import dataclass

import httpx
import pytest

from tests.integration.conftest import Cluster
from tests.reliability.conftest import FRONT_MAX_PENDING, alive, quiet_kv, rss_mb, wait_kv_back

pytestmark = pytest.mark.timeout(420)
TOTAL = 2000
PHASES = ((32, TOTAL // 2), (64, TOTAL - TOTAL // 2))  # (concurrency, requests)
WARMUP = 200
CLIENT_TIMEOUT_S = 60.0  # no answer by then = a lost request
MAX_429_RETRIES = 8
RSS_GROWTH_MB = 48  # per process, soak vs warm baseline
OUTCOMES = ("stop", "length", "error", "timeout", "disconnected")


@dataclass(frozen=True)
class Spec:
    i: int
    body: dict
    cancel_after: int | None  # stream: events read before leaving; blocking: ms before leaving


def specs(rng: random.Random, n: int, base: int = 0) -> list[Spec]:
    out = []
    for i in range(base, base + n):
        stream = rng.random() < 0.5
        body = {
            "prompt": "".join(rng.choice("abcdefgh ijk") for _ in range(rng.randint(1, 40))),
            "max_tokens": rng.randint(1, 8),
            "ignore_eos": True,
            "temperature": rng.choice([0.0, 0.7, 1.0]),
            "stream": stream,
        }
        if stream:
            body["stream_options"] = {"include_usage": True}
        fate = rng.random()
        cancel = None
        if fate < 0.1:  # cancelled: the client gives up early
            cancel = rng.randint(0, 2) if stream else rng.randint(1, 60)
        elif fate < 0.2 and stream:  # disconnect mid-stream
            cancel = rng.randint(1, 3)
        out.append(Spec(i, body, cancel))
    return out


class Ledger:
    def __init__(self) -> None:
        self.outcome: dict[int, str] = {}  # request index -> completed | cancelled | error:...
        self.ids: Counter[str] = Counter()  # response ids: each must appear once
        self.rejections = 0  # 429 answers (retried after Retry-After)
        self.retry_after: Counter[str] = Counter()

    def end(self, spec: Spec, outcome: str) -> None:
        assert spec.i not in self.outcome, f"request {spec.i} ended twice"
        self.outcome[spec.i] = outcome


async def run_one(client: httpx.AsyncClient, spec: Spec, led: Ledger) -> None:
    for _ in range(MAX_429_RETRIES + 1):
        try:
            if spec.body["stream"]:
                done = await _stream(client, spec, led)
            else:
                done = await _blocking(client, spec, led)
        except (httpx.TimeoutException, TimeoutError):
            return led.end(spec, "lost")
        except httpx.TransportError as e:  # the connection broke under the request
            kind = "stream" if spec.body["stream"] else "blocking"
            return led.end(spec, f"error:{type(e).__name__} ({kind}, cancel={spec.cancel_after})")
        if done:
            return
    led.end(spec, "error:429 after retries")


async def _blocking(client: httpx.AsyncClient, spec: Spec, led: Ledger) -> bool:
    req = client.post("/v1/completions", json=spec.body)
    if spec.cancel_after is not None:
        try:
            r = await asyncio.wait_for(req, spec.cancel_after / 1000)
        except TimeoutError:
            led.end(spec, "cancelled")
            return True
    else:
        r = await asyncio.wait_for(req, CLIENT_TIMEOUT_S)
    return await _answer(r, spec, led, r.json() if r.status_code != 429 else None)


async def _answer(r: httpx.Response, spec: Spec, led: Ledger, body: dict | None) -> bool:
    if r.status_code == 429:
        led.rejections += 1
        led.retry_after[r.headers.get("retry-after", "missing")] += 1
        await asyncio.sleep(int(r.headers.get("retry-after", "1")))
        return False
    if r.status_code != 200:
        led.end(spec, f"error:{r.status_code} {body['error']['message'][:50]}")
        return True
    assert body is not None
    assert body["usage"]["completion_tokens"] == spec.body["max_tokens"], body
    assert body["choices"][0]["finish_reason"] == "length", body
    led.ids[body["id"]] += 1
    led.end(spec, "completed")
    return True


async def _stream(client: httpx.AsyncClient, spec: Spec, led: Ledger) -> bool:
    async with asyncio.timeout(CLIENT_TIMEOUT_S):
        async with client.stream("POST", "/v1/completions", json=spec.body) as r:
            if r.status_code != 200:
                await r.aread()
                return await _answer(r, spec, led, r.json())
            if spec.cancel_after == 0:  # gone as soon as the headers arrive
                led.end(spec, "cancelled")
                return True
            events, finals, usage, ids, done = 0, 0, None, set(), False
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                if line == "data: [DONE]":
                    done = True
                    continue
                assert not done, "data after [DONE]"
                ev = json.loads(line[6:])
                if "error" in ev:
                    led.end(spec, f"error:stream {ev['error']['message'][:50]}")
                    return True
                ids.add(ev["id"])
                if ev["choices"] and ev["choices"][0]["finish_reason"]:
                    finals += 1
                if ev.get("usage"):
                    usage = ev["usage"]
                events += 1
                if spec.cancel_after is not None and events >= spec.cancel_after:
                    led.end(spec, "cancelled")  # leaving the block closes the connection
                    return True
    assert done and finals == 1 and len(ids) == 1, (done, finals, ids)
    assert usage is not None and usage["completion_tokens"] == spec.body["max_tokens"], usage
    led.ids[ids.pop()] += 1
    led.end(spec, "completed")
    return True


async def drive(url: str, work: list[Spec], concurrency: int, led: Ledger) -> None:
    queue: asyncio.Queue[Spec] = asyncio.Queue()
    for s in work:
        queue.put_nowait(s)

    async def client_loop(client: httpx.AsyncClient) -> None:
        while not queue.empty():
            await run_one(client, queue.get_nowait(), led)

    # Reuse idle connections for 2 s only: uvicorn closes them after 5 s, and a POST sent on a
    # connection the server is closing fails with no answer (HTTP/1.1's keep-alive race).
    limits = httpx.Limits(
        max_connections=concurrency, max_keepalive_connections=concurrency, keepalive_expiry=2.0
    )
    timeout = httpx.Timeout(CLIENT_TIMEOUT_S)
    async with httpx.AsyncClient(base_url=url, limits=limits, timeout=timeout) as client:
        await asyncio.gather(*(client_loop(client) for _ in range(concurrency)))


def server_counts(c: Cluster) -> dict[str, float]:
    mt = c.metrics()
    out = {o: mt.get(f'dspark_requests_total{{outcome="{o}"}}', 0.0) for o in OUTCOMES}
    out["dispatched"] = mt.get('dspark_worker_requests_total{worker="prefill0"}', 0.0)
    out["retries"] = mt.get("dspark_retries_total", 0.0)
    return out


def test_soak_2000_requests_with_cancellations(front: Cluster) -> None:
    rng = random.Random(2024)
    workers = ("prefill0", "decode0")
    base_kv = quiet_kv(front, workers)  # (blocks an earlier test leaked are not this one's)
    warm = Ledger()
    asyncio.run(drive(front.url, specs(rng, WARMUP, base=-WARMUP), 32, warm))
    wait_kv_back(front, workers, base_kv)
    base_rss = {n: rss_mb(p.pid) for n, p in front.procs.items()}
    before = server_counts(front)

    led = Ledger()
    t0 = time.monotonic()
    work = specs(rng, TOTAL)
    for concurrency, n in PHASES:
        asyncio.run(drive(front.url, work[:n], concurrency, led))
        work = work[n:]
    took = time.monotonic() - t0
    settle = wait_kv_back(front, workers, base_kv)
    after = server_counts(front)
    rss = {n: round(rss_mb(p.pid) - base_rss[n], 1) for n, p in front.procs.items()}

    kinds = Counter(led.outcome.values())
    delta = {k: after[k] - before[k] for k in after}
    admitted = delta["dispatched"] - delta["retries"]
    ended = sum(delta[o] for o in OUTCOMES)
    print(
        f"[reliability] soak: requests={TOTAL} in {took:.1f}s ({TOTAL / took:.0f} req/s), "
        f"client outcomes={dict(kinds)}, 429s={led.rejections} "
        f"retry_after={dict(led.retry_after)}, server={ {k: int(v) for k, v in delta.items()} }, "
        f"kv_full_after={settle:.2f}s, rss_growth_mb={rss}"
    )
    # Client side: every request ended exactly once, none lost, no response id twice.
    assert len(led.outcome) == TOTAL and kinds["lost"] == 0, kinds
    assert all(n == 1 for n in led.ids.values())
    assert sum(v for k, v in kinds.items() if k.startswith("error")) == 0, kinds
    assert led.rejections > 0 and set(led.retry_after) == {"1"}, led.retry_after
    # Server side: what it admitted, it ended once, with an outcome the client can explain.
    assert ended == admitted, (ended, admitted, delta)
    completed = delta["stop"] + delta["length"]
    assert kinds["completed"] <= completed <= kinds["completed"] + kinds["cancelled"], delta
    assert delta["disconnected"] <= kinds["cancelled"] and delta["error"] == delta["timeout"] == 0
    # Back to baseline.
    assert all(alive(front).values())
    assert max(rss.values()) < RSS_GROWTH_MB, rss
    assert front.metrics()["dspark_inflight_requests"] == 0
    assert max(c for c, _ in PHASES) > FRONT_MAX_PENDING
