"""Plain records shared across layers: sampling parameters, the step plan and its outputs.

No behaviour beyond validation; imports only `config`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from dspark_sglang.config import ConfigError

MAX_STOP_STRINGS = 16


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """Per-request sampling. temperature == 0 means greedy; top_k == 0 and top_p == 1 disable."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    max_tokens: int = 256
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        if not (0.0 <= self.temperature <= 100.0):
            raise ConfigError(f"temperature must be in [0, 100], got {self.temperature}")
        if not (0.0 < self.top_p <= 1.0):
            raise ConfigError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ConfigError(f"top_k must be >= 0 (0 disables), got {self.top_k}")
        if self.max_tokens < 1:
            raise ConfigError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if self.seed is not None and not (0 <= self.seed < 2**63):
            raise ConfigError(f"seed must be in [0, 2**63), got {self.seed}")
        if len(self.stop) > MAX_STOP_STRINGS or any(not s for s in self.stop):
            raise ConfigError(f"stop must hold at most {MAX_STOP_STRINGS} non-empty strings")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


@dataclass(frozen=True, slots=True)
class ScheduledSeq:
    """One request's share of a forward: `num_new_tokens` tokens starting at `start_pos`.

    A verify step is the anchor followed by `draft_ids` (num_new_tokens = 1 + len(draft_ids));
    every one of its rows is scored.
    """

    seq_id: int
    start_pos: int  # tokens already in KV before this step
    num_new_tokens: int
    sample: bool  # True when the last new row yields a token (decode, or prompt finished)
    draft_ids: tuple[int, ...] = ()

    @property
    def num_sample_rows(self) -> int:
        return 1 + len(self.draft_ids) if self.sample else 0


@dataclass(frozen=True, slots=True)
class StepPlan:
    """What one step runs, in batch order; preempted ids were evicted while planning."""

    seqs: tuple[ScheduledSeq, ...]
    preempted: tuple[int, ...] = ()

    @property
    def num_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.seqs)

    @property
    def is_empty(self) -> bool:
        return not self.seqs


@dataclass(frozen=True, slots=True)
class StepOutput:
    """Tokens sampled this step, keyed by sequence id (one per sampled sequence)."""

    tokens: dict[int, list[int]] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class StepRecord:
    """One step as the capacity model and metrics see it."""

    step: int
    num_reqs: int  # R: sequences in the forward
    num_tokens: int  # B: tokens in the forward
    num_prefill_tokens: int
    num_decode_reqs: int
    kv_tokens: int  # context tokens attended (sum of start_pos + new tokens)
    step_seconds: float
    routed_tokens_per_expert: tuple[int, ...] = ()
    verify_budget_k: int = -1  # drafts admitted this step (-1: no speculation)
    predicted_seconds: float = float("nan")  # capacity model's step time for this step
    predicted_theta: float = float("nan")  # expected tokens/s of the chosen plan
    capacity_version: int = -1
    fallback: str = ""  # why the planner fell back this step ("" = it did not)
    # routed (token, expert) pairs per EP rank, summed over MoE layers; () with one rank
    routed_tokens_per_rank: tuple[int, ...] = ()
    draft_seconds: float = 0.0  # wall time of the drafter this step (0: it did not run)
    # wall time of the target forward (logits included) alone; nan: the engine did not time it
    forward_seconds: float = float("nan")
    num_draft_reqs: int = 0  # rows the drafter ran on (0: it did not run)
    # a lagged probe: the drafter ran on a few rows of a K = 0 step for acceptance evidence; the
    # time of a few rows prices no step the planner chooses between, so the draft term learns
    # only from a probe of every row whose drafter was not resumed (the planner's retime step)
    probe: bool = False
    # the drafter's first run after steps without it (lagged K = 0): its time carries the
    # draft-context backlog of those steps and a cold drafter, not what drafting costs per step
    draft_resumed: bool = False
    num_accepted: int = 0  # drafts accepted this step, over every verified row
    # lagged K > 0: the tokens the step's K was planned on, R + the top-K survival published `lag`
    # steps earlier (verify_budget.planned_tokens); nan elsewhere. Against num_decode_reqs +
    # num_accepted it measures what the lag costs the K choice (bench.steps)
    planned_tokens: float = float("nan")
    # unix seconds at the step's start: places a step log's records in a benchmark's windows
    # (bench.host_speed reads the host's speed in each sweep cell from them); nan: not stamped
    started_at: float = float("nan")
    # wall seconds adopting handoffs (target KV and drafter-context writes) since the previous
    # record: decode-worker work between steps that step_seconds leaves out (a speculative
    # engine writes each handoff's drafter context, 0.4-1.5 ms a request on the CPU engine)
    adopt_seconds: float = 0.0
    # lagged: K drafted the whole batch to time the drafter at an R bin where fewer than
    # CAP_MIN_RECORDS drafting steps had (exploration, EXPLORE_RATIO), not because it was the
    # best plan: what learning the price costs (bench.steps, "time by step kind")
    explored: bool = False
    # lagged: the step verified every draft without a K search or acceptance learning (pinned at
    # verify-all, engine/planner.py PIN_PLANS)
    pinned: bool = False
    # lagged K > 0: the capacity model's tokens/s for a plain step (B = R, no drafter) of this
    # step's batch when it was planned; nan elsewhere. planned_tokens / predicted_seconds over it
    # is the margin the decision to draft was taken on (bench.steps "plan/plain")
    plain_theta: float = float("nan")
    # wall seconds of the step before its forward besides the drafter: choosing which requests
    # draft and the verify budget (the planner's K search, its skip or plan); nan: not timed
    plan_seconds: float = float("nan")
    # wall seconds after the forward queueing the verified rows for the drafter's context (with
    # the queue's compaction, and its flush when the queue outgrew its cap); nan without a
    # drafter. With plan_seconds, forward_seconds and draft_seconds it leaves the step's
    # unattributed host time small enough to place a stall (docs/serving.md)
    context_seconds: float = float("nan")
