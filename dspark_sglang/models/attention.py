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
class AttentionGroup:
    """Sequences padded together into one SDPA call.

    Region map of the padded layout: sequence r of the group owns query rows [0, q_len[r]) of
    q_pad[r] and key columns [0, kv_len[r]) of kv_slots[r]; key j holds position j of that
    sequence, so the causal rule is simply key j visible to query i iff j <= start_pos[r] + i.
    """

    rows: torch.Tensor | None  # [Tg] rows of the flat batch it owns; None = all, in order
    q_seq: torch.Tensor  # [Tg] which of the group's sequences a new token belongs to
    q_off: torch.Tensor  # [Tg] its offset among that sequence's new tokens
    kv_slots: torch.Tensor  # [Rg, Lg] flat KV slot of each context position (masked past kv_len)
    mask: torch.Tensor  # [Rg, 1, Qg, Lg] bool, True = attend
    num_seqs: int
    max_q: int


@dataclass
class AttentionMetadata:
    """Index tensors for one ragged forward of T new tokens from R sequences.

    The sequences are split into groups of similar length (`padding_groups`) so a short
    context is never padded to the batch's longest one: a step costs about the summed context,
    which is what the capacity model's context term prices.
    """

    slot_mapping: torch.Tensor  # [T] flat KV slot each new token is written to
    groups: list[AttentionGroup]


# Sequences with more new tokens than this are prefill chunks: their query padding matters too.
PREFILL_Q = 16
# A group admits a sequence whose context (and, for prefill chunks, query count) is at least
# its longest one's divided by this, so padding adds at most a quarter to a group's work. At 2
# a decode batch of the held-out prompts (35-540 tokens) gathered 1.41x its real context; 1.25
# cut an R = 64 forward and a prefill by ~6 % (docs/engine.md "Why groups").
PAD_RATIO = 1.25
# Verify rows (2 … PREFILL_Q new tokens) group by query count too: a group admits a row whose
# count is at least its largest one's divided by this. A ragged verify (lagged or sync top-K:
# some rows 8 tokens, most fewer) padded every row to the longest one, so its attention cost
# what verifying every draft does: served, sweep 58ddf7a, lagged's R = 64 steps at B = 316 ran
# their forward in 48.5 ms, fixed:3's uniform B = 254 in 37.2 and verify-all's B = 502 in 51.9.
# In-process (R = 64, top-K lengths, B = 192): 36.5 -> 27.6 ms a forward, attention 19.2 -> 11.7
# ms; 4/3 cut 5 % more than 2, and exact counts (1) nothing more than 4/3.
VERIFY_Q_RATIO = 4.0 / 3.0
# Groups padded to fewer (query + 1) x key cells than this are merged with their neighbour:
# below it one more SDPA call costs more than the padding it saves.
MIN_GROUP_CELLS = 4096
MAX_GROUPS = 16  # the rest pads into the last group (bounds per-forward dispatch)


def padding_groups(q_lens: list[int], kv_lens: list[int]) -> list[list[int]]:
    """Partition sequence indices into groups padded together (each group in admission order: most
    queries, then longest context, first).

    Every group pads its rows to its longest context (within PAD_RATIO). Prefill chunks also
    group by query count within PAD_RATIO; decode and verify rows (few new tokens) by query count
    within VERIFY_Q_RATIO, largest counts first, so decode rows (one token) never pad to a verify
    row's. Pure: ints in, ints out.
    """
    order = sorted(
        range(len(q_lens)),
        key=lambda r: (
            q_lens[r] > PREFILL_Q,
            q_lens[r] if q_lens[r] <= PREFILL_Q else 0,  # prefill: by context first, as before
            kv_lens[r],
            q_lens[r],
        ),
        reverse=True,
    )
    groups: list[list[int]] = []
    top_q = top_l = 0
    for r in order:
        q, kv = q_lens[r], kv_lens[r]
        fits = (
            groups
            and (q > PREFILL_Q) == (top_q > PREFILL_Q)
            and top_l >= kv  # by query count first: a longer context can follow a shorter one
            and kv * PAD_RATIO >= top_l
            and q * (PAD_RATIO if q > PREFILL_Q else VERIFY_Q_RATIO) >= top_q
        )
        if fits:
            groups[-1].append(r)
            continue
        small = _cells(groups[-1], q_lens, kv_lens) < MIN_GROUP_CELLS if groups else False
        # too small to run alone (or enough calls): pad into it, unless this row's context would
        # pad the group's more than PAD_RATIO
        if groups and (len(groups) == MAX_GROUPS or (small and kv <= top_l * PAD_RATIO)):
            groups[-1].append(r)
            continue
        groups.append([r])
        top_q, top_l = q, kv
    return groups


def _cells(group: list[int], q_lens: list[int], kv_lens: list[int]) -> int:
    return len(group) * (max(q_lens[r] for r in group) + 1) * max(kv_lens[r] for r in group)


@dataclass
class ForwardContext:
    """Everything one forward needs besides token ids and positions; set for exactly one call."""

    attn: AttentionMetadata
    # Per layer, each [num_slots, h_kv, d]. None = no cache (training, full recompute): the
    # metadata's slots then index the batch's own rows (see packed_causal_metadata).
    kv_caches: list[tuple[torch.Tensor, torch.Tensor]] | None
    # rows whose hidden-state taps are returned; slice(None): every row, as views (no gather)
    tap_rows: torch.Tensor | slice | None = None
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


def ragged_metadata(
    start_pos: list[int],
    q_lens: list[int],
    slot_table: torch.Tensor,
    slot_mapping: torch.Tensor,
    device: str | torch.device,
) -> AttentionMetadata:
    """Metadata for sequences whose new tokens sit back to back in the flat batch: sequence r
    has q_lens[r] new tokens at positions start_pos[r].., and position j of its context (cached
    prefix and new tokens) lives at flat slot slot_table[r, j] (CPU, [R, >= the longest
    context]; columns past a sequence's context hold any valid slot: the mask hides them)."""
    kv_lens = [s + q for s, q in zip(start_pos, q_lens, strict=True)]
    first_row = [0]
    for q in q_lens[:-1]:
        first_row.append(first_row[-1] + q)
    groups = padding_groups(q_lens, kv_lens)
    if len(groups) == 1:  # the flat order itself: no row gather
        return AttentionMetadata(
            slot_mapping, [_group(sorted(groups[0]), start_pos, q_lens, slot_table, None, device)]
        )
    return AttentionMetadata(
        slot_mapping,
        [_group(g, start_pos, q_lens, slot_table, first_row, device) for g in groups],
    )


def _group(
    members: list[int],
    start_pos: list[int],
    q_lens: list[int],
    slot_table: torch.Tensor,
    first_row: list[int] | None,
    device: str | torch.device,
) -> AttentionGroup:
    qs = [q_lens[r] for r in members]
    max_q = max(qs)
    max_kv = max(start_pos[r] + q_lens[r] for r in members)
    if members == list(range(slot_table.shape[0])):
        kv_slots = slot_table[:, :max_kv]
    else:
        kv_slots = slot_table[torch.tensor(members), :max_kv]
    rows = None
    if first_row is not None:
        rows = torch.tensor(
            [first_row[r] + j for r in members for j in range(q_lens[r])], dtype=torch.long
        ).to(device)
    starts = torch.tensor([start_pos[r] for r in members])
    kj = torch.arange(max_kv)
    if max_q == 1:  # decode rows only: key j visible iff j <= start (no padded queries)
        seq = torch.arange(len(members))
        return AttentionGroup(
            rows=rows,
            q_seq=seq.to(device),
            q_off=torch.zeros_like(seq).to(device),
            kv_slots=kv_slots.to(device),
            mask=(kj[None, :] <= starts[:, None])[:, None, None].to(device),
            num_seqs=len(members),
            max_q=1,
        )
    q_len_t = torch.tensor(qs)
    qi = torch.arange(max_q)
    causal = kj[None, None, :] <= (starts[:, None, None] + qi[None, :, None])  # [Rg, Qg, Lg]
    # Padding query rows attend to key 0 so SDPA never sees an all-masked row (NaN); they are
    # dropped when the output is gathered back to the flat layout.
    pad_q = (qi[None, :] >= q_len_t[:, None])[:, :, None] & (kj == 0)[None, None, :]
    mask = (causal & (qi[None, :] < q_len_t[:, None])[:, :, None]) | pad_q
    return AttentionGroup(
        rows=rows,
        q_seq=torch.repeat_interleave(torch.arange(len(members)), q_len_t).to(device),
        q_off=torch.cat([torch.arange(q) for q in qs]).to(device),
        kv_slots=kv_slots.to(device),
        mask=mask[:, None].to(device),
        num_seqs=len(members),
        max_q=max_q,
    )


def packed_causal_metadata(seq_lens: list[int], device: str | torch.device) -> AttentionMetadata:
    """Causal attention within each of several packed sequences, no cache (training, parity):
    the slots index the batch's own rows."""
    first = [0]
    for n in seq_lens[:-1]:
        first.append(first[-1] + n)
    total = first[-1] + seq_lens[-1]
    # row r's position j at batch row first[r] + j; past its length any valid row (masked)
    table = (torch.tensor(first)[:, None] + torch.arange(max(seq_lens))).clamp_(max=total - 1)
    slot_mapping = torch.arange(total, device=device)
    return ragged_metadata([0] * len(seq_lens), list(seq_lens), table, slot_mapping, device)


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
        groups = meta.groups
        if len(groups) == 1 and groups[0].rows is None:
            return self._attend(q, k_cache, v_cache, groups[0], scale)
        out = torch.empty_like(q)
        for g in groups:
            out[g.rows] = self._attend(q.index_select(0, g.rows), k_cache, v_cache, g, scale)
        return out

    @staticmethod
    def _attend(
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        g: AttentionGroup,
        scale: float,
    ) -> torch.Tensor:
        t, num_heads, head_dim = q.shape
        shape = (*g.kv_slots.shape, *k_cache.shape[1:])
        if g.max_q == 1:
            # Decode rows (one query each, in order): the heads that share a KV head attend as
            # that head's G query rows, so SDPA runs h_kv heads of G rows instead of expanding
            # K/V to h heads (R = 64, 200 context: 2.11 -> 1.87 ms a layer with the gather).
            h_kv = k_cache.shape[1]
            k = k_cache.index_select(0, g.kv_slots.reshape(-1)).view(shape)
            v = v_cache.index_select(0, g.kv_slots.reshape(-1)).view(shape)
            out = F.scaled_dot_product_attention(
                q.view(t, h_kv, num_heads // h_kv, head_dim),  # [Rg, h_kv, G, d]
                k.transpose(1, 2),
                v.transpose(1, 2),
                attn_mask=g.mask,  # [Rg, 1, 1, Lg]: the same for every query row
                scale=scale,
            )
            return out.reshape(t, num_heads, head_dim)
        q_pad = q.new_zeros(g.num_seqs, g.max_q, num_heads, head_dim)
        q_pad[g.q_seq, g.q_off] = q
        # index_select, not advanced indexing: the same rows, about 5x faster on CPU.
        k = k_cache.index_select(0, g.kv_slots.reshape(-1)).view(shape)  # [Rg, Lg, h_kv, d]
        v = v_cache.index_select(0, g.kv_slots.reshape(-1)).view(shape)
        out = F.scaled_dot_product_attention(
            q_pad.transpose(1, 2),  # [Rg, h, Qg, d]
            k.transpose(1, 2),
            v.transpose(1, 2),
            attn_mask=g.mask,
            scale=scale,
            enable_gqa=True,
        )  # [Rg, h, Qg, d]
        return out.transpose(1, 2)[g.q_seq, g.q_off]  # [Tg, h, d]


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
