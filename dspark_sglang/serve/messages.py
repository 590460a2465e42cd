"""Every cross-process message as a msgspec Struct, and the one codec (msgpack header + raw frames).

Tensors travel as raw frames described by `TensorMeta`; nothing is pickled. No torch, no zmq.
"""

from __future__ import annotations

import hashlib
import json
import math
from pathlib import Path
from typing import Any

import msgspec

from dspark_sglang.config import ArchConfig, Config, DraftArch
from dspark_sglang.types import SamplingParams

PROTOCOL_VERSION = 1
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "uint8": 1, "int64": 8}


class BadMessage(ValueError):
    """A frame set that does not decode to a well-formed message; the receiver drops it."""


class Handshake(msgspec.Struct, frozen=True):
    """What two processes must agree on before KV pages may flow between them."""

    version: int
    model_id: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    page_size: int
    dtype: str
    draft_taps: tuple[int, ...]
    draft_hidden: int  # width of the projected drafter context C; 0 without a drafter
    gamma: int


class TensorMeta(msgspec.Struct, frozen=True):
    dtype: str
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return DTYPE_BYTES[self.dtype] * math.prod(self.shape)


class Request(msgspec.Struct, tag=True):
    """router -> prefill: one dispatch attempt; `decode` indexes ServeConfig.decode_addrs."""

    uid: int
    prompt_ids: list[int]
    params: SamplingParams
    decode: int


class Handoff(msgspec.Struct, tag=True):
    """prefill -> decode: frames follow in `tensors` order: kv, rng_state[, draft_ctx]."""

    uid: int
    prompt_ids: list[int]
    first_token: int
    first_text: str  # the first token's text as the prefill engine detokenized it
    params: SamplingParams
    tensors: list[TensorMeta]


class Delta(msgspec.Struct):
    """New tokens of one request; the last one has `finished` and the request's totals."""

    uid: int
    token_ids: list[int]
    text: str
    finished: bool = False
    finish_reason: str | None = None
    error: str | None = None
    status: int = 0  # HTTP status of an error: 4xx = the request's fault, 5xx = retryable
    num_output: int = 0
    spec_rounds: int = 0
    spec_accepted: int = 0


class Deltas(msgspec.Struct, tag=True):
    """worker -> router: every delta of one engine step in one message."""

    worker: str
    items: list[Delta]


class Abort(msgspec.Struct, tag=True):
    """router -> workers: the only backward message; frees the request's KV wherever it is."""

    uid: int


class SpecCounts(msgspec.Struct):
    """A worker's speculation counters since it booted (engine SpecStats). The heartbeat's tau
    and acceptance are ratios of these, so they pool every load the worker has served; a client
    that differences two scrapes gets exact values for what it sent in between."""

    rounds: int = 0  # decode verify rounds, one per request per speculative step
    committed: int = 0  # tokens those rounds committed (accept length = committed / rounds)
    verified: int = 0  # drafts sent to the target (the K of every step, summed)
    accepted: int = 0  # drafts accepted
    verify_tokens: int = 0  # target rows of the verify sequences: sum of 1 + l over rounds
    steps: int = 0  # speculative steps (lagged K = 0 steps included)
    at_risk: list[int] = []  # per draft position: rounds that verified it, earlier ones accepted
    passed: list[int] = []  # ... and accepted it too


class Heartbeat(msgspec.Struct, tag=True):
    """worker -> router, every heartbeat_interval_s; a new `boot` is a restarted process."""

    worker: str
    boot: int
    hand: Handshake
    running: int
    waiting: int
    free_blocks: int
    total_blocks: int
    tau: float = 0.0
    verify_tokens_per_step: float = 0.0
    acceptance: list[float] = []  # conditional acceptance per draft position (-1: no data)
    # Means over the interval's steps (0 when idle); capacity_mape -1 without predictions.
    step_seconds: float = 0.0
    predicted_step_seconds: float = 0.0
    capacity_mape: float = -1.0
    verify_budget_k: float = 0.0
    fallbacks: dict[str, int] = {}  # planner fallbacks by reason, counted since the last beat
    # The decode worker's live capacity model when its version changed since the last beat:
    # {"version", "observed", "drift_events", "mape", "profile"} (GET /capacity).
    capacity: dict[str, Any] | None = None
    beats: int = 0  # heartbeats sent since boot, this one included
    counts: SpecCounts | None = None


class Refuse(msgspec.Struct, tag=True):
    """router -> worker: handshake mismatch; the worker exits with this reason."""

    reason: str


Message = Request | Handoff | Deltas | Abort | Heartbeat | Refuse
_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(Message)


def encode(msg: Message, buffers: list[memoryview] | tuple = ()) -> list[bytes | memoryview]:
    return [_encoder.encode(msg), *buffers]


def decode(frames: list[memoryview | bytes]) -> tuple[Message, list[memoryview | bytes]]:
    """-> (message, tensor frames), checked against the message's TensorMeta list."""
    if not frames:
        raise BadMessage("empty message")
    try:
        msg = _decoder.decode(frames[0])
    except (msgspec.DecodeError, msgspec.ValidationError, ValueError) as e:
        raise BadMessage(f"undecodable header: {e}") from None
    if isinstance(msg, Request | Handoff) and msg.params.top_k >= 2**63:
        # SamplingParams bounds top_k below only; the sampler packs it into an int64 tensor.
        raise BadMessage(f"top_k {msg.params.top_k} does not fit int64")
    metas = msg.tensors if isinstance(msg, Handoff) else []
    rest = frames[1:]
    if len(rest) != len(metas):
        raise BadMessage(f"{type(msg).__name__} has {len(rest)} frames, expected {len(metas)}")
    for meta, f in zip(metas, rest, strict=True):
        if meta.dtype not in DTYPE_BYTES or any(d < 0 for d in meta.shape):
            raise BadMessage(f"bad tensor header {meta}")
        if meta.nbytes != memoryview(f).nbytes:
            raise BadMessage(f"tensor frame of {memoryview(f).nbytes} bytes, header says {meta}")
    return msg, rest


def model_id(model_path: str, served_name: str | None) -> str:
    """Served name plus a digest of config.json: same name on different weights is refused."""
    cfg = Path(model_path) / "config.json"
    digest = hashlib.sha256(cfg.read_bytes()).hexdigest()[:12] if cfg.is_file() else "none"
    return f"{served_name or Path(model_path).name}@{digest}"


def expected_handshake(cfg: Config) -> Handshake:
    """The router's view, read from the model folders without loading weights (no torch)."""
    arch = ArchConfig.from_model_path(cfg.model.path)
    taps, hidden, gamma = (), 0, 0
    if cfg.draft.enabled:
        d = DraftArch.from_hf_dict(json.loads((Path(cfg.draft.path) / "config.json").read_text()))
        taps, hidden = d.target_layer_ids, d.hidden_size
        gamma = min(cfg.draft.num_speculative_tokens or d.block_size, d.block_size)
    return Handshake(
        version=PROTOCOL_VERSION,
        model_id=model_id(cfg.model.path, cfg.serve.served_model_name),
        num_layers=arch.num_hidden_layers,
        num_kv_heads=arch.num_key_value_heads,
        head_dim=arch.head_dim,
        page_size=cfg.cache.page_size,
        dtype=cfg.model.dtype,
        draft_taps=tuple(taps),
        draft_hidden=hidden,
        gamma=gamma,
    )


def handshake_mismatch(mine: Handshake, theirs: Handshake) -> str | None:
    """None when compatible, else a message naming the first differing field."""
    for name in Handshake.__struct_fields__:
        a, b = getattr(mine, name), getattr(theirs, name)
        if a != b:
            return f"handshake mismatch: {name} is {a!r} on the router but {b!r} on the worker"
    return None
