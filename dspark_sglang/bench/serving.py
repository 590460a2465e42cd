"""`python -m dspark_sglang.bench.serving`: OpenAI-API load generator (sglang.bench_serving keys).

Poisson / gamma / constant / closed-loop / trace-replay arrivals; TTFT, TPOT, ITL, E2E, goodput,
per-user tok/s and the server's DSpark signals (accept length, per-position acceptance, budget).
"""

from __future__ import annotations

import argparse
import asyncio
import bisect
import contextlib
import json
import math
import os
import random
import shlex
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx
import numpy as np

from dspark_sglang.assets import ASSETS_DIR

HELDOUT_PROMPTS = ASSETS_DIR / "heldout_prompts.jsonl"  # same file as dspark_sglang.eval's
BACKENDS = {  # sglang.bench_serving / vllm bench serve names -> our two OpenAI routes
    "oai": "completions",
    "oai-chat": "chat",
    "sglang-oai": "completions",
    "sglang-oai-chat": "chat",
    "vllm": "completions",
    "vllm-chat": "chat",
    "openai": "completions",
    "openai-chat": "chat",
}
DATASETS = ("heldout", "custom", "random", "mooncake")
ARRIVALS = ("poisson", "gamma", "constant")
SLO_KEYS = ("ttft", "tpot", "itl", "e2el")
PERCENTILES = (50, 90, 95, 99)
LATENCIES = ("ttft", "tpot", "itl", "e2e_latency")


# -- workload --------------------------------------------------------------------------------
@dataclass(frozen=True)
class Prompt:
    """One request: text (or token ids, sent as-is to /v1/completions) and its output length."""

    prompt: str | list[int]
    output_len: int
    prompt_len: int | None = None  # known for token-id prompts; else read from `usage`
    timestamp: float | None = None  # trace replay: seconds since the first trace row


def _read_jsonl(path: Path) -> list[dict[str, Any]]:
    if not path.is_file():
        raise SystemExit(f"error: --dataset-path {path} does not exist")
    rows = []
    for i, line in enumerate(path.read_text().splitlines(), 1):
        if line.strip():
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError:
                raise SystemExit(f"error: {path}:{i} is not JSON") from None
    if not rows:
        raise SystemExit(f"error: {path} holds no rows")
    return rows


def text_prompts(path: Path, output_len: int) -> list[Prompt]:
    """jsonl rows {"turns": [...]} (first turn), {"prompt": ...} or {"text": ...}."""
    out = []
    for i, row in enumerate(_read_jsonl(path), 1):
        if row.get("turns"):
            text = row["turns"][0]
        elif "prompt" in row or "text" in row:
            text = row.get("prompt", row.get("text"))
        else:
            raise SystemExit(f"error: {path}:{i} has no 'turns', 'prompt' or 'text'")
        out.append(Prompt(str(text), output_len))
    return out


def random_lengths(rng: np.random.Generator, n: int, length: int, ratio: float) -> np.ndarray:
    """sglang.bench_serving's rule: uniform integers in [max(1, length·ratio), length]."""
    return rng.integers(max(int(length * ratio), 1), length + 1, size=n)


def random_prompts(
    rng: np.random.Generator,
    n: int,
    input_len: int,
    output_len: int,
    ratio: float,
    token_range: tuple[int, int],
) -> list[Prompt]:
    ins = random_lengths(rng, n, input_len, ratio)
    outs = random_lengths(rng, n, output_len, ratio)
    lo, hi = token_range
    return [
        Prompt(rng.integers(lo, hi, size=int(i)).tolist(), int(o), int(i))
        for i, o in zip(ins, outs, strict=True)
    ]


def trace_prompts(
    path: Path, token_range: tuple[int, int], block_size: int, seed: int
) -> list[Prompt]:
    """Mooncake-style trace rows {"timestamp" (ms), "input_length", "output_length", "hash_ids"}:
    each hash id is a fixed block of `block_size` token ids (shared ids = shared prefixes)."""
    rows = _read_jsonl(path)
    lo, hi = token_range
    blocks: dict[int, list[int]] = {}
    out = []
    t0 = min(float(r.get("timestamp", 0.0)) for r in rows)
    for i, r in enumerate(rows, 1):
        try:
            n_in, n_out = int(r["input_length"]), int(r["output_length"])
        except (KeyError, TypeError, ValueError):
            raise SystemExit(f"error: {path}:{i} needs input_length and output_length") from None
        ids: list[int] = []
        for h in r.get("hash_ids", []):
            if h not in blocks:
                g = np.random.default_rng([seed, int(h)])
                blocks[h] = g.integers(lo, hi, size=block_size).tolist()
            ids += blocks[h]
        if len(ids) < n_in:
            g = np.random.default_rng([seed, 1 << 40, i])
            ids += g.integers(lo, hi, size=n_in - len(ids)).tolist()
        ts = (float(r.get("timestamp", 0.0)) - t0) / 1000.0
        out.append(Prompt(ids[: max(n_in, 1)], max(n_out, 1), max(n_in, 1), ts))
    return out


def arrival_offsets(
    n: int,
    rate: float,
    process: str = "poisson",
    burstiness: float = 1.0,
    rng: np.random.Generator | None = None,
) -> np.ndarray:
    """Send times (s) of n requests, the first at 0. rate = inf sends all at once (closed loop
    under --max-concurrency). poisson: exponential gaps of mean 1/rate; gamma: shape =
    burstiness, scale = 1/(rate·burstiness) (vllm's --burstiness; 1 = Poisson, < 1 burstier);
    constant: gaps of exactly 1/rate."""
    if n <= 0:
        return np.zeros(0)
    if math.isinf(rate):
        return np.zeros(n)
    if rate <= 0:
        raise ValueError("request rate must be > 0")
    rng = rng or np.random.default_rng(0)
    if process == "constant":
        gaps = np.full(n - 1, 1.0 / rate)
    elif process == "poisson":
        gaps = rng.exponential(1.0 / rate, size=n - 1)
    elif process == "gamma":
        if burstiness <= 0:
            raise ValueError("burstiness must be > 0")
        gaps = rng.gamma(burstiness, 1.0 / (rate * burstiness), size=n - 1)
    else:
        raise ValueError(f"unknown arrival process {process!r}")
    return np.concatenate(([0.0], np.cumsum(gaps)))


# -- one request -----------------------------------------------------------------------------
@dataclass
class Outcome:
    """What one request measured; times in seconds (perf_counter based)."""

    success: bool = False
    error: str = ""
    prompt_len: int = 0
    output_len: int = 0
    start: float = 0.0  # send time, relative to the benchmark start
    ttft: float = 0.0
    latency: float = 0.0  # E2E
    itl: list[float] = field(default_factory=list)  # gaps between content chunks
    accept_length: float | None = None  # server's per-request accept length (dspark extension)
    spec_rounds: int = 0
    spec_accepted: int = 0
    text: str = ""
    # (seconds since the benchmark start, output tokens so far) per content chunk, from the
    # server's continuous usage; empty when it sends none
    token_times: list[tuple[float, int]] = field(default_factory=list)

    @property
    def tpot(self) -> float | None:
        """(E2E - TTFT) / (output tokens - 1), sglang.bench_serving's definition."""
        if self.output_len <= 1:
            return None
        return (self.latency - self.ttft) / (self.output_len - 1)

    @property
    def user_tps(self) -> float | None:
        """This user's decode speed: output tokens after the first per second."""
        t = self.tpot
        return 1.0 / t if t else None


def request_body(
    p: Prompt, model: str, chat: bool, stream: bool, args: argparse.Namespace
) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": model,
        "max_tokens": p.output_len,
        "temperature": args.temperature,
        "stream": stream,
    }
    if args.ignore_eos:
        body["ignore_eos"] = True
    if stream:
        body["stream_options"] = {"include_usage": True}
        if not args.no_continuous_usage:
            body["stream_options"]["continuous_usage_stats"] = True
    if chat:
        text = p.prompt if isinstance(p.prompt, str) else " ".join(map(str, p.prompt))
        body["messages"] = [{"role": "user", "content": text}]
    else:
        body["prompt"] = p.prompt
    body.update(args.extra_request_body or {})
    return body


def _content(choice: dict[str, Any], chat: bool) -> str:
    if chat:
        return (choice.get("delta") or choice.get("message") or {}).get("content") or ""
    return choice.get("text") or ""


def _take_extras(out: Outcome, obj: dict[str, Any]) -> None:
    usage = obj.get("usage")
    if usage:
        out.prompt_len = int(usage.get("prompt_tokens", out.prompt_len))
        out.output_len = int(usage.get("completion_tokens", out.output_len))
    ext = obj.get("dspark")
    if ext:
        out.accept_length = float(ext.get("accept_length", 1.0))
        out.spec_rounds = int(ext.get("spec_rounds", 0))
        out.spec_accepted = int(ext.get("spec_accepted", 0))


async def send_request(
    client: httpx.AsyncClient, url: str, body: dict[str, Any], chat: bool, t_bench: float
) -> Outcome:
    """POST one request; stream it when body["stream"], timing each content chunk."""
    out = Outcome(prompt_len=len(body["prompt"]) if isinstance(body.get("prompt"), list) else 0)
    t0 = time.perf_counter()
    out.start = t0 - t_bench
    try:
        if not body["stream"]:
            r = await client.post(url, json=body)
            out.latency = out.ttft = time.perf_counter() - t0
            obj = r.json()
            if r.status_code != 200:
                out.error = f"HTTP {r.status_code}: {obj.get('error', {}).get('message', obj)}"
                return out
            out.text = _content(obj["choices"][0], chat)
            _take_extras(out, obj)
            out.success = True
            return out
        last = None
        async with client.stream("POST", url, json=body) as r:
            if r.status_code != 200:
                raw = (await r.aread()).decode(errors="replace")
                out.error = f"HTTP {r.status_code}: {raw[:300]}"
                return out
            async for line in r.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                obj = json.loads(data)
                if "error" in obj:
                    out.error = str(obj["error"].get("message", obj["error"]))
                    return out
                now = time.perf_counter()
                for c in obj.get("choices") or ():
                    if _content(c, chat):
                        if last is None:
                            out.ttft = now - t0
                        else:
                            out.itl.append(now - last)
                        last = now
                        out.text += _content(c, chat)
                usage = obj.get("usage")
                if usage and obj.get("choices"):  # continuous usage: tokens so far
                    out.token_times.append((now - t_bench, int(usage.get("completion_tokens", 0))))
                _take_extras(out, obj)
        out.latency = time.perf_counter() - t0
        if last is None:  # nothing but an empty completion
            out.ttft = out.latency
        out.success = True
    except (httpx.HTTPError, json.JSONDecodeError, KeyError, ValueError) as e:
        out.error = f"{type(e).__name__}: {e}"
        out.latency = time.perf_counter() - t0
    return out


# -- server-side DSpark signals (/metrics) ---------------------------------------------------
def parse_metrics(text: str) -> dict[str, list[tuple[dict[str, str], float]]]:
    """Prometheus text -> {sample name: [(labels, value)]}."""
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, list[tuple[dict[str, str], float]]] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out.setdefault(s.name, []).append((dict(s.labels), float(s.value)))
    return out


def _decode_values(m: dict[str, list], name: str) -> list[float]:
    return [v for lab, v in m.get(name, []) if lab.get("worker", "").startswith("decode")]


# Heartbeats each decode worker must send after a moment before a scrape counts every step
# taken before it: one may have been built before the moment and arrive after it.
SETTLE_BEATS = 2
SETTLE_POLL_S, SETTLE_TIMEOUT_S = 0.05, 10.0
_SPEC = (
    "rounds",
    "committed_tokens",
    "verified_drafts",
    "accepted_drafts",
    "verify_tokens",
    "steps",
)


def _worker_counts(m: dict[str, list] | None) -> dict[str, dict[str, Any]]:
    """Each decode worker's speculation counters in a scrape (dspark_spec_*_total, with the
    heartbeat count and acceptance per position); {} from a server without them."""
    out: dict[str, dict[str, Any]] = {}
    if m is None:
        return out
    for lab, v in m.get("dspark_worker_heartbeats_total", []):
        if lab.get("worker", "").startswith("decode"):
            out[lab["worker"]] = {"beats": v, "boot": None, "at_risk": {}, "passed": {}}
    for lab, v in m.get("dspark_worker_boot", []):
        if lab.get("worker") in out:
            out[lab["worker"]]["boot"] = v
    for key in _SPEC:
        for lab, v in m.get(f"dspark_spec_{key}_total", []):
            if lab.get("worker") in out:
                out[lab["worker"]][key] = v
    for key in ("at_risk", "passed"):
        for lab, v in m.get(f"dspark_spec_{key}_total", []):
            if lab.get("worker") in out:
                out[lab["worker"]][key][int(lab["position"])] = v
    return {w: c for w, c in out.items() if all(k in c for k in _SPEC)}


def run_counts(
    first: dict[str, list] | None, last: dict[str, list] | None
) -> dict[str, Any] | None:
    """The decode workers' speculation counters over a run: `last` minus `first`, summed over
    workers. None when either scrape lacks them, a worker is missing from one, or a counter went
    back (the worker restarted in between: its counts since boot no longer cover the run)."""
    a, b = _worker_counts(first), _worker_counts(last)
    if not a or a.keys() != b.keys():
        return None
    out: dict[str, Any] = {k: 0.0 for k in _SPEC} | {"at_risk": {}, "passed": {}}
    for w in a:
        if b[w]["beats"] < a[w]["beats"] or b[w]["boot"] != a[w]["boot"]:
            return None
        for k in _SPEC:
            d = b[w][k] - a[w][k]
            if d < 0:
                return None
            out[k] += d
        for k in ("at_risk", "passed"):
            for pos, v in b[w][k].items():
                d = v - a[w][k].get(pos, 0.0)
                if d < 0:
                    return None
                out[k][pos] = out[k].get(pos, 0.0) + d
    return out


class ServerMonitor:
    """Polls /metrics while the benchmark runs. Windowed heartbeat means (budget K, step time)
    are averaged over busy windows. Tau, acceptance per position and verify tokens come from
    the decode workers' counters, read once the workers settled before the measured requests
    and again after them: exact for the run (`server_counts` "run"). A server without the
    counters gives its cumulative ratios since the worker started ("cumulative")."""

    def __init__(self, client: httpx.AsyncClient, base_url: str, interval: float) -> None:
        self.client, self.url, self.interval = client, f"{base_url}/metrics", interval
        self.capacity_url = f"{base_url}/capacity"
        self.samples: list[dict[str, float]] = []
        self.last: dict[str, list] | None = None
        self.first: dict[str, list] | None = None  # the settled scrape before the run
        self.available = True
        self._task: asyncio.Task[None] | None = None

    async def scrape(self) -> dict[str, list] | None:
        try:
            r = await self.client.get(self.url)
            if r.status_code != 200:
                self.available = False
                return None
            return parse_metrics(r.text)
        except (httpx.HTTPError, ValueError):
            self.available = False
            return None

    async def _loop(self) -> None:
        while self.available:
            m = await self.scrape()
            if m is not None:
                self.last = m
                k = _decode_values(m, "dspark_verify_budget_k")
                step = _decode_values(m, "dspark_step_seconds")
                run = _decode_values(m, "dspark_running_requests")
                if step and sum(step) > 0:
                    self.samples.append(
                        {"k": sum(k), "running": sum(run), "step_s": max(step), "n": len(step)}
                    )
            await asyncio.sleep(self.interval)

    async def settled(self) -> dict[str, list] | None:
        """A scrape whose counters include every step taken before this call: each decode
        worker has sent SETTLE_BEATS heartbeats since (or restarted, which run_counts rejects).
        A server without the counters is scraped once; one whose heartbeats stall gives the
        last scrape after SETTLE_TIMEOUT_S."""
        m = await self.scrape()
        start = {w: c["beats"] for w, c in _worker_counts(m).items()}
        deadline = time.monotonic() + SETTLE_TIMEOUT_S
        while start and self.available and time.monotonic() < deadline:
            await asyncio.sleep(SETTLE_POLL_S)
            now = await self.scrape()
            if now is None:
                break
            m = now
            beats = {w: c["beats"] for w, c in _worker_counts(m).items()}
            if all(w in beats and not 0 <= beats[w] - b < SETTLE_BEATS for w, b in start.items()):
                break
        return m

    async def start(self) -> None:
        """The baseline counters (after the warm-up), then the polling loop."""
        self.first = await self.settled()
        self._task = asyncio.create_task(self._loop())

    async def stop(self) -> dict[str, Any]:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        m = await self.settled() if self.available else None
        return server_summary(m or self.last, self.samples, self.first) | {
            "server_capacity": await self.capacity() if self.available else None
        }

    async def capacity(self) -> dict[str, Any] | None:
        """Each decode worker's capacity model at the end of the run (GET /capacity: version,
        steps observed, MAPE and the model), which its planner priced the last steps with; None
        from a server without the route (sglang, vllm) or without a capacity-driven schedule."""
        try:
            r = await self.client.get(self.capacity_url)
            if r.status_code != 200:
                return None
            workers = r.json()["workers"]
            return {
                name: {k: v for k, v in w.items() if k != "profile"}
                | {"model": w["profile"]["model"]}
                for name, w in workers.items()
            }
        except (httpx.HTTPError, ValueError, KeyError, TypeError):
            return None


def server_summary(
    m: dict[str, list] | None,
    samples: list[dict[str, float]],
    first: dict[str, list] | None = None,
) -> dict[str, Any]:
    """The server's DSpark signals from the last scrape `m` and the busy windows; with the
    settled scrape `first` from before the run, the counters' difference replaces the
    cumulative and windowed estimates (`server_counts`: "run", else "cumulative")."""
    out: dict[str, Any] = {
        "server_accept_length": None,
        "per_position_acceptance": None,
        "verify_tokens_per_step": None,
        "mean_verify_budget_k": None,
        "mean_running_requests": None,
        "verify_tokens_per_request": None,
        "server_step_ms": None,
        "server_counts": None,
        "server_run_counts": None,
        "server_capacity": None,
    }
    if m is None:
        return out
    out["server_counts"] = "cumulative"
    tau = _decode_values(m, "dspark_worker_accept_length")
    vt = _decode_values(m, "dspark_verify_tokens_per_step")
    out["server_accept_length"] = float(np.mean(tau)) if tau and max(tau) > 0 else None
    out["verify_tokens_per_step"] = float(np.mean(vt)) if vt and max(vt) > 0 else None
    pos: dict[int, list[float]] = {}
    for lab, v in m.get("dspark_acceptance_rate", []):
        if lab.get("worker", "").startswith("decode"):
            pos.setdefault(int(lab["position"]), []).append(v)
    if pos:
        out["per_position_acceptance"] = [
            float(np.mean(pos[k])) if k in pos else None for k in range(1, max(pos) + 1)
        ]
    busy = [s for s in samples if s["running"] > 0]
    if busy:
        out["mean_verify_budget_k"] = float(np.mean([s["k"] / s["n"] for s in busy]))
        out["mean_running_requests"] = float(np.mean([s["running"] / s["n"] for s in busy]))
        out["verify_tokens_per_request"] = float(np.mean([1 + s["k"] / s["running"] for s in busy]))
        out["server_step_ms"] = float(np.mean([s["step_s"] for s in busy]) * 1e3)
    run = run_counts(first, m)
    if run is not None and run["steps"] > 0:  # a run without speculative steps keeps the above
        rounds, steps = run["rounds"], run["steps"]
        out["server_counts"] = "run"
        out["server_run_counts"] = {k: int(run[k]) for k in _SPEC}
        out["server_accept_length"] = run["committed_tokens"] / rounds if rounds else None
        out["verify_tokens_per_step"] = run["verify_tokens"] / steps
        out["mean_verify_budget_k"] = run["verified_drafts"] / steps
        out["verify_tokens_per_request"] = run["verify_tokens"] / rounds if rounds else None
        risk, passed = run["at_risk"], run["passed"]
        out["per_position_acceptance"] = [
            passed.get(k, 0.0) / risk[k] if risk.get(k) else None
            for k in range(1, max(risk, default=0) + 1)
        ] or None
    return out


# -- metrics ---------------------------------------------------------------------------------
def parse_slo(items: Sequence[str] | None) -> dict[str, float]:
    """["ttft:300", "tpot:50"] -> {"ttft": 0.3, "tpot": 0.05} (seconds)."""
    out = {}
    for item in items or ():
        key, sep, val = item.partition(":")
        if not sep or key not in SLO_KEYS:
            raise ValueError(f"--slo {item!r}: expected KEY:MS with KEY in {', '.join(SLO_KEYS)}")
        ms = float(val)
        if not ms > 0:
            raise ValueError(f"--slo {item!r}: the bound must be > 0 ms")
        out[key] = ms / 1000.0
    return out


def meets_slo(o: Outcome, slo: dict[str, float]) -> bool:
    if not o.success:
        return False
    checks = {
        "ttft": o.ttft,
        "tpot": o.tpot or 0.0,
        "itl": float(np.mean(o.itl)) if o.itl else 0.0,
        "e2el": o.latency,
    }
    return all(checks[k] <= v for k, v in slo.items())


def _stats(name: str, values: Sequence[float], scale: float = 1000.0) -> dict[str, float]:
    """mean/median/std/p90/p95/p99 (ms) with sglang.bench_serving's key spellings."""
    arr = np.zeros(1) if not len(values) else np.asarray(values, np.float64) * scale
    out = {f"mean_{name}_ms": float(arr.mean()), f"std_{name}_ms": float(arr.std())}
    out[f"median_{name}_ms"] = float(np.median(arr))
    for p in PERCENTILES[1:]:
        out[f"p{p}_{name}_ms"] = float(np.percentile(arr, p))
    out[f"max_{name}_ms"] = float(arr.max())
    return out


def steady_window(outcomes: Sequence[Outcome], concurrency: int) -> tuple[float, float] | None:
    """Closed loop at `concurrency`: from the completion that ends the first wave (the
    concurrency-th) to the last request's send, exactly `concurrency` requests are in flight.
    Before it the first wave starts in lock-step (its prefills together), after it the last
    requests drain at a shrinking batch; None when the run has no such interval."""
    ok = [o for o in outcomes if o.success]
    if concurrency < 1 or len(ok) < concurrency:
        return None
    t0 = sorted(o.start + o.latency for o in ok)[concurrency - 1]
    t1 = max(o.start for o in outcomes)
    return (t0, t1) if t1 > t0 else None


def _tokens_by(o: Outcome, t: float) -> int:
    """Output tokens request `o` had received by `t` (benchmark seconds)."""
    i = bisect.bisect_right([x for x, _ in o.token_times], t)
    return o.token_times[i - 1][1] if i else 0


# A steady window shorter than this share of the run, or with fewer output tokens than this many
# per slot, is reported as none: with two prompts per slot at c = 16-64 the last send comes a
# step or two after the first wave ends, and one step's burst over a few milliseconds read
# 4,000-21,000 tok/s (sweeps s52_auto, s53_full).
STEADY_MIN_SHARE, STEADY_MIN_TOKENS_PER_SLOT = 0.25, 8


def steady_throughput(
    outcomes: Sequence[Outcome], concurrency: int, duration: float
) -> dict[str, Any]:
    """Output tok/s inside the steady window, counted from the servers' continuous usage
    (per token, not per chunk: a speculative step streams several tokens at once). Both keys
    None without a window, with one too short to measure (STEADY_MIN_SHARE of `duration`,
    STEADY_MIN_TOKENS_PER_SLOT), or without continuous usage on every request."""
    none = {"steady_output_throughput": None, "steady_window_s": None}
    win = steady_window(outcomes, concurrency)
    ok = [o for o in outcomes if o.success]
    if win is None or not all(o.token_times for o in ok):
        return none
    t0, t1 = win
    if t1 - t0 < STEADY_MIN_SHARE * duration:
        return none
    n = sum(_tokens_by(o, t1) - _tokens_by(o, t0) for o in ok)
    if n < STEADY_MIN_TOKENS_PER_SLOT * concurrency:
        return none
    return {"steady_output_throughput": n / (t1 - t0), "steady_window_s": t1 - t0}


def compute_metrics(
    outcomes: Sequence[Outcome],
    duration: float,
    slo: dict[str, float] | None = None,
    closed_loop: int | None = None,
) -> dict[str, Any]:
    """Aggregate metrics over the measured (non-warm-up) requests; failures count only in
    `completed`/`failed`. Keys follow sglang.bench_serving (vllm spellings added for E2E).
    `closed_loop` = the max concurrency of a closed-loop run (every request sent at once, the
    semaphore pacing them): adds the steady-window throughput."""
    ok = [o for o in outcomes if o.success]
    n_in = sum(o.prompt_len for o in ok)
    n_out = sum(o.output_len for o in ok)
    dur = max(duration, 1e-9)
    tpots = [t for o in ok if (t := o.tpot) is not None]
    tps = [u for o in ok if (u := o.user_tps) is not None]
    res: dict[str, Any] = {
        "duration": duration,
        "completed": len(ok),
        "failed": len(outcomes) - len(ok),
        "total_input_tokens": n_in,
        "total_output_tokens": n_out,
        "request_throughput": len(ok) / dur,
        "input_throughput": n_in / dur,
        "output_throughput": n_out / dur,
        "total_throughput": (n_in + n_out) / dur,
        "total_token_throughput": (n_in + n_out) / dur,  # vllm's name
        "concurrency": sum(o.latency for o in ok) / dur,  # mean requests in flight
    }
    res |= _stats("ttft", [o.ttft for o in ok])
    res |= _stats("tpot", tpots)
    res |= _stats("itl", [x for o in ok for x in o.itl])
    e2e = _stats("e2e_latency", [o.latency for o in ok])
    res |= e2e | {k.replace("e2e_latency", "e2el"): v for k, v in e2e.items()}
    res["mean_tps_per_user"] = float(np.mean(tps)) if tps else 0.0
    res["median_tps_per_user"] = float(np.median(tps)) if tps else 0.0
    res["p10_tps_per_user"] = float(np.percentile(tps, 10)) if tps else 0.0
    rounds = sum(o.spec_rounds for o in ok)
    committed = sum(max(o.output_len - 1, 0) for o in ok if o.spec_rounds)
    res["accept_length"] = committed / rounds if rounds else 1.0
    # the responses' own counts, which the server's run counters (server_run_counts) must match
    res["spec_rounds"] = rounds
    res["spec_accepted_drafts"] = sum(o.spec_accepted for o in ok)
    if closed_loop:
        res |= steady_throughput(outcomes, closed_loop, duration)
    if slo:
        good = [o for o in ok if meets_slo(o, slo)]
        res["slo"] = {k: v * 1000.0 for k, v in slo.items()}
        res["request_goodput"] = len(good) / dur
        res["output_goodput"] = sum(o.output_len for o in good) / dur
        res["good_request_fraction"] = len(good) / len(outcomes) if outcomes else 0.0
    errors = sorted({o.error for o in outcomes if not o.success})
    res["errors"] = errors[:5]
    return res


# -- the run ---------------------------------------------------------------------------------
def build_prompts(args: argparse.Namespace) -> list[Prompt]:
    """Warm-up requests, then the measured ones in send order (fixed for a given --seed). The
    warm-up reuses the first measured prompts, so the measured set does not depend on it."""
    rng = np.random.default_rng(args.seed)
    lo, hi = args.random_token_range
    n, name = args.num_prompts, args.dataset_name
    if name == "random":
        ps = random_prompts(
            rng,
            n,
            args.random_input_len,
            args.random_output_len,
            args.random_range_ratio,
            (lo, hi),
        )
    elif name == "mooncake":
        if args.dataset_path is None:
            raise SystemExit("error: --dataset-name mooncake needs --dataset-path TRACE.jsonl")
        ps = trace_prompts(args.dataset_path, (lo, hi), args.trace_block_size, args.seed)[:n]
    else:
        path = args.dataset_path if name == "custom" else HELDOUT_PROMPTS
        if path is None:
            raise SystemExit("error: --dataset-name custom needs --dataset-path FILE.jsonl")
        base = text_prompts(path, args.output_len)
        order = list(range(len(base)))
        if not args.disable_shuffle:
            random.Random(args.seed).shuffle(order)
        ps = [base[order[i % len(base)]] for i in range(n)]
        if args.output_len_range_ratio < 1.0:  # its own draws: the order stays the same
            lens = random_lengths(
                np.random.default_rng([args.seed, 1]),
                n,
                args.output_len,
                args.output_len_range_ratio,
            )
            ps = [replace(p, output_len=int(k)) for p, k in zip(ps, lens, strict=True)]
    return [ps[i % len(ps)] for i in range(args.warmup_requests)] + ps


async def _resolve_model(client: httpx.AsyncClient, base: str, model: str | None) -> str:
    if model:
        return model
    try:
        r = await client.get(f"{base}/v1/models")
        return r.json()["data"][0]["id"]
    except (httpx.HTTPError, KeyError, IndexError, ValueError) as e:
        raise SystemExit(f"error: cannot read {base}/v1/models ({e}); pass --model") from None


async def benchmark(
    args: argparse.Namespace,
    prompts: list[Prompt],
    transport: httpx.AsyncBaseTransport | None = None,
) -> dict[str, Any]:
    """Warm up, then send the measured requests on schedule; returns the result record.
    `transport` replaces the network (tests use httpx.MockTransport)."""
    chat = BACKENDS[args.backend] == "chat"
    base = args.base_url.rstrip("/")
    url = f"{base}/v1/{'chat/completions' if chat else 'completions'}"
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    warm, measured = prompts[: args.warmup_requests], prompts[args.warmup_requests :]
    conns = max(args.max_concurrency or len(measured), 1) + 4
    limits = httpx.Limits(max_connections=conns, max_keepalive_connections=conns)
    timeout = httpx.Timeout(args.timeout, connect=30.0)
    stream = not args.disable_stream
    async with httpx.AsyncClient(
        headers=headers, limits=limits, timeout=timeout, trust_env=False, transport=transport
    ) as client:
        model = await _resolve_model(client, base, args.model)
        for p in warm:  # one at a time; excluded from every metric
            o = await send_request(client, url, request_body(p, model, chat, stream, args), chat, 0)
            if not o.success:
                raise SystemExit(f"error: warm-up request failed: {o.error}")
        if args.use_trace_timestamps:
            offsets = np.array([p.timestamp or 0.0 for p in measured]) * args.trace_slowdown_factor
        else:
            rng = np.random.default_rng(args.seed + 1)
            offsets = arrival_offsets(
                len(measured), args.request_rate, args.arrival, args.burstiness, rng
            )
        bar = None
        if not args.disable_tqdm:
            from tqdm import tqdm

            bar = tqdm(total=len(measured), desc="requests", file=sys.stderr)
        sem = asyncio.Semaphore(args.max_concurrency) if args.max_concurrency else None
        monitor = ServerMonitor(client, base, args.metrics_interval)
        if not args.no_server_metrics:
            await monitor.start()
        t_bench = time.perf_counter()

        async def one(p: Prompt) -> Outcome:
            body = request_body(p, model, chat, stream, args)
            if sem is None:
                o = await send_request(client, url, body, chat, t_bench)
            else:
                async with sem:
                    o = await send_request(client, url, body, chat, t_bench)
            if o.prompt_len == 0 and p.prompt_len:
                o.prompt_len = p.prompt_len
            if bar is not None:
                bar.update(1)
            return o

        tasks = []
        for p, off in zip(measured, offsets, strict=True):
            delay = t_bench + float(off) - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(one(p)))
        outcomes = await asyncio.gather(*tasks)
        duration = time.perf_counter() - t_bench
        server = await monitor.stop() if not args.no_server_metrics else server_summary(None, [])
        if bar is not None:
            bar.close()
    closed = (
        args.max_concurrency
        if not math.isfinite(args.request_rate) and not args.use_trace_timestamps
        else None
    )
    res = compute_metrics(outcomes, duration, parse_slo(args.slo), closed)
    res |= server
    record = _header(args, model) | res
    if args.output_details:
        record |= {
            "input_lens": [o.prompt_len for o in outcomes],
            "output_lens": [o.output_len for o in outcomes],
            "ttfts": [o.ttft for o in outcomes],
            "itls": [o.itl for o in outcomes],
            "start_times": [o.start for o in outcomes],
            "latencies": [o.latency for o in outcomes],
            "accept_lengths": [o.accept_length for o in outcomes],
            "generated_texts": [o.text for o in outcomes],
            "errors": [o.error for o in outcomes],
        }
    return record


def _header(args: argparse.Namespace, model: str) -> dict[str, Any]:
    return {
        "tool": "dspark_sglang.bench.serving",
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "command": shlex.join(["python", "-m", "dspark_sglang.bench.serving", *args.argv]),
        "backend": args.backend,
        "base_url": args.base_url,
        "model_id": model,
        "dataset_name": args.dataset_name,
        "dataset_path": str(args.dataset_path) if args.dataset_path else None,
        "num_prompts": args.num_prompts,
        "request_rate": args.request_rate if math.isfinite(args.request_rate) else "inf",
        "arrival": "trace" if args.use_trace_timestamps else args.arrival,
        "burstiness": args.burstiness,
        "max_concurrency": args.max_concurrency,
        "output_len": args.output_len,
        "output_len_range_ratio": args.output_len_range_ratio,
        "random_input_len": args.random_input_len,
        "random_output_len": args.random_output_len,
        "random_range_ratio": args.random_range_ratio,
        "temperature": args.temperature,
        "ignore_eos": args.ignore_eos,
        "stream": not args.disable_stream,
        "seed": args.seed,
        "warmup_requests": args.warmup_requests,
        **dict(args.metadata or {}),
    }


def format_summary(r: dict[str, Any]) -> str:
    """sglang.bench_serving-style result block."""
    rows: list[tuple[str, Any]] = [
        ("Backend", r["backend"]),
        ("Traffic request rate", r["request_rate"]),
        ("Max request concurrency", r["max_concurrency"] or "not set"),
        ("Successful requests", r["completed"]),
        ("Failed requests", r["failed"]),
        ("Benchmark duration (s)", f"{r['duration']:.2f}"),
        ("Total input tokens", r["total_input_tokens"]),
        ("Total generated tokens", r["total_output_tokens"]),
        ("Request throughput (req/s)", f"{r['request_throughput']:.2f}"),
        ("Output token throughput (tok/s)", f"{r['output_throughput']:.2f}"),
        (
            "Steady-window output tok/s (window s)",
            "-"
            if r.get("steady_output_throughput") is None
            else f"{r['steady_output_throughput']:.2f} ({r['steady_window_s']:.1f})",
        ),
        ("Total token throughput (tok/s)", f"{r['total_throughput']:.2f}"),
        (
            "Per-user tok/s (mean / median)",
            f"{r['mean_tps_per_user']:.1f} / {r['median_tps_per_user']:.1f}",
        ),
        ("Concurrency", f"{r['concurrency']:.2f}"),
        ("Accept length", f"{r['accept_length']:.2f}"),
    ]
    if r.get("per_position_acceptance"):
        acc = ", ".join("-" if a is None else f"{a:.2f}" for a in r["per_position_acceptance"])
        rows.append(("Acceptance per position (server)", acc))
    if r.get("verify_tokens_per_request") is not None:
        rows.append(("Verify tokens / request / step", f"{r['verify_tokens_per_request']:.2f}"))
    if r.get("verify_tokens_per_step") is not None:
        rows.append(("Verify tokens / step (server)", f"{r['verify_tokens_per_step']:.1f}"))
    if "request_goodput" in r:
        slo = " ".join(f"{k}:{v:g}" for k, v in r["slo"].items())
        rows.append((f"Goodput req/s ({slo} ms)", f"{r['request_goodput']:.2f}"))
        rows.append(("Good request fraction", f"{r['good_request_fraction']:.3f}"))
    lines = ["{s:{c}^60}".format(s=" Serving Benchmark Result ", c="=")]
    lines += [f"{k:<42}{v!s:>18}" for k, v in rows]
    for name, title in (
        ("e2e_latency", "End-to-End Latency"),
        ("ttft", "Time to First Token"),
        ("tpot", "Time per Output Token (excl. 1st token)"),
        ("itl", "Inter-Token Latency"),
    ):
        lines.append("{s:{c}^60}".format(s=f" {title} ", c="-"))
        for stat in ("mean", "median", "p90", "p99"):
            lines.append(
                f"{f'{stat.capitalize()} {name.upper()} (ms)':<42}{r[f'{stat}_{name}_ms']:>18.2f}"
            )
    lines.append("=" * 60)
    return "\n".join(lines)


def _token_range(text: str) -> tuple[int, int]:
    lo, _, hi = text.partition(":")
    try:
        a, b = int(lo), int(hi)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected LO:HI, got {text!r}") from None
    if not 0 <= a < b:
        raise argparse.ArgumentTypeError(f"need 0 <= LO < HI, got {text!r}")
    return a, b


def _kv(text: str) -> tuple[str, Any]:
    key, sep, val = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {text!r}")
    try:
        return key, json.loads(val)
    except json.JSONDecodeError:
        return key, val


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="python -m dspark_sglang.bench.serving",
        description=__doc__,
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    ap.add_argument("--base-url", default="http://127.0.0.1:30000")
    ap.add_argument(
        "--backend",
        choices=sorted(BACKENDS),
        default="oai",
        help="oai = /v1/completions, oai-chat = /v1/chat/completions",
    )
    ap.add_argument("--model", help="model id (default: the first of /v1/models)")
    ap.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"))
    ap.add_argument(
        "--dataset-name",
        choices=DATASETS,
        default=None,
        help="heldout = bundled held-out code prompts (default; custom when "
        "--dataset-path is given)",
    )
    ap.add_argument(
        "--dataset-path",
        type=Path,
        help='jsonl of {"turns": [...]} / {"prompt"} rows, or a mooncake trace',
    )
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument(
        "--output-len", type=int, default=128, help="max_tokens of heldout/custom prompts"
    )
    ap.add_argument(
        "--output-len-range-ratio",
        type=float,
        default=1.0,
        help="heldout/custom max_tokens uniform in [output-len*ratio, output-len] per request "
        "(1 = fixed); with --ignore-eos a fixed length finishes a closed loop's requests in "
        "lock-step",
    )
    ap.add_argument("--random-input-len", type=int, default=128)
    ap.add_argument("--random-output-len", type=int, default=128)
    ap.add_argument(
        "--random-range-ratio",
        type=float,
        default=1.0,
        help="lengths uniform in [len*ratio, len] (1 = fixed)",
    )
    ap.add_argument(
        "--random-token-range",
        type=_token_range,
        default=(10, 1000),
        metavar="LO:HI",
        help="token ids of random and trace prompts",
    )
    ap.add_argument(
        "--request-rate",
        type=float,
        default=float("inf"),
        help="requests/s; inf = all at once (closed loop under --max-concurrency)",
    )
    ap.add_argument("--arrival", choices=ARRIVALS, default="poisson")
    ap.add_argument(
        "--burstiness",
        type=float,
        default=1.0,
        help="gamma shape for --arrival gamma (1 = Poisson, < 1 = burstier)",
    )
    ap.add_argument("--max-concurrency", type=int, default=None)
    ap.add_argument(
        "--use-trace-timestamps",
        action="store_true",
        help="replay the trace's timestamps (mooncake)",
    )
    ap.add_argument("--trace-slowdown-factor", type=float, default=1.0)
    ap.add_argument("--trace-block-size", type=int, default=512, help="tokens per trace hash id")
    ap.add_argument("--warmup-requests", type=int, default=1)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--disable-shuffle", action="store_true")
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--ignore-eos", action="store_true")
    ap.add_argument("--disable-stream", action="store_true")
    ap.add_argument(
        "--no-continuous-usage",
        action="store_true",
        help="do not ask for stream_options.continuous_usage_stats (for servers that reject "
        "it); the steady-window throughput then reads -",
    )
    ap.add_argument("--extra-request-body", type=json.loads, default=None, metavar="JSON")
    ap.add_argument(
        "--slo",
        "--goodput",
        nargs="+",
        metavar="KEY:MS",
        help="goodput SLOs, e.g. ttft:300 tpot:50 (keys ttft, tpot, itl, e2el)",
    )
    ap.add_argument(
        "--metadata",
        nargs="+",
        type=_kv,
        metavar="KEY=VALUE",
        help="extra fields for the output record",
    )
    ap.add_argument("--output-file", type=Path, help="append one JSON line per run")
    ap.add_argument(
        "--output-details", action="store_true", help="add per-request lists to the record"
    )
    ap.add_argument(
        "--metrics-interval", type=float, default=0.5, help="seconds between /metrics scrapes"
    )
    ap.add_argument("--no-server-metrics", action="store_true")
    ap.add_argument("--timeout", type=float, default=600.0, help="per-request seconds")
    ap.add_argument("--disable-tqdm", action="store_true")
    ap.add_argument("--json", action="store_true", help="print the record as one JSON line")
    return ap


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    ap = build_parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    args = ap.parse_args(argv)
    args.argv = argv
    if args.dataset_name is None:
        args.dataset_name = "custom" if args.dataset_path else "heldout"
    if args.num_prompts < 1 or args.warmup_requests < 0:
        ap.error("--num-prompts must be >= 1 and --warmup-requests >= 0")
    if args.max_concurrency is not None and args.max_concurrency < 1:
        ap.error("--max-concurrency must be >= 1")
    if not 0.0 < args.output_len_range_ratio <= 1.0:
        ap.error("--output-len-range-ratio must be in (0, 1]")
    if not args.request_rate > 0:
        ap.error("--request-rate must be > 0 (inf for all at once)")
    if args.use_trace_timestamps and args.dataset_name != "mooncake":
        ap.error("--use-trace-timestamps needs --dataset-name mooncake")
    try:
        parse_slo(args.slo)
    except ValueError as e:
        ap.error(str(e))
    return args


def run(
    args: argparse.Namespace, transport: httpx.AsyncBaseTransport | None = None
) -> dict[str, Any]:
    """Build the prompts, run, append to --output-file; returns the record."""
    prompts = build_prompts(args)
    record = asyncio.run(benchmark(args, prompts, transport))
    if args.output_file is not None:
        args.output_file.parent.mkdir(parents=True, exist_ok=True)
        with args.output_file.open("a") as f:
            f.write(json.dumps(record) + "\n")
    return record


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    record = run(args)
    if args.json:
        print(json.dumps({k: v for k, v in record.items() if k != "generated_texts"}))
    else:
        print(format_summary(record))
    return 0 if record["completed"] else 1


if __name__ == "__main__":
    sys.exit(main())
