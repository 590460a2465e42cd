"""ForwardBatch: one forward's tensors, built from a StepPlan and the sequences in one pass."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dspark_sglang.engine.kv_cache import slots
from dspark_sglang.engine.sequence import Sequence
from dspark_sglang.models.attention import AttentionMetadata, ragged_metadata
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
    kv_slot_rows: list[list[int]] = []
    sample_rows: list[int] = []
    sample_ids: list[int] = []
    sample_counts: list[int] = []
    for s in plan.seqs:
        seq = seqs[s.seq_id]
        end = s.start_pos + s.num_new_tokens
        ids += seq.tokens(s.start_pos, end - len(s.draft_ids)) + list(s.draft_ids)
        pos += range(s.start_pos, end)
        ctx = slots(seq.block_table, 0, end, page_size)
        kv_slot_rows.append(ctx)
        slot_mapping += ctx[s.start_pos :]
        if s.sample:
            sample_rows += range(len(ids) - s.num_sample_rows, len(ids))
            sample_ids.append(s.seq_id)
            sample_counts.append(s.num_sample_rows)
    attn = ragged_metadata(
        [s.start_pos for s in plan.seqs],
        [s.num_new_tokens for s in plan.seqs],
        kv_slot_rows,
        torch.tensor(slot_mapping, dtype=torch.long, device=device),
        device,
    )
    return ForwardBatch(
        input_ids=torch.tensor(ids, dtype=torch.long, device=device),
        positions=torch.tensor(pos, dtype=torch.long, device=device),
        attn=attn,
        sample_rows=torch.tensor(sample_rows, dtype=torch.long, device=device),
        sample_seq_ids=sample_ids,
        sample_counts=sample_counts,
        num_tokens=len(ids),
        kv_tokens=sum(len(c) for c in kv_slot_rows),
    )
