"""Continuous batching: waiting/running queues, chunked prefill, preemption -> StepPlan; commit.

Owns every Sequence and is, with the block pool, the only code that mutates one. Running
sequences are planned first (oldest first), then waiting ones are admitted FIFO while the token
budget, `max_running_requests` and free KV allow. When a running sequence cannot grow its KV,
the newest running sequence is preempted (KV freed, recomputed later from its tokens).
"""

from __future__ import annotations

from collections import deque

from dspark_sglang.config import ConfigError, SchedConfig
from dspark_sglang.engine.block_pool import BlockPool
from dspark_sglang.engine.sequence import FinishReason, Sequence, Status
from dspark_sglang.types import SamplingParams, ScheduledSeq, StepPlan


class Scheduler:
    def __init__(
        self, cfg: SchedConfig, pool: BlockPool, max_model_len: int, eos_ids: tuple[int, ...]
    ) -> None:
        self.cfg = cfg
        self.pool = pool
        self.max_model_len = max_model_len
        self.eos_ids = frozenset(eos_ids)
        self.seqs: dict[int, Sequence] = {}
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self._next_id = 0

    # -- requests ---------------------------------------------------------------------------
    def add(
        self, prompt_ids: list[int], params: SamplingParams, prefill_only: bool = False
    ) -> Sequence:
        n = len(prompt_ids)
        if n == 0:
            raise ConfigError("prompt is empty")
        if n >= self.max_model_len:
            raise ConfigError(
                f"prompt has {n} tokens but the context limit is {self.max_model_len} "
                "(prompt plus at least one generated token must fit)"
            )
        # The KV a sequence can ever hold: every token but the last sampled one.
        peak = min(n + params.max_tokens, self.max_model_len) - 1
        if self.pool.blocks_for(peak) > self.pool.num_blocks:
            raise ConfigError(
                f"request needs up to {peak} KV tokens but the pool holds only "
                f"{self.pool.num_blocks * self.pool.page_size}; "
                "lower max_tokens or raise the KV budget"
            )
        seq = Sequence(self._next_id, list(prompt_ids), params, arrival=self._next_id)
        seq.prefill_only = prefill_only
        self._next_id += 1
        self.seqs[seq.seq_id] = seq
        self.waiting.append(seq)
        return seq

    def adopt(self, prompt_ids: list[int], params: SamplingParams, first_token: int) -> Sequence:
        """A sequence prefilled elsewhere: its prompt KV is written by the caller into the
        blocks allocated here; it joins the running set decoding, anchor = first_token."""
        seq = Sequence(self._next_id, list(prompt_ids), params, arrival=self._next_id)
        self._next_id += 1
        seq.output_ids.append(first_token)
        self.pool.grow(seq.block_table, len(prompt_ids))
        seq.num_cached = len(prompt_ids)
        seq.status = Status.RUNNING
        self.seqs[seq.seq_id] = seq
        self.running.append(seq)
        return seq

    def can_adopt(self, num_prompt_tokens: int) -> bool:
        return (
            len(self.running) < self.cfg.max_running_requests
            and self.pool.blocks_for(num_prompt_tokens + 1) <= self.pool.num_free_blocks
        )

    def fits_pool(self, num_prompt_tokens: int, params: SamplingParams) -> bool:
        """Whether the request's peak KV fits the whole pool (else it could never finish)."""
        peak = min(num_prompt_tokens + params.max_tokens, self.max_model_len) - 1
        return self.pool.blocks_for(peak) <= self.pool.num_blocks

    def abort(self, seq_id: int) -> None:
        seq = self.seqs.get(seq_id)
        if seq is not None and not seq.is_finished:
            self.finish(seq, FinishReason.ABORT)

    def finish(self, seq: Sequence, reason: FinishReason) -> None:
        if seq.status is Status.RUNNING:
            self.running.remove(seq)
        elif seq.status is Status.WAITING:
            self.waiting.remove(seq)
        if reason is not FinishReason.HANDOFF:  # handoff KV is released after its export
            self.pool.release(seq.block_table)
        seq.status = Status.FINISHED
        seq.finish_reason = reason

    def pop_finished(self, seq_id: int) -> Sequence:
        seq = self.seqs.pop(seq_id)
        if seq.finish_reason is FinishReason.HANDOFF:
            self.pool.release(seq.block_table)
        return seq

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    # -- planning ---------------------------------------------------------------------------
    def schedule(self, drafts: dict[int, list[int]] | None = None) -> StepPlan:
        """Plan one forward. `drafts` holds the tokens to verify for decoding sequences; when
        the token budget or free KV falls short, verification shrinks before anyone is preempted.
        """
        drafts = drafts or {}
        budget = self.cfg.max_num_batched_tokens
        planned: list[ScheduledSeq] = []
        preempted: list[int] = []
        queue = sorted(self.running, key=lambda s: s.arrival)
        while queue and budget > 0:
            seq = queue.pop(0)
            n = min(seq.num_uncached, self.cfg.chunked_prefill_size, budget)
            decoding = seq.num_uncached == 1 and bool(seq.output_ids)
            draft = drafts.get(seq.seq_id, []) if decoding else []
            draft = draft[: budget - 1]
            if draft and not self.pool.can_grow(seq.block_table, seq.num_cached + 1 + len(draft)):
                draft = []
            n += len(draft)
            while not self.pool.can_grow(seq.block_table, seq.num_cached + n):
                victim = queue.pop() if queue else seq  # newest not yet planned, else itself
                self._preempt(victim)
                preempted.append(victim.seq_id)
                if victim is seq:
                    break
            if seq.status is not Status.RUNNING:
                continue
            planned.append(self._plan(seq, n, tuple(draft)))
            budget -= n
        if not preempted:  # no admission while the pool is short
            while self.waiting and budget > 0 and len(self.running) < self.cfg.max_running_requests:
                seq = self.waiting[0]
                n = min(seq.num_uncached, self.cfg.chunked_prefill_size, budget)
                if not self.pool.can_grow(seq.block_table, seq.num_cached + n):
                    break
                self.waiting.popleft()
                seq.status = Status.RUNNING
                self.running.append(seq)
                planned.append(self._plan(seq, n))
                budget -= n
        return StepPlan(tuple(planned), tuple(preempted))

    def _plan(self, seq: Sequence, n: int, draft: tuple[int, ...] = ()) -> ScheduledSeq:
        self.pool.grow(seq.block_table, seq.num_cached + n)
        sample = seq.num_cached + n - len(draft) == seq.num_tokens
        return ScheduledSeq(seq.seq_id, seq.num_cached, n, sample, draft)

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.pool.release(seq.block_table)
        seq.num_cached = 0
        seq.num_preemptions += 1
        seq.status = Status.WAITING
        self.waiting.appendleft(seq)

    # -- commit -----------------------------------------------------------------------------
    def commit(self, plan: StepPlan, sampled: dict[int, list[int]]) -> dict[Sequence, list[int]]:
        """Advance KV counts, roll back rejected drafts, append tokens, finish on EOS/stop/length.

        `sampled[seq]` is the accepted drafts plus the bonus token; KV of rejected drafts is
        released (their slots are overwritten before any later read).
        """
        touched: dict[Sequence, list[int]] = {}
        for s in plan.seqs:
            seq = self.seqs[s.seq_id]
            toks = sampled.get(s.seq_id, [])
            rejected = len(s.draft_ids) - max(len(toks) - 1, 0)
            seq.num_cached = s.start_pos + s.num_new_tokens - rejected
            if rejected:
                self.pool.shrink(seq.block_table, seq.num_cached)
            if toks:
                touched[seq] = self._append(seq, toks)
        return touched

    def _append(self, seq: Sequence, toks: list[int]) -> list[int]:
        p = seq.params
        for i, tok in enumerate(toks):
            seq.output_ids.append(tok)
            if (not p.ignore_eos and tok in self.eos_ids) or tok in p.stop_token_ids:
                self.finish(seq, FinishReason.STOP)
            elif len(seq.output_ids) >= p.max_tokens or seq.num_tokens >= self.max_model_len:
                self.finish(seq, FinishReason.LENGTH)
            elif seq.prefill_only:
                self.finish(seq, FinishReason.HANDOFF)
            if seq.is_finished:
                return toks[: i + 1]
        return toks

    def stop_at(self, seq: Sequence, keep: int) -> None:
        """A stop string ended the text at output token `keep`: drop later tokens, finish."""
        del seq.output_ids[keep:]
        if seq.is_finished:
            if seq.finish_reason is FinishReason.HANDOFF:  # its KV was kept for an export
                self.pool.release(seq.block_table)
            seq.finish_reason = FinishReason.STOP  # a stop string outranks the length limit
        else:
            self.finish(seq, FinishReason.STOP)
