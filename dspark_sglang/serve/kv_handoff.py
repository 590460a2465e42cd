"""SeqHandoff <-> (Handoff message, raw tensor frames), and what a handoff costs in bytes.

Frames are the tensors' own memory (no copy on send, zero-copy views on receive).
"""

from __future__ import annotations

import warnings

import torch

from dspark_sglang.config import ArchConfig, ConfigError, DraftArch
from dspark_sglang.engine.handoff import SeqHandoff
from dspark_sglang.serve.messages import Handoff, TensorMeta


def _frame(t: torch.Tensor) -> tuple[TensorMeta, memoryview]:
    t = t.detach().cpu().contiguous()
    meta = TensorMeta(str(t.dtype).removeprefix("torch."), tuple(t.shape))
    # Reinterpret as bytes: numpy has no bfloat16, but a uint8 view of any dtype is free.
    return meta, memoryview(t.view(torch.uint8).numpy()).cast("B")


def _tensor(meta: TensorMeta, buf: memoryview | bytes) -> torch.Tensor:
    with warnings.catch_warnings():  # read-only frame memory; the engine copies it into its KV
        warnings.simplefilter("ignore")
        flat = torch.frombuffer(buf, dtype=torch.uint8) if meta.nbytes else torch.empty(0)
    return flat.view(getattr(torch, meta.dtype)).reshape(meta.shape)


def pack(uid: int, h: SeqHandoff, first_text: str) -> tuple[Handoff, list[memoryview]]:
    tensors = [h.kv, h.rng_state] + ([h.draft_ctx] if h.draft_ctx is not None else [])
    metas, bufs = zip(*(_frame(t) for t in tensors), strict=True)
    msg = Handoff(uid, h.prompt_ids, h.first_token, first_text, h.params, list(metas))
    return msg, list(bufs)


def unpack(msg: Handoff, frames: list[memoryview | bytes]) -> SeqHandoff:
    if len(msg.tensors) not in (2, 3):
        raise ConfigError(f"handoff has {len(msg.tensors)} tensors, expected kv, rng[, ctx]")
    ts = [_tensor(m, f) for m, f in zip(msg.tensors, frames, strict=True)]
    return SeqHandoff(
        prompt_ids=msg.prompt_ids,
        first_token=msg.first_token,
        params=msg.params,
        kv=ts[0],
        rng_state=ts[1],
        draft_ctx=ts[2] if len(ts) > 2 else None,
    )


def check(h: SeqHandoff, vocab: int, device: str) -> None:
    """What adoption needs beyond SeqHandoff.validate's shapes, checked before the engine
    touches its KV: a prompt, token ids in the vocabulary, this device's RNG state size."""
    if not h.prompt_ids:
        raise ConfigError("handoff has an empty prompt")
    if any(not 0 <= t < vocab for t in (*h.prompt_ids, h.first_token)):
        raise ConfigError(f"handoff token ids out of range [0, {vocab})")
    for name, t in (("kv", h.kv), ("draft_ctx", h.draft_ctx)):
        if t is not None and not t.dtype.is_floating_point:
            raise ConfigError(f"handoff {name} has dtype {t.dtype}, expected a float type")
    want = torch.Generator(device=device).get_state()
    if h.rng_state.dtype != want.dtype or h.rng_state.shape != want.shape:
        got = (h.rng_state.dtype, tuple(h.rng_state.shape))
        raise ConfigError(f"handoff rng_state is {got}, expected {(want.dtype, tuple(want.shape))}")


def bytes_per_token(arch: ArchConfig, draft: DraftArch | None, itemsize: int) -> dict[str, int]:
    """Per prompt token: target KV, the projected context C we ship, and the drafter's per-layer
    context K/V we do not ship (DESIGN §2)."""
    kv = arch.num_hidden_layers * 2 * arch.num_key_value_heads * arch.head_dim * itemsize
    if draft is None:
        return {"target_kv": kv, "draft_ctx": 0, "draft_kv_alternative": 0}
    return {
        "target_kv": kv,
        "draft_ctx": draft.hidden_size * itemsize,
        "draft_kv_alternative": draft.num_layers
        * 2
        * draft.num_key_value_heads
        * draft.head_dim
        * itemsize,
    }
