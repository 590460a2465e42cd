"""ForwardBatch: one forward's tensors, built from a StepPlan and the sequences in one pass."""

from __future__ import annotations

from dataclasses import dataclass

import torch

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
    tables: list[list[int]] = []
    kv_lens: list[int] = []
    sample_rows: list[int] = []
    sample_ids: list[int] = []
    sample_counts: list[int] = []
    for s in plan.seqs:
        seq = seqs[s.seq_id]
        end = s.start_pos + s.num_new_tokens
        ids += seq.tokens(s.start_pos, end - len(s.draft_ids)) + list(s.draft_ids)
        pos += range(s.start_pos, end)
        tables.append(seq.block_table)
        kv_lens.append(end)
        if s.sample:
            sample_rows += range(len(ids) - s.num_sample_rows, len(ids))
            sample_ids.append(s.seq_id)
            sample_counts.append(s.num_sample_rows)
    # Slots page by page (a per-position list cost 0.06 ms a step at one 1,000-token context,
    # and grows with every context in the batch).
    table = slot_table(tables, max(kv_lens), page_size)
    positions = torch.tensor(pos, dtype=torch.long)
    row_of = torch.repeat_interleave(
        torch.arange(len(kv_lens)), torch.tensor([s.num_new_tokens for s in plan.seqs])
    )
    attn = ragged_metadata(
        [s.start_pos for s in plan.seqs],
        [s.num_new_tokens for s in plan.seqs],
        table,
        table[row_of, positions].to(device),
        device,
    )
    return ForwardBatch(
        input_ids=torch.tensor(ids, dtype=torch.long, device=device),
        positions=positions.to(device),
        attn=attn,
        sample_rows=torch.tensor(sample_rows, dtype=torch.long, device=device),
        sample_seq_ids=sample_ids,
        sample_counts=sample_counts,
        num_tokens=len(ids),
        kv_tokens=sum(kv_lens),
    )


def slot_table(block_tables: list[list[int]], length: int, page_size: int) -> torch.Tensor:
    """[R, length] flat KV slot of positions 0..length-1 of each block table (CPU). Positions
    past a table's blocks read block 0: valid slots, for the attention mask to hide."""
    pages = -(-length // page_size)
    table = torch.tensor(
        [t[:pages] + [0] * (pages - len(t[:pages])) for t in block_tables], dtype=torch.long
    )
    flat = (table[:, :, None] * page_size + torch.arange(page_size)).reshape(len(block_tables), -1)
    return flat[:, :length]
