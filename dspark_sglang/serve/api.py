"""OpenAI-compatible HTTP front and router: tokenize, pick the least-loaded workers, stream deltas.

Imports config, types, messages, transport and chat_template only: no torch, no engine. Over 300
lines because the router state and the HTTP surface share one event loop and one request record.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import secrets
import threading
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import jinja2
import prometheus_client as prom
import yaml
from fastapi import FastAPI, HTTPException, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from pydantic import BaseModel, ConfigDict
from starlette.exceptions import HTTPException as StarletteHTTPException
from tokenizers import Tokenizer

from dspark_sglang.chat_template import render_chat
from dspark_sglang.config import ArchConfig, Config, ConfigError
from dspark_sglang.serve import messages as m
from dspark_sglang.serve.transport import Receiver, Security, Sender
from dspark_sglang.types import SamplingParams

log = logging.getLogger(__name__)
MAX_BODY_BYTES = 8 << 20
PROFILE_HEADER = "# Engine capacity profile from a running server (GET /capacity?format=profile).\n"
RETRY_BACKOFF_S = 0.25  # x attempt: a worker that just joined may not have every ZMQ link up


class ApiError(Exception):
    def __init__(self, status: int, message: str, retry_after: int | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.retry_after = status, message, retry_after


# -- router: worker table, dispatch, retries, liveness ---------------------------------------
@dataclass(eq=False)
class Worker:
    name: str
    index: int
    sender: Sender
    boot: int | None = None
    accepted: bool = False  # handshake passed and heartbeats fresh
    refused: str | None = None
    last_seen: float = 0.0
    hb: m.Heartbeat | None = None
    capacity: dict[str, Any] | None = None  # the last capacity model it sent (GET /capacity)
    uids: set[int] = field(default_factory=set)  # prefill: not yet handed off; decode: all


@dataclass(eq=False)
class Job:
    """One HTTP request across dispatch attempts; each attempt has a fresh uid."""

    prompt_ids: list[int]
    params: SamplingParams
    events: asyncio.Queue[m.Delta] = field(default_factory=asyncio.Queue)
    created: float = field(default_factory=time.monotonic)
    uid: int = -1
    prefill: Worker | None = None
    decode: Worker | None = None
    attempts: int = 0
    first_at: float | None = None
    done: bool = False


class Router:
    def __init__(self, cfg: Config, hand: m.Handshake, metrics: Metrics) -> None:
        self.cfg, self.hand, self.metrics = cfg.serve, hand, metrics
        sec = Security(cfg.serve)
        self.inbox = Receiver(cfg.serve.api_addr, sec)
        self.prefill = [
            Worker(f"prefill{i}", i, Sender(a, sec)) for i, a in enumerate(cfg.serve.prefill_addrs)
        ]
        self.decode = [
            Worker(f"decode{i}", i, Sender(a, sec)) for i, a in enumerate(cfg.serve.decode_addrs)
        ]
        self.workers = {w.name: w for w in self.prefill + self.decode}
        self.jobs: dict[int, Job] = {}
        self.active: set[Job] = set()
        self._uid = secrets.randbits(40) << 20  # a restarted router never reuses a live uid
        self._stop = threading.Event()
        self._loop: asyncio.AbstractEventLoop | None = None  # set by start()

    @property
    def ready(self) -> bool:
        """A request sent now would be dispatched: a joined decode worker, and a joined prefill
        worker this router's sender already reaches (a worker says hello as soon as it binds,
        before the connection back to it is up: /ready answering 200 then made the first request
        a 503)."""
        return any(w.accepted and w.sender.connected for w in self.prefill) and any(
            w.accepted for w in self.decode
        )

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        threading.Thread(target=self._recv_loop, args=(loop,), daemon=True).start()
        loop.create_task(self._liveness_loop())

    def stop(self) -> None:
        self._stop.set()

    def _recv_loop(self, loop: asyncio.AbstractEventLoop) -> None:
        # The inbox socket lives on this thread; router state only on the event loop.
        while not self._stop.is_set():
            frames = self.inbox.recv(100)
            if frames is None:
                continue
            try:
                msg, _ = m.decode(frames)
            except m.BadMessage as e:
                log.warning("dropped a malformed message: %s", e)
                continue
            try:
                loop.call_soon_threadsafe(self._on_message, msg)
            except RuntimeError:  # the loop closed: the server is shutting down
                return

    async def _liveness_loop(self) -> None:
        while True:
            await asyncio.sleep(self.cfg.heartbeat_interval_s)
            now = time.monotonic()
            for w in self.workers.values():
                if w.accepted and now - w.last_seen > self.cfg.heartbeat_timeout_s:
                    self._fail_worker(
                        w, f"{w.name} missed heartbeats for {self.cfg.heartbeat_timeout_s:g}s"
                    )

    # -- dispatch
    def submit(self, job: Job) -> None:
        if len(self.active) >= self.cfg.max_pending_requests:
            raise ApiError(429, "server is at its request limit; retry later", retry_after=1)
        if not self._dispatch(job):
            raise ApiError(503, "no prefill/decode worker is available", retry_after=2)
        self.active.add(job)

    def _dispatch(self, job: Job) -> bool:
        decode = min((w for w in self.decode if w.accepted), key=_load, default=None)
        if decode is None:
            return False
        for p in sorted((w for w in self.prefill if w.accepted), key=_load):
            self._uid += 1
            req = m.Request(self._uid, job.prompt_ids, job.params, decode.index)
            if p.sender.send(m.encode(req)):
                job.uid, job.prefill, job.decode = self._uid, p, decode
                job.attempts += 1
                self.jobs[job.uid] = job
                p.uids.add(job.uid)
                decode.uids.add(job.uid)
                self.metrics.dispatched.labels(p.name).inc()
                self.metrics.dispatched.labels(decode.name).inc()
                return True
        return False

    def _forget(self, job: Job, abort: bool) -> None:
        """Drop the current attempt; `abort` tells its workers to free its KV."""
        if self.jobs.pop(job.uid, None) is None:
            return
        for w in (job.prefill, job.decode):
            w.uids.discard(job.uid)
            if abort:
                w.sender.send(m.encode(m.Abort(job.uid)))

    def _end(self, job: Job, delta: m.Delta) -> None:
        if delta.error is not None:  # (a finished one was counted by observe_request)
            self.metrics.requests.labels("error").inc()
        job.done = True
        self.active.discard(job)
        job.events.put_nowait(delta)

    def _error(self, job: Job, status: int, reason: str) -> None:
        self._forget(job, abort=True)
        self._end(job, m.Delta(job.uid, [], "", True, error=reason, status=status))

    def _retry(self, job: Job, reason: str) -> None:
        self._forget(job, abort=True)
        if job.attempts > self.cfg.max_retries:
            self._end(job, m.Delta(job.uid, [], "", True, error=reason, status=503))
        else:  # not at once: "decode unreachable" right after a (re)join heals in ~0.1 s
            assert self._loop is not None
            self._loop.call_later(RETRY_BACKOFF_S * job.attempts, self._redispatch, job, reason)

    def _redispatch(self, job: Job, reason: str) -> None:
        if job.done:  # the client left or timed out during the backoff
            return
        if self._dispatch(job):
            self.metrics.retries.inc()
            log.info("retrying request after: %s", reason)
        else:
            self._end(job, m.Delta(job.uid, [], "", True, error=reason, status=503))

    def release(self, job: Job, outcome: str = "disconnected") -> None:
        """The HTTP side is done with the job. One that has not ended yet ends here, counted as
        `outcome` (the client left, or it timed out): every admitted request is counted once."""
        if not job.done:
            self._forget(job, abort=True)
            job.done = True
            self.metrics.requests.labels(outcome).inc()
        self.active.discard(job)

    def _fail_worker(self, w: Worker, reason: str) -> None:
        log.error("%s: failing its %d requests", reason, len(w.uids))
        w.accepted = False
        for uid in list(w.uids):
            job = self.jobs[uid]
            if job.first_at is None:  # nothing streamed yet: transparent retry elsewhere
                self._retry(job, reason)
            else:
                self._error(job, 503, f"{reason}; the request was cut off mid-generation")

    # -- inbox
    def _on_message(self, msg: m.Message) -> None:
        if isinstance(msg, m.Heartbeat):
            self._on_heartbeat(msg)
        elif isinstance(msg, m.Deltas):
            w = self.workers.get(msg.worker)
            for d in msg.items:
                self._on_delta(w, d)

    def _on_heartbeat(self, hb: m.Heartbeat) -> None:
        w = self.workers.get(hb.worker)
        if w is None:
            log.warning("heartbeat from unknown worker %r ignored", hb.worker)
            return
        if hb.boot != w.boot or not w.accepted:
            if w.accepted:
                self._fail_worker(w, f"{w.name} restarted")
            w.boot = hb.boot
            w.refused = m.handshake_mismatch(self.hand, hb.hand)
            w.accepted = w.refused is None
            if w.refused:
                log.error("refusing %s: %s", w.name, w.refused)
                w.sender.send(m.encode(m.Refuse(w.refused)))
            else:
                log.info("%s joined (boot %x)", w.name, hb.boot)
        w.last_seen, w.hb = time.monotonic(), hb
        if hb.capacity is not None:
            w.capacity = hb.capacity
        for reason, n in hb.fallbacks.items():
            self.metrics.fallbacks.labels(w.name, reason).inc(n)

    def _on_delta(self, w: Worker | None, d: m.Delta) -> None:
        job = self.jobs.get(d.uid)
        if job is None:  # a stale attempt (retried, aborted, worker restarted): free its KV
            if w is not None and not d.finished:
                w.sender.send(m.encode(m.Abort(d.uid)))
            return
        if d.error is not None:
            if d.status >= 500 and job.first_at is None:
                self._retry(job, d.error)
            else:
                self._error(job, d.status, d.error)
            return
        if job.first_at is None:
            job.first_at = time.monotonic()
            job.prefill.uids.discard(d.uid)  # handed off: a prefill failure no longer matters
        if d.finished:
            self._forget(job, abort=False)
            self.metrics.observe_request(job, d)
            self._end(job, d)
        else:
            job.events.put_nowait(d)


def _load(w: Worker) -> tuple[int, int]:
    return len(w.uids), w.index


# -- metrics (DESIGN §8) ---------------------------------------------------------------------
_WORKER_GAUGES = {  # dspark_<name>{worker} <- heartbeat field
    "kv_pool_blocks": "total_blocks",
    "kv_pool_free_blocks": "free_blocks",
    "running_requests": "running",
    "queue_depth": "waiting",
    "step_seconds": "step_seconds",
    "predicted_step_seconds": "predicted_step_seconds",
    "capacity_mape": "capacity_mape",
    "verify_budget_k": "verify_budget_k",
    "verify_tokens_per_step": "verify_tokens_per_step",
    "worker_accept_length": "tau",
}
# dspark_spec_<name>_total{worker} <- heartbeat SpecCounts field: counters since the worker
# booted, which a client differences between two scrapes (bench.serving) for exact per-run
# accept length, acceptance per position and verify tokens
_SPEC_COUNTERS = {
    "rounds": ("rounds", "Decode verify rounds (one per request per speculative step)"),
    "committed_tokens": ("committed", "Tokens committed by verify rounds"),
    "verified_drafts": ("verified", "Draft tokens sent to the target"),
    "accepted_drafts": ("accepted", "Draft tokens accepted"),
    "verify_tokens": ("verify_tokens", "Target rows of verify sequences (1 + l per round)"),
    "steps": ("steps", "Speculative steps"),
}
_LATENCY = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)


class Metrics:
    """Request metrics are observed here; worker metrics are read from heartbeats per scrape."""

    def __init__(self) -> None:
        prom.disable_created_metrics()  # *_created series are noise for dashboards
        r = self.registry = prom.CollectorRegistry()
        hist = lambda name, doc, b=_LATENCY: prom.Histogram(name, doc, buckets=b, registry=r)
        self.requests = prom.Counter("dspark_requests", "Ended requests", ["outcome"], registry=r)
        self.ttft = hist("dspark_time_to_first_token_seconds", "Time to first token")
        self.tpot = hist("dspark_time_per_output_token_seconds", "Time per output token")
        self.e2e = hist("dspark_e2e_request_latency_seconds", "Request latency")
        self.accept = hist(
            "dspark_accept_length",
            "Tokens per verify round, per request",
            (1, 1.5, 2, 2.5, 3, 4, 5, 6, 8, 12, 16),
        )
        self.prompt_tokens = prom.Counter("dspark_prompt_tokens", "Prompt tokens", registry=r)
        self.gen_tokens = prom.Counter("dspark_generation_tokens", "Output tokens", registry=r)
        self.retries = prom.Counter("dspark_retries", "Requests re-dispatched", registry=r)
        self.dispatched = prom.Counter(
            "dspark_worker_requests", "Dispatches", ["worker"], registry=r
        )
        self.fallbacks = prom.Counter(
            "dspark_schedule_fallbacks", "Planner fallbacks", ["worker", "reason"], registry=r
        )
        self.router: Router | None = None
        r.register(self)

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        r = self.router
        yield GaugeMetricFamily("dspark_inflight_requests", "Requests in the router", len(r.active))
        yield GaugeMetricFamily(
            "dspark_rejected_messages", "ZMQ messages that failed authentication", r.inbox.rejected
        )
        fam = lambda name, doc, labels=("worker",): GaugeMetricFamily(name, doc, labels=labels)
        up = fam("dspark_worker_up", "1 while the worker heartbeats and passed the handshake")
        gauges = {k: fam(f"dspark_{k}", f"heartbeat {f}") for k, f in _WORKER_GAUGES.items()}
        acc = fam(
            "dspark_acceptance_rate",
            "Conditional acceptance per draft position",
            ("worker", "position"),
        )
        count = lambda name, doc, labels=("worker",): CounterMetricFamily(name, doc, labels=labels)
        beats = count("dspark_worker_heartbeats", "Heartbeats since the worker booted")
        # the worker's random boot id: a change between two scrapes means the counters restarted
        boot = fam("dspark_worker_boot", "Boot id of the worker process (changes on restart)")
        spec = {k: count(f"dspark_spec_{k}", doc) for k, (_, doc) in _SPEC_COUNTERS.items()}
        pos = ("worker", "position")
        at_risk = count("dspark_spec_at_risk", "Rounds that verified a position", pos)
        passed = count("dspark_spec_passed", "Rounds that verified and accepted a position", pos)
        for w in r.workers.values():
            up.add_metric([w.name], float(w.accepted))
            for k, f in _WORKER_GAUGES.items():
                if w.hb is not None:
                    gauges[k].add_metric([w.name], getattr(w.hb, f))
            for i, a in enumerate(w.hb.acceptance if w.hb else ()):
                if a >= 0:
                    acc.add_metric([w.name, str(i + 1)], a)
            hb = w.hb
            if hb is None or hb.counts is None:
                continue
            c = hb.counts
            beats.add_metric([w.name], hb.beats)
            boot.add_metric([w.name], float(hb.boot))
            for k, (f, _) in _SPEC_COUNTERS.items():
                spec[k].add_metric([w.name], getattr(c, f))
            for i, (n, p) in enumerate(zip(c.at_risk, c.passed, strict=True)):
                at_risk.add_metric([w.name, str(i + 1)], n)
                passed.add_metric([w.name, str(i + 1)], p)
        yield from (up, *gauges.values(), acc, beats, boot, *spec.values(), at_risk, passed)

    def observe_request(self, job: Job, d: m.Delta) -> None:
        now = time.monotonic()
        self.requests.labels(d.finish_reason or "stop").inc()
        self.ttft.observe(job.first_at - job.created)
        self.e2e.observe(now - job.created)
        if d.num_output > 1:
            self.tpot.observe((now - job.first_at) / (d.num_output - 1))
        self.prompt_tokens.inc(len(job.prompt_ids))
        self.gen_tokens.inc(d.num_output)
        if d.spec_rounds:
            self.accept.observe(_accept_length(d))


def _accept_length(d: m.Delta) -> float:
    return (d.num_output - 1) / d.spec_rounds if d.spec_rounds else 1.0


# -- OpenAI request bodies -------------------------------------------------------------------
class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class StreamOptions(_Strict):
    include_usage: bool = False
    # vLLM's and SGLang's extension: usage (cumulative) on every chunk, not only after the last;
    # load generators time tokens, not chunks, with it (a speculative step streams several)
    continuous_usage_stats: bool = False


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class ChatMessage(_Strict):
    role: Literal["system", "user", "assistant"]
    content: str | list[TextPart]
    name: str | None = None


class _Body(_Strict):
    model: str | None = None
    max_tokens: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] = []
    ignore_eos: bool = False
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    n: int = 1
    logprobs: bool | int | None = None


class CompletionBody(_Body):
    prompt: str | list[int] | list[str]
    best_of: int | None = None
    echo: bool = False


class ChatBody(_Body):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None


# Fields we accept only at their no-op values, so common clients and benchmarks work unchanged.
_NEUTRAL = {"n": (1,), "best_of": (None, 1), "echo": (False,), "logprobs": (None, False, 0)}


# -- the app ---------------------------------------------------------------------------------
class Api:
    def __init__(self, cfg: Config) -> None:
        self.cfg = cfg
        arch = ArchConfig.from_model_path(cfg.model.path)
        self.vocab = arch.vocab_size
        self.max_len = cfg.model.max_model_len or arch.max_position_embeddings
        self.name = cfg.serve.served_model_name or Path(cfg.model.path).name
        tok = Path(cfg.model.path) / "tokenizer.json"
        self.tokenizer = Tokenizer.from_file(str(tok)) if tok.is_file() else None
        self.metrics = Metrics()
        self.router = self.metrics.router = Router(cfg, m.expected_handshake(cfg), self.metrics)

    def params(self, body: _Body, n_prompt: int, max_tokens: int | None) -> SamplingParams:
        for k, ok in _NEUTRAL.items():
            v = getattr(body, k, ok[0])
            if v not in ok:
                raise ApiError(400, f"{k}={v!r} is not supported (allowed: {list(ok)})")
        if body.model not in (None, self.name, self.cfg.model.path):
            raise ApiError(404, f"model {body.model!r} not found; this server serves {self.name!r}")
        if n_prompt == 0:
            raise ApiError(400, "prompt is empty")
        if max_tokens is None:
            max_tokens = 16 if isinstance(body, CompletionBody) else self.max_len - n_prompt
        if max_tokens < 1 or n_prompt + max_tokens > self.max_len:
            need = f"prompt ({n_prompt} tokens) + max_tokens ({max_tokens})"
            raise ApiError(
                400,
                f"max_tokens must be >= 1 and {need} must fit the context length {self.max_len}",
            )
        stop = (body.stop,) if isinstance(body.stop, str) else tuple(body.stop or ())
        for s in stop:
            _unicode(s, "stop")
        same = body.model_dump(include={"temperature", "top_p", "top_k", "ignore_eos"})
        if same["top_k"] >= self.vocab:  # keeps every token: no filter (and no int64 overflow)
            same["top_k"] = 0
        ids = tuple(body.stop_token_ids)
        if any(not 0 <= t < self.vocab for t in ids):
            raise ApiError(400, f"stop_token_ids must be in [0, {self.vocab})")
        # Seed every request here: workers of one config would otherwise draw equal seeds, and
        # a retried request replays the same random stream.
        seed = secrets.randbits(62) if body.seed is None else body.seed
        try:
            return SamplingParams(
                **same, seed=seed, max_tokens=max_tokens, stop=stop, stop_token_ids=ids
            )
        except ConfigError as e:
            raise ApiError(400, str(e)) from None

    def encode(self, text: str) -> list[int]:
        if self.tokenizer is None:
            raise ApiError(400, "the model folder has no tokenizer.json; send token ids")
        return self.tokenizer.encode(_unicode(text, "prompt"), add_special_tokens=False).ids

    def completion_job(self, body: CompletionBody) -> Job:
        p = body.prompt
        if isinstance(p, list) and p and isinstance(p[0], str):
            if len(p) != 1:
                raise ApiError(400, "batched prompts are not supported; send one per request")
            p = p[0]
        ids = self.encode(p) if isinstance(p, str) else list(p)
        if any(not 0 <= t < self.vocab for t in ids):
            raise ApiError(400, f"prompt token ids must be in [0, {self.vocab})")
        return Job(ids, self.params(body, len(ids), body.max_tokens))

    def chat_job(self, body: ChatBody) -> Job:
        text_of = lambda c: c if isinstance(c, str) else "".join(t.text for t in c)
        msgs = [{"role": x.role, "content": text_of(x.content)} for x in body.messages]
        if not msgs:
            raise ApiError(400, "messages must not be empty")
        try:
            text = render_chat(self.cfg.model.path, msgs, add_generation_prompt=True)
        except (ConfigError, jinja2.TemplateError) as e:
            raise ApiError(400, f"chat template: {e}") from None
        ids = self.encode(text)
        return Job(ids, self.params(body, len(ids), body.max_completion_tokens or body.max_tokens))

    async def events(self, job: Job, request: Request) -> AsyncIterator[m.Delta]:
        """The job's deltas until its last; ends it on timeout or a vanished client."""
        deadline = job.created + self.cfg.serve.request_timeout_s
        check = time.monotonic() + 1.0  # deltas may never pause, so poll the client by clock
        while True:
            now = time.monotonic()
            if now >= check:
                check = now + 1.0
                if await request.is_disconnected():
                    return  # the caller's release() counts it
            try:
                d = await asyncio.wait_for(job.events.get(), max(0, min(check, deadline) - now))
            except TimeoutError:
                if time.monotonic() >= deadline:
                    self.router.release(job, "timeout")
                    yield m.Delta(job.uid, [], "", True, error="request timed out", status=504)
                    return
                continue
            yield d
            if d.finished:
                return


def _unicode(text: str, what: str) -> str:
    # JSON escapes can carry lone surrogates, which no tokenizer or UTF-8 encoder accepts.
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ApiError(400, f"{what} has a lone surrogate at position {e.start}") from None
    return text


def _err(status: int, message: str, retry_after: int | None = None) -> JSONResponse:
    kind = "invalid_request_error" if status < 500 else "server_error"
    message = message.encode("utf-8", "backslashreplace").decode()  # it may quote the input
    headers = {"Retry-After": str(retry_after)} if retry_after else None
    body = {"error": {"message": message, "type": kind, "code": status}}
    return JSONResponse(body, status_code=status, headers=headers)


class _Guard:
    """API key on every route but /health, and a body-size cap (declared or streamed). Plain
    ASGI, not BaseHTTPMiddleware, which would hide client disconnects from the endpoints."""

    def __init__(self, app: Any, api_key: str | None) -> None:
        self.app, self.key = app, api_key

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] == "http":
            h = dict(scope["headers"])
            auth = h.get(b"authorization", b"")
            if (
                self.key
                and scope["path"] != "/health"
                and not hmac.compare_digest(auth, f"Bearer {self.key}".encode())
            ):
                err = _err(401, "missing or wrong API key (Authorization: Bearer ...)")
                return await err(scope, receive, send)
            size = h.get(b"content-length", b"")
            if size.isdigit() and int(size) > MAX_BODY_BYTES:
                return await _err(413, f"body over {MAX_BODY_BYTES} bytes")(scope, receive, send)
            receive = _capped(receive)
        await self.app(scope, receive, send)


def _capped(receive: Any) -> Any:
    """`receive` that stops a body without Content-Length (chunked) at MAX_BODY_BYTES."""
    seen = 0

    async def capped() -> dict:
        nonlocal seen
        msg = await receive()
        seen += len(msg.get("body", b""))
        if seen > MAX_BODY_BYTES:  # FastAPI re-raises an HTTPException from the body read
            raise HTTPException(413, f"body over {MAX_BODY_BYTES} bytes")
        return msg

    return capped


def create_app(cfg: Config) -> FastAPI:
    api = Api(cfg)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        api.router.start(asyncio.get_running_loop())
        yield
        api.router.stop()

    app = FastAPI(title="dspark-sglang", lifespan=lifespan)
    app.add_middleware(_Guard, api_key=cfg.serve.api_key)
    app.state.api = api

    @app.exception_handler(ApiError)
    async def _api_error(_: Request, e: ApiError) -> JSONResponse:
        return _err(e.status, e.message, e.retry_after)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, e: StarletteHTTPException) -> JSONResponse:
        # 404, 405, 413 and unparseable bodies get the same error shape as everything else.
        r = _err(e.status_code, str(e.detail))
        r.headers.update(e.headers or {})
        return r

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, e: RequestValidationError) -> JSONResponse:
        x = e.errors()[0]
        where = ".".join(str(p) for p in x.get("loc", ()) if p != "body")
        return _err(400, f"{where}: {x.get('msg')}" if where else str(x.get("msg")))

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/ready")
    async def ready() -> JSONResponse:
        ws = api.router.workers.values()
        workers = {w.name: "up" if w.accepted else w.refused or "down" for w in ws}
        status = 200 if api.router.ready else 503
        return JSONResponse({"ready": status == 200, "workers": workers}, status_code=status)

    @app.get("/metrics")
    async def metrics() -> Response:
        text = prom.generate_latest(api.metrics.registry)
        return Response(text, media_type=prom.CONTENT_TYPE_LATEST)

    @app.get("/capacity")
    async def capacity(format: str = "json", worker: str | None = None) -> Response:
        """The capacity model each decode worker's planner prices steps with, as its live
        estimator last published it (docs/capacity.md). format=profile: one worker's model as an
        engine profile (YAML) that --capacity-profile starts an engine from."""
        if format not in ("json", "profile"):
            return _err(400, f"format: expected 'json' or 'profile', got {format!r}")
        have = {w.name: w.capacity for w in api.router.workers.values() if w.capacity}
        if worker is not None:
            if worker not in api.router.workers:
                return _err(404, f"worker: no worker named {worker!r}")
            have = {k: v for k, v in have.items() if k == worker}
        if not have:
            return _err(
                404, "no capacity model: no worker runs a capacity-driven schedule (lagged, sync)"
            )
        if format == "json":
            return JSONResponse({"workers": have})
        if len(have) > 1:
            return _err(400, f"worker: name one of {sorted(have)} for format=profile")
        (got,) = have.values()
        text = yaml.safe_dump(got["profile"], sort_keys=False, width=100)
        return Response(PROFILE_HEADER + text, media_type="application/yaml")

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        card = dict(
            id=api.name,
            object="model",
            created=0,
            owned_by="dspark-sglang",
            max_model_len=api.max_len,
        )
        return {"object": "list", "data": [card]}

    @app.post("/v1/completions")
    async def completions(body: CompletionBody, request: Request) -> Response:
        return await _serve(api, api.completion_job(body), body, request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat(body: ChatBody, request: Request) -> Response:
        return await _serve(api, api.chat_job(body), body, request, chat=True)

    return app


async def _serve(api: Api, job: Job, body: _Body, request: Request, chat: bool) -> Response:
    api.router.submit(job)
    rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex[:24]}"
    head = {"id": rid, "created": int(time.time()), "model": api.name}
    if body.stream:
        opts = body.stream_options
        usage = opts is not None and opts.include_usage
        every = usage and opts is not None and opts.continuous_usage_stats
        gen = _sse(api, job, request, head, chat, usage, every)
        return StreamingResponse(gen, media_type="text/event-stream")
    text, last = [], None
    try:
        async for d in api.events(job, request):
            if d.error is not None:
                return _err(d.status, d.error)
            text.append(d.text)
            last = d
    finally:
        api.router.release(job)
    if last is None:  # the client went away
        return Response(status_code=499)
    out = "".join(text)
    choice = {"message": {"role": "assistant", "content": out}} if chat else {"text": out}
    choice.update(index=0, logprobs=None, finish_reason=last.finish_reason)
    kind = "chat.completion" if chat else "text_completion"
    return JSONResponse({**head, "object": kind, "choices": [choice], **_extras(job, last)})


def _extras(job: Job, d: m.Delta) -> dict[str, Any]:
    n, k = len(job.prompt_ids), d.num_output
    usage = dict(prompt_tokens=n, completion_tokens=k, total_tokens=n + k)
    ext = dict(
        accept_length=_accept_length(d),
        spec_rounds=d.spec_rounds,
        spec_accepted=d.spec_accepted,
        prefill=job.prefill.name,
        decode=job.decode.name,
        attempts=job.attempts,
    )
    return {"usage": usage, "dspark": ext}


async def _sse(
    api: Api,
    job: Job,
    request: Request,
    head: dict[str, Any],
    chat: bool,
    usage: bool,
    every: bool = False,
) -> AsyncIterator[str]:
    kind = "chat.completion.chunk" if chat else "text_completion"

    def chunk(delta: dict | str, reason: str | None = None, **extra: Any) -> str:
        c = {
            "index": 0,
            ("delta" if chat else "text"): delta,
            "logprobs": None,
            "finish_reason": reason,
        }
        return _data({**head, "object": kind, "choices": [c], **extra})

    text = (lambda t: {"content": t} if t else {}) if chat else (lambda t: t)
    n_in, n_out = len(job.prompt_ids), 0

    def running() -> dict[str, Any]:  # continuous usage: the counts so far
        if not every:
            return {}
        return {
            "usage": dict(prompt_tokens=n_in, completion_tokens=n_out, total_tokens=n_in + n_out)
        }

    try:
        if chat:
            yield chunk({"role": "assistant", "content": ""}, **running())
        async for d in api.events(job, request):
            if d.error is not None:
                err = {"message": d.error, "type": "server_error", "code": d.status}
                yield _data({"error": err})  # the openai client raises APIError on this
                break
            n_out += len(d.token_ids)
            if d.finished:
                ext = _extras(job, d)
                n_out = max(n_out, d.num_output)
                yield chunk(text(d.text), d.finish_reason, dspark=ext["dspark"], **running())
                if usage:
                    yield _data({**head, "object": kind, "choices": [], "usage": ext["usage"]})
            elif d.text:
                yield chunk(text(d.text), **running())
        yield "data: [DONE]\n\n"
    finally:
        api.router.release(job)


def _data(obj: dict[str, Any]) -> str:
    return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n"
