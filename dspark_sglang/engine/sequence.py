"""Sequence: one request's tokens, status, block table and KV progress.

Only the scheduler (commit, preempt) and the block pool mutate it; the runner reads it.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from dspark_sglang.types import SamplingParams


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class FinishReason(enum.Enum):
    STOP = "stop"  # EOS, a stop token or a stop string
    LENGTH = "length"  # max_tokens or the context limit
    ABORT = "abort"
    HANDOFF = "handoff"  # prefill-only request: KV and drafter context leave for a decode worker


@dataclass(eq=False)
class Sequence:
    seq_id: int
    prompt_ids: list[int]
    params: SamplingParams
    arrival: int  # admission order; preemption evicts the latest arrival first
    output_ids: list[int] = field(default_factory=list)
    block_table: list[int] = field(default_factory=list)
    num_cached: int = 0  # tokens whose KV is written
    status: Status = Status.WAITING
    finish_reason: FinishReason | None = None
    num_preemptions: int = 0
    prefill_only: bool = False  # PD prefill worker: stop after the first token, keep KV for export

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def num_uncached(self) -> int:
        """Tokens still to run through the model before the next sample (prefill or recompute)."""
        return self.num_tokens - self.num_cached

    @property
    def is_finished(self) -> bool:
        return self.status is Status.FINISHED

    def token_at(self, pos: int) -> int:
        n = len(self.prompt_ids)
        return self.prompt_ids[pos] if pos < n else self.output_ids[pos - n]

    def tokens(self, start: int, end: int) -> list[int]:
        return (self.prompt_ids + self.output_ids)[start:end]
