"""Paged attention over a ragged batch, and the forward context that carries its metadata.

Every request contributes its own number of new tokens (a prefill chunk, one decode token or 1+l
verify tokens); each is causal among its new tokens and attends to its cached prefix. The
metadata is built by the engine once per forward; models read it through `forward_context`, so
layer signatures stay free of metadata. Imports nothing from engine/serve.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.nn import functional as F

from dspark_sglang.config import ArchConfig, ConfigError
from dspark_sglang.models.layers import RMSNorm, RotaryEmbedding


@dataclass
class AttentionMetadata:
    """Index tensors for one ragged forward of T new tokens from R sequences.

    Region map of the padded layout: sequence r owns query rows [0, q_len[r]) of q_pad[r] and key
    columns [0, kv_len[r]) of kv_slots[r]; key j holds position j of that sequence, so the causal
    rule is simply key j visible to query i iff j <= start_pos[r] + i.
    """

    slot_mapping: torch.Tensor  # [T] flat KV slot each new token is written to
    q_seq: torch.Tensor  # [T] which sequence a new token belongs to
    q_off: torch.Tensor  # [T] its offset among that sequence's new tokens
    kv_slots: torch.Tensor  # [R, Lmax] flat KV slot of each context position (0 = padding)
    mask: torch.Tensor  # [R, 1, Qmax, Lmax] bool, True = attend
    num_seqs: int
    max_q: int


@dataclass
class ForwardContext:
    """Everything one forward needs besides token ids and positions; set for exactly one call."""

    attn: AttentionMetadata
    # Per layer, each [num_slots, h_kv, d]. None = no cache (training, full recompute): the
    # metadata's slots then index the batch's own rows (see packed_causal_metadata).
    kv_caches: list[tuple[torch.Tensor, torch.Tensor]] | None
    tap_rows: torch.Tensor | None = None  # rows whose hidden-state taps are returned
    # MoE layers add their per-expert routed-token counts here (summed over layers).
    expert_counts: torch.Tensor | None = None
    extras: dict[str, object] = field(default_factory=dict)


_CTX: ForwardContext | None = None


@contextmanager
def forward_context(ctx: ForwardContext) -> Iterator[ForwardContext]:
    global _CTX
    if _CTX is not None:
        raise RuntimeError("nested forward contexts are not allowed")
    _CTX = ctx
    try:
        yield ctx
    finally:
        _CTX = None


def current_context() -> ForwardContext:
    if _CTX is None:
        raise RuntimeError("model forward called outside forward_context()")
    return _CTX


def packed_causal_metadata(seq_lens: list[int], device: str | torch.device) -> AttentionMetadata:
    """Causal attention within each of several packed sequences, no cache (training, parity)."""
    num, max_len = len(seq_lens), max(seq_lens)
    starts = torch.tensor([0, *seq_lens[:-1]]).cumsum(0)
    lens = torch.tensor(seq_lens)
    j = torch.arange(max_len)
    kv_slots = torch.where(j[None] < lens[:, None], starts[:, None] + j[None], 0)  # [R, Lmax]
    q_seq = torch.repeat_interleave(torch.arange(num), lens)
    q_off = torch.cat([torch.arange(n) for n in seq_lens])
    valid = j[None, :] < lens[:, None]  # [R, L]
    causal = j[None, None, :] <= j[None, :, None]  # [1, Q, L]
    pad_row = (~valid)[:, :, None] & (j == 0)[None, None, :]
    mask = (causal & valid[:, :, None]) | pad_row
    return AttentionMetadata(
        slot_mapping=torch.arange(int(lens.sum()), device=device),
        q_seq=q_seq.to(device),
        q_off=q_off.to(device),
        kv_slots=kv_slots.to(device),
        mask=mask[:, None].to(device),
        num_seqs=num,
        max_q=max_len,
    )


class TorchSDPABackend:
    """Gathers each sequence's context from the paged cache and runs masked SDPA (CPU and GPU).

    The GPU path plugs a flashinfer/triton backend in here with the same call signature.
    """

    name = "torch_sdpa"

    def forward(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        _, num_heads, head_dim = q.shape
        q_pad = q.new_zeros(meta.num_seqs, meta.max_q, num_heads, head_dim)
        q_pad[meta.q_seq, meta.q_off] = q
        k = k_cache[meta.kv_slots]  # [R, Lmax, h_kv, d]
        v = v_cache[meta.kv_slots]
        out = F.scaled_dot_product_attention(
            q_pad.transpose(1, 2),  # [R, h, Qmax, d]
            k.transpose(1, 2),
            v.transpose(1, 2),
            attn_mask=meta.mask,
            scale=scale,
            enable_gqa=True,
        )  # [R, h, Qmax, d]
        return out.transpose(1, 2)[meta.q_seq, meta.q_off]  # [T, h, d]


_BACKENDS = {TorchSDPABackend.name: TorchSDPABackend}


def create_backend(name: str) -> TorchSDPABackend:
    if name not in _BACKENDS:
        raise ConfigError(f"unknown attention backend {name!r}; available: {sorted(_BACKENDS)}")
    return _BACKENDS[name]()


class Qwen3Attention(nn.Module):
    def __init__(self, cfg: ArchConfig, layer_id: int, backend: TorchSDPABackend) -> None:
        super().__init__()
        self.layer_id = layer_id
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = cfg.num_key_value_heads
        self.head_dim = cfg.head_dim
        bias = cfg.attention_bias
        h, d = cfg.hidden_size, cfg.head_dim
        self.q_proj = nn.Linear(h, self.num_heads * d, bias=bias)
        self.k_proj = nn.Linear(h, self.num_kv_heads * d, bias=bias)
        self.v_proj = nn.Linear(h, self.num_kv_heads * d, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * d, h, bias=bias)
        self.q_norm = RMSNorm(d, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(d, cfg.rms_norm_eps)
        self.rotary = RotaryEmbedding(d, cfg.rope_theta)
        self.backend = backend
        self.scale = d**-0.5

    def forward(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        ctx = current_context()
        t = x.shape[0]
        q = self.q_norm(self.q_proj(x).view(t, self.num_heads, self.head_dim))  # [T, h, d]
        k = self.k_norm(self.k_proj(x).view(t, self.num_kv_heads, self.head_dim))  # [T, h_kv, d]
        v = self.v_proj(x).view(t, self.num_kv_heads, self.head_dim)
        q, k = self.rotary(positions, q, k)
        if ctx.kv_caches is None:
            k_cache, v_cache = k, v
        else:
            k_cache, v_cache = ctx.kv_caches[self.layer_id]
            # Write first, then read: the new tokens attend to themselves through the cache.
            k_cache[ctx.attn.slot_mapping] = k.to(k_cache.dtype)
            v_cache[ctx.attn.slot_mapping] = v.to(v_cache.dtype)
        out = self.backend.forward(q, k_cache, v_cache, ctx.attn, self.scale)
        return self.o_proj(out.reshape(t, self.num_heads * self.head_dim))
