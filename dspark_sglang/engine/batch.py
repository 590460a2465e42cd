"""ForwardBatch: one forward's tensors, built from a StepPlan and the sequences in one pass."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dspark_sglang.engine.kv_cache import slots
from dspark_sglang.engine.sequence import Sequence
from dspark_sglang.models.attention import AttentionMetadata
from dspark_sglang.types import StepPlan


@dataclass
class ForwardBatch:
    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    attn: AttentionMetadata
    sample_rows: torch.Tensor  # rows scored: the last 1 + l rows of each sampling sequence
    sample_seq_ids: list[int]  # the sampling sequences, in row order
    sample_counts: list[int]  # rows per sampling sequence (1 + l)
    num_tokens: int
    kv_tokens: int  # context positions attended, summed over sequences


def build_batch(
    plan: StepPlan, seqs: dict[int, Sequence], page_size: int, device: str
) -> ForwardBatch:
    ids: list[int] = []
    pos: list[int] = []
    slot_mapping: list[int] = []
    q_seq: list[int] = []
    q_off: list[int] = []
    sample_rows: list[int] = []
    sample_ids: list[int] = []
    sample_counts: list[int] = []
    ctx_lens = [s.start_pos + s.num_new_tokens for s in plan.seqs]
    max_q = max(s.num_new_tokens for s in plan.seqs)
    max_kv = max(ctx_lens)
    kv_slots = torch.zeros(len(plan.seqs), max_kv, dtype=torch.long)
    for r, s in enumerate(plan.seqs):
        seq = seqs[s.seq_id]
        end = s.start_pos + s.num_new_tokens
        ids += seq.tokens(s.start_pos, end - len(s.draft_ids)) + list(s.draft_ids)
        pos += range(s.start_pos, end)
        slot_mapping += slots(seq.block_table, s.start_pos, end, page_size)
        q_seq += [r] * s.num_new_tokens
        q_off += range(s.num_new_tokens)
        kv_slots[r, :end] = torch.tensor(slots(seq.block_table, 0, end, page_size))
        if s.sample:
            sample_rows += range(len(ids) - s.num_sample_rows, len(ids))
            sample_ids.append(s.seq_id)
            sample_counts.append(s.num_sample_rows)
    starts = torch.tensor([s.start_pos for s in plan.seqs])
    q_lens = torch.tensor([s.num_new_tokens for s in plan.seqs])
    qi = torch.arange(max_q)
    kj = torch.arange(max_kv)
    causal = kj[None, None, :] <= (starts[:, None, None] + qi[None, :, None])  # [R, Qmax, Lmax]
    # Padding query rows attend to key 0 so SDPA never sees an all-masked row (NaN); they are
    # dropped when the output is gathered back to the flat layout.
    pad_q = (qi[None, :] >= q_lens[:, None])[:, :, None] & (kj == 0)[None, None, :]
    mask = (causal & (qi[None, :] < q_lens[:, None])[:, :, None]) | pad_q
    attn = AttentionMetadata(
        slot_mapping=torch.tensor(slot_mapping, dtype=torch.long, device=device),
        q_seq=torch.tensor(q_seq, dtype=torch.long, device=device),
        q_off=torch.tensor(q_off, dtype=torch.long, device=device),
        kv_slots=kv_slots.to(device),
        mask=mask[:, None].to(device),
        num_seqs=len(plan.seqs),
        max_q=max_q,
    )
    return ForwardBatch(
        input_ids=torch.tensor(ids, dtype=torch.long, device=device),
        positions=torch.tensor(pos, dtype=torch.long, device=device),
        attn=attn,
        sample_rows=torch.tensor(sample_rows, dtype=torch.long, device=device),
        sample_seq_ids=sample_ids,
        sample_counts=sample_counts,
        num_tokens=len(ids),
        kv_tokens=sum(ctx_lens),
    )
