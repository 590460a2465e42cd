"""LLMEngine: add_request, step (plan -> batch -> forward -> sample -> commit), generate; and LLM.

Owns per-request side state the scheduler does not need (sampling generator, detokenizer).
Non-speculative decoding; the speculative step slots into the same five stages.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np
import torch
from tokenizers import Tokenizer

from dspark_sglang.algo.capacity import AdditiveModel, CapacityModel, Curve
from dspark_sglang.algo.capacity_fit import fit_additive, fit_table
from dspark_sglang.algo.verify_budget import ScheduleMode, parse_schedule_mode
from dspark_sglang.config import (
    CacheConfig,
    Config,
    ConfigError,
    DraftConfig,
    ModelConfig,
    ParallelConfig,
    SchedConfig,
)
from dspark_sglang.engine.batch import ForwardBatch, build_batch
from dspark_sglang.engine.block_pool import BlockPool
from dspark_sglang.engine.detokenizer import IncrementalDetokenizer, find_stop
from dspark_sglang.engine.draft_context import PendingContext
from dspark_sglang.engine.ep import create_runner
from dspark_sglang.engine.handoff import SeqHandoff
from dspark_sglang.engine.kv_cache import slots
from dspark_sglang.engine.planner import Plan, VerifyPlanner
from dspark_sglang.engine.profiler import (
    GridPoint,
    ep_load_term,
    startup_grid,
    time_draft,
    time_point,
    warm_up,
)
from dspark_sglang.engine.runner import ModelRunner
from dspark_sglang.engine.sampler import make_generator, sampling_tensors
from dspark_sglang.engine.scheduler import Scheduler
from dspark_sglang.engine.sequence import FinishReason, Sequence
from dspark_sglang.engine.speculative import (
    Proposal,
    RoundRecord,
    SpecStats,
    build_draft_batch,
    verify_step,
)
from dspark_sglang.types import SamplingParams, StepPlan, StepRecord


@dataclass
class RequestOutput:
    seq_id: int
    prompt_ids: list[int]
    output_ids: list[int]
    text: str
    new_token_ids: list[int]
    finished: bool
    finish_reason: str | None = None
    num_preemptions: int = 0
    spec_rounds: int = 0  # verify rounds after the first token
    spec_accepted: int = 0  # draft tokens accepted over those rounds
    handoff: SeqHandoff | None = None  # set when a prefill-only request finished its prefill

    @property
    def accept_length(self) -> float:
        """Tokens committed per verify round (DeepSpec tau, per request); 1.0 without drafts."""
        committed = len(self.output_ids) - 1
        return committed / self.spec_rounds if self.spec_rounds else 1.0


@dataclass
class _ReqState:
    generator: torch.Generator
    detok: IncrementalDetokenizer | None
    text: str = ""
    new_ids: list[int] = field(default_factory=list)
    rounds: int = 0
    accepted: int = 0
    ctx_chunks: list[torch.Tensor] = field(default_factory=list)  # C rows of a prefill-only seq
    queued_ctx: int = 0  # its rows waiting in the drafter-context queue (the resume charge)


# Modes that read no capacity curve get a one-entry placeholder they never index.


def load_tokenizer(model_path: str) -> Tokenizer | None:
    f = Path(model_path) / "tokenizer.json"
    return Tokenizer.from_file(str(f)) if f.is_file() else None


def _generation_eos(model_path: str) -> tuple[int, ...]:
    f = Path(model_path) / "generation_config.json"
    if not f.is_file():
        return ()
    eos = json.loads(f.read_text()).get("eos_token_id")
    return tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))


_NONE_VERIFIED = np.zeros(0, np.int64)
_NONE_VERIFIED.flags.writeable = False
# Deferred drafter-context rows held at most: their taps' bytes, and never fewer rows than this.
# Rows of requests that finish before drafting again are dropped unprojected, so the longer a
# plain stretch is held, the less of it is ever projected (the bundled pair at c = 64: 21 k
# rows, about 330 steps).
_MAX_PENDING_CTX_BYTES = 64 << 20
_MIN_PENDING_CTX_ROWS = 4096
# Live adopted prompts' C rows wait too, up to this many caps in all (c = 64 bundled: ~25 MB).
_PENDING_CTX_FACTOR = 4


def _kept_rows(dropped: list[tuple[int, int]], num_rows: int) -> np.ndarray:
    """Indices of the rows outside the `dropped` [start, end) ranges, in order (int64)."""
    keep = np.ones(num_rows, dtype=bool)
    for a, b in dropped:
        keep[a:b] = False
    return np.flatnonzero(keep).astype(np.int64, copy=False)


def _last_of_each(slot_ids: torch.Tensor) -> torch.Tensor | None:
    """Indices of the last occurrence of each slot id, in order (index_put keeps no order among
    duplicate indices, so duplicates are resolved here); None when every id is distinct, the usual
    case: a slot repeats only when its blocks were freed and reused between two flushes, and the
    unique pass cost 0.1 ms of a 0.7 ms flush of a few verified rows (CPU engine, R = 2)."""
    ids = slot_ids.tolist()
    if len(set(ids)) == len(ids):
        return None
    arr = np.asarray(ids)
    _, first_in_reversed = np.unique(arr[::-1], return_index=True)
    keep = np.sort(arr.size - 1 - first_in_reversed)
    return torch.from_numpy(keep).to(slot_ids.device)


def _per_rank(per_expert: list[int], ep_size: int) -> tuple[int, ...]:
    """Routed pairs per EP rank: rank r owns the r-th contiguous block of experts."""
    if ep_size == 1 or not per_expert:
        return ()
    n = len(per_expert) // ep_size
    return tuple(sum(per_expert[r * n : (r + 1) * n]) for r in range(ep_size))


class LLMEngine:
    def __init__(
        self,
        config: Config,
        tokenizer: Tokenizer | None = None,
        on_step: Callable[[StepRecord], None] | None = None,
        record_rounds: bool = False,
    ) -> None:
        self.config = config
        self.rounds: list[RoundRecord] | None = [] if record_rounds else None
        self.mode = parse_schedule_mode(config.draft.schedule_mode)
        self.runner: ModelRunner = create_runner(config)
        self.tokenizer = tokenizer or load_tokenizer(config.model.path)
        self.pool = BlockPool(
            self.runner.num_blocks, self.runner.page_size, config.cache.block_order
        )
        eos = self.runner.arch.eos_token_ids + _generation_eos(config.model.path)
        self.scheduler = Scheduler(
            config.sched, self.pool, self.runner.max_model_len, tuple(dict.fromkeys(eos))
        )
        drafter = self.runner.drafter
        block = drafter.cfg.block_size if drafter is not None else 0
        self.gamma = min(config.draft.num_speculative_tokens or block, block)
        if drafter is not None and (config.draft.num_speculative_tokens or 0) > block:
            raise ConfigError(
                f"--num-speculative-tokens {config.draft.num_speculative_tokens} exceeds the "
                f"drafter's block size {block}"
            )
        if (
            self.mode.name == "threshold"
            and drafter is not None
            and not drafter.cfg.confidence_head
        ):
            raise ConfigError("--schedule-mode threshold:C needs a drafter with a confidence head")
        if config.draft.context_only and self.mode.name in ("sync", "lagged"):
            raise ConfigError(f"a context_only engine never drafts: {self.mode.name} has no use")
        self.stats = SpecStats(self.gamma)
        self.startup_rounds = 0  # rounds of start-up profiling run (0: none)
        self.planner = self._make_planner(config.draft, self.mode) if drafter is not None else None
        self._last_plan: Plan | None = None  # this step's verify plan (None: no speculation)
        self._draft_seconds = 0.0
        # the step's planner work before the forward (what `_draft` spent besides the drafter)
        # and the verified rows' drafter-context bookkeeping after it (StepRecord)
        self._plan_seconds = self._context_seconds = math.nan
        self._draft_rows = 0
        self._draft_backlog = False  # this step's drafter flushed more than one step's rows
        self._forward_seconds = math.nan
        self._planned_ids: frozenset[int] = frozenset()
        # drafter-context rows not yet written: verified rows' taps, adopted prompts' C
        self._pending = PendingContext(
            self.pool.num_blocks,
            self.runner.page_size,
            self.runner.device,
            self.runner.drafter_context,
        )
        self._compact_at = 0  # pending bytes past the cap that trigger the next compaction
        if drafter is not None:  # a block's pending rows are stale once it is handed out again
            self.pool.track_grants()
        self.on_step = on_step
        self._state: dict[int, _ReqState] = {}
        self._seed_gen = torch.Generator().manual_seed(config.seed)
        self._step_no = 0
        self._started_at = math.nan  # unix time of the current step's start (StepRecord)
        self._adopt_seconds = 0.0  # try_adopt's time since the last record (StepRecord)

    def _make_planner(self, cfg: DraftConfig, mode: ScheduleMode) -> VerifyPlanner:
        capacity = None
        if cfg.capacity_profile is not None:
            from dspark_sglang.capacity_profile import load_profile

            capacity = load_profile(cfg.capacity_profile).model
        elif mode.name in ("sync", "lagged"):
            capacity = self._profile_capacity(cfg.startup_profile_seconds)
        tiers = self.runner.row_tiers
        if (
            capacity is not None
            and cfg.capacity_tiers
            and tiers
            and isinstance(capacity.form, AdditiveModel)
            and not capacity.form.buckets
        ):
            # price what this engine executes: B within a tier costs the tier (a profile with
            # buckets of its own keeps them: they describe the engine it was measured on)
            capacity = replace(capacity, form=replace(capacity.form, buckets=tiers))
        sts = None
        assert cfg.path is not None
        sts_file = Path(cfg.path) / "sts.json"
        if sts_file.is_file():
            sts = np.asarray(json.loads(sts_file.read_text())["temperatures"], dtype=np.float64)
        overlap = cfg.overlap if cfg.overlap is not None else self.runner.device.startswith("cuda")
        return VerifyPlanner(
            mode,
            self.gamma,
            capacity,
            sts,
            cfg.live_capacity,
            cfg.min_user_tps,
            overlap,
            cfg.selective_draft,
            cfg.explore_ratio,
            cfg.lag_shrink,
            cfg.replan_every,
            cfg.step_bias,
            cfg.step_bias_prior,
            cfg.resume_charge,
            cfg.draft_price_prior_weight,
            cfg.user_rate_floor,
            cfg.tie_margin,
            cfg.explore_budget,
        )

    def _profile_capacity(self, budget_s: float) -> CapacityModel:
        """Start-up profiling (DESIGN §4): time a bounded grid of verify forwards and the
        drafter, fit the additive form; the live estimator refines it from real steps afterwards.

        Round 0 times each point back to back (as the budget allows, cheapest first); further
        rounds, while the budget has room for one, time every point once more, the order
        reversed each round, and each point keeps its median over rounds. On the 2-core VM the
        host's speed moved 1.2-1.7x within one process over seconds (docs/capacity.md), so one
        3-second pass could catch the large shapes in a slow spell: an R = 2, 16-token verify
        was priced at 9.05 ms where it took 7.54, and lagged trimmed drafts that cost nothing
        to verify. Rounds spread every point over the same stretch of time."""
        from tqdm import tqdm

        t0 = time.perf_counter()
        gen = torch.Generator().manual_seed(0)
        points = startup_grid(
            self.config.sched.max_running_requests,
            self.gamma,
            self.pool.num_blocks * self.pool.page_size,
            self.pool.page_size,
            self.runner.max_model_len,
        )
        if points:
            warm_up(self.runner, self.pool, points[0], gen)
        fwd: dict[GridPoint, list[float]] = {}
        for p in tqdm(points, desc="capacity profile", leave=False):
            if fwd and time.perf_counter() - t0 > budget_s:
                break
            fwd[p] = [time_point(self.runner, self.pool, p, 3, 1, gen)["median_s"]]
        timed = list(fwd)
        draft_ctx = max(max(p.ctx for p in timed), 16)
        draft = {n: [self._time_draft(n, draft_ctx, 3, gen)] for n in self._draft_reqs(timed)}
        # A later round runs 2 forwards (or drafts) a point where round 0 ran 4.
        last = (time.perf_counter() - t0) / 2
        self.startup_rounds = 1
        while self.startup_rounds < self.config.draft.startup_profile_rounds:
            started = time.perf_counter()
            if started - t0 + last > budget_s:
                break
            for p in timed[:: -1 if self.startup_rounds % 2 else 1]:
                fwd[p].append(time_point(self.runner, self.pool, p, 1, 1, gen)["median_s"])
            for n, secs in draft.items():
                secs.append(self._time_draft(n, draft_ctx, 1, gen))
            last = time.perf_counter() - started
            self.startup_rounds += 1
        r, b, c = (
            np.array([getattr(p, k) for p in timed], np.float64)
            for k in ("num_reqs", "num_tokens", "ctx")
        )
        s = np.array([np.median(fwd[p]) for p in timed])
        reqs = sorted(draft)
        secs = [float(np.median(draft[n])) for n in reqs]
        draft_curve = Curve(tuple(map(float, reqs)), tuple(np.maximum.accumulate(secs).tolist()))
        moe = None
        if self.config.parallel.ep_size > 1:  # the busiest rank's expert time (docs/ep.md)
            moe = ep_load_term(self.runner, self.config.parallel.ep_size, int(b.max()))
            s = s - moe.seconds(b.astype(np.int64))
        # The step records' ctx is the attended context summed over requests.
        try:
            return CapacityModel(fit_additive(r, b, r * c + b, s), moe, draft=draft_curve)
        except ValueError:
            # Too few or too noisy points for the additive form (tiny models on a busy host):
            # a per-B table of medians is always fittable; the live estimator refines it.
            buckets = tuple(int(x) for x in np.unique(b))
            return CapacityModel(fit_table(b, s, buckets), moe, draft=draft_curve)

    def _draft_reqs(self, timed: list[GridPoint]) -> list[int]:
        """The R the drafter is timed at: 1, 2, 4, ... up to the grid's, as the pool holds them
        at the grid's largest context (the draft term is a curve over R only)."""
        ctx = max(max(p.ctx for p in timed), 16)
        fits = self.pool.num_free_blocks // -(-(ctx + 1) // self.pool.page_size)
        top = min(max(p.num_reqs for p in timed), fits)
        return [x for x in (1, 2, 4, 8, 16, 32, 64) if x <= top] or [1]

    def _time_draft(self, num_reqs: int, ctx: int, repeats: int, gen: torch.Generator) -> float:
        """The drafter's seconds for one step at R = num_reqs (the live estimator tracks the
        draft term from every drafting step afterwards)."""
        return time_draft(self.runner, self.pool, num_reqs, ctx, repeats, 1, gen)

    # -- requests ---------------------------------------------------------------------------
    def add_request(
        self,
        prompt: str | list[int],
        params: SamplingParams | None = None,
        prefill_only: bool = False,
    ) -> int:
        """Queue a request; prefill_only stops after the first token and returns a SeqHandoff."""
        params = params or SamplingParams()
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ConfigError("text prompt given but the model folder has no tokenizer.json")
            ids = self.tokenizer.encode(prompt, add_special_tokens=False).ids
        else:
            ids = [int(t) for t in prompt]
        vocab = self.runner.arch.vocab_size
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise ConfigError(f"prompt token ids out of range [0, {vocab}): {bad[:5]}")
        if self.config.draft.context_only and self.runner.drafter is not None and not prefill_only:
            raise ConfigError("this engine only prefills for handoffs (context_only drafter)")
        seq = self.scheduler.add(ids, params, prefill_only)
        seed = params.seed
        if seed is None:
            seed = int(torch.randint(0, 2**62, (1,), generator=self._seed_gen))
        detok = IncrementalDetokenizer(self.tokenizer, ids) if self.tokenizer else None
        self._state[seq.seq_id] = _ReqState(make_generator(seed, self.runner.device), detok)
        return seq.seq_id

    def try_adopt(self, h: SeqHandoff) -> int | None:
        """Continue a request prefilled elsewhere; None when KV or the running set is full."""
        t0 = time.perf_counter()
        drafter = self.runner.drafter
        if drafter is not None and self.config.draft.context_only:
            raise ConfigError("this engine only prefills for handoffs (context_only drafter)")
        arch = self.runner.arch
        h.validate(
            arch.num_hidden_layers,
            arch.num_key_value_heads,
            arch.head_dim,
            drafter.cfg.hidden_size if drafter is not None else None,
        )
        n = len(h.prompt_ids)
        if n + 1 > self.runner.max_model_len:
            raise ConfigError(f"handoff of {n} prompt tokens exceeds the context limit")
        if not self.scheduler.fits_pool(n, h.params):
            raise ConfigError(
                f"handoff needs up to {n + h.params.max_tokens - 1} KV tokens but the decode "
                f"pool holds only {self.pool.num_blocks * self.pool.page_size}"
            )
        if not self.scheduler.can_adopt(n):
            return None
        # A malformed RNG state must fail before the request holds KV or a running slot.
        gen = make_generator(0, self.runner.device)
        try:
            gen.set_state(h.rng_state)
        except (RuntimeError, TypeError, ValueError) as e:
            raise ConfigError(f"handoff carries an invalid sampler RNG state: {e}") from e
        seq = self.scheduler.adopt(h.prompt_ids, h.params, h.first_token)
        slot_ids = torch.tensor(
            slots(seq.block_table, 0, n, self.runner.page_size), device=self.runner.device
        )
        self.runner.write_kv(slot_ids, h.kv.to(self.runner.device))
        detok = IncrementalDetokenizer(self.tokenizer, h.prompt_ids) if self.tokenizer else None
        st = _ReqState(gen, detok)
        if drafter is not None and h.draft_ctx is not None:
            # written when the drafter first runs on this request: most never do under load
            self._pending.supersede(self.pool.take_granted())  # its last owners' rows: stale
            pos = torch.arange(n, device=self.runner.device)
            c = h.draft_ctx.to(self.runner.device, self.runner.draft_dtype)
            self._pending.add_projected(c, pos, slot_ids)
            st.queued_ctx = n
        if detok is not None:
            st.text = detok.step([h.first_token])
        self._state[seq.seq_id] = st
        self._adopt_seconds += time.perf_counter() - t0
        return seq.seq_id

    def abort(self, seq_id: int) -> None:
        self.scheduler.abort(seq_id)

    def has_unfinished(self) -> bool:
        """True while any request is queued, running, or finished but not yet reported."""
        return self.scheduler.has_work or any(s.is_finished for s in self.scheduler.seqs.values())

    # -- the step ---------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        t0, self._started_at = time.perf_counter(), time.time()
        self._last_plan, self._draft_seconds, self._planned_ids = None, 0.0, frozenset()
        self._draft_rows, self._draft_backlog = 0, False
        self._forward_seconds = self._context_seconds = math.nan
        proposal, drafts = self._draft()
        self._plan_seconds = time.perf_counter() - t0 - self._draft_seconds
        plan = self.scheduler.schedule(drafts)
        if plan.is_empty:
            return self._collect({})
        batch = build_batch(plan, self.scheduler.seqs, self.runner.page_size, self.runner.device)
        t_fwd = time.perf_counter()
        out = self.runner.forward(batch)
        if self.runner.device.startswith("cuda"):  # kernels are async: time them, not the launch
            torch.cuda.synchronize()
        self._forward_seconds = time.perf_counter() - t_fwd
        seqs = [self.scheduler.seqs[i] for i in batch.sample_seq_ids]
        planned = {s.seq_id: list(s.draft_ids) for s in plan.seqs}
        result = verify_step(
            out.logits, seqs, batch.sample_counts, planned, proposal, self._generators(seqs)
        )
        touched = self.scheduler.commit(plan, result.tokens)
        if self.runner.drafter is not None:
            t_ctx = time.perf_counter()
            self._extend_draft_context(plan, batch, out.taps, result.num_accepted)
            self._context_seconds = time.perf_counter() - t_ctx
        self._count(plan, touched, result.num_accepted, proposal)
        self._record(
            plan,
            batch.num_tokens,
            batch.kv_tokens,
            out.expert_counts,
            t0,
            proposal,
            result.num_accepted,
        )
        return self._collect(touched)

    def _generators(self, seqs: list[Sequence]) -> list[torch.Generator | None]:
        # Greedy rows draw no noise, which keeps them identical with and without a batch.
        return [None if s.params.greedy else self._state[s.seq_id].generator for s in seqs]

    def _draft(self) -> tuple[Proposal | None, dict[int, list[int]]]:
        """Draft gamma tokens for every decoding sequence and choose how many to verify."""
        if self.runner.drafter is None or (
            self.planner is not None and self.planner.never_verifies
        ):
            return None, {}
        # Decoding = the prompt is in KV and the anchor is a sampled token (not a prompt tail).
        ready: list[Sequence] = []
        caps: list[int] = []
        lefts: list[int] = []
        gamma, max_model_len, ctx = self.gamma, self.runner.max_model_len, 0
        # The most drafts worth verifying: a round commits at most l + 1 tokens, within
        # max_tokens and the context. Inline: this loop visits every request every step.
        for s in self.scheduler.running:
            out = s.output_ids
            n = len(s.prompt_ids) + len(out)
            if n - s.num_cached == 1 and out:
                cap = min(s.params.max_tokens - len(out), max_model_len - n) - 1
                if cap > 0:
                    ready.append(s)
                    caps.append(min(cap, gamma))
                    lefts.append(cap + 1)
                    ctx += n
        if not ready:
            return None, {}
        assert self.planner is not None
        ids = [s.seq_id for s in ready]
        self._planned_ids = frozenset(ids)
        max_len = np.array(caps)
        k, whole = None, None
        if self.planner.plans_before_drafting:
            self.planner.note_queue([self._state[i].queued_ctx for i in ids], lefts)
            k = self.planner.budget(ids, max_len, ctx)
            if k == 0 and not self.planner.should_probe():
                # nothing will be verified: a plain decode step, without the drafter
                self._last_plan = self.planner.skip(ids, max_len, ctx)
                return None, {}
            # A probe drafts and verifies a few rows only, a selective K > 0 step the rows K
            # admits (None: all); the rest decode plainly.
            if k == 0:  # a probe even when it drafts every row
                keep, whole = self.planner.probe_rows(len(ready)), (ids, max_len, ctx)
            else:
                keep = self.planner.draft_rows(ids, k, max_len)
                whole = None if keep is None else (ids, max_len, ctx)
            if keep is not None and keep.size < len(ready):
                ready = [ready[i] for i in keep]
                ids, max_len = [ids[i] for i in keep], max_len[keep]
                ctx = sum(s.num_tokens for s in ready)
        t0 = time.perf_counter()
        # More context rows to project than one drafting step verifies (a prompt's, or skipped
        # steps'): this drafter run prices no step the planner chooses between (draft_resumed).
        flushed = self._flush_draft_context(ready)
        self.planner.observe_flush(flushed, time.perf_counter() - t0)
        self._draft_backlog = flushed > len(ready) * (self.gamma + 1)
        batch = build_draft_batch(ready, self.runner.page_size, self.runner.device)
        temps, _, _ = sampling_tensors([s.params for s in ready], self.runner.device)
        proposal = self.runner.draft(batch, temps, self._generators(ready))
        logits = (
            proposal.conf_logits[:, : self.gamma].double().cpu().numpy()
            if proposal.conf_logits is not None
            else None
        )
        self._draft_seconds = time.perf_counter() - t0
        self._draft_rows = len(ready)
        self._last_plan = self.planner.plan(
            ids, logits, max_len, ctx, k, whole, backlog=self._draft_backlog
        )
        lens = self._last_plan.lengths
        toks = proposal.tokens.tolist()  # draft ids go into the host-built batch
        self.stats.drafted += len(ready) * self.gamma
        drafts = {s.seq_id: toks[i][: int(lens[i])] for i, s in enumerate(ready)}
        return proposal, drafts

    def _extend_draft_context(
        self,
        plan: StepPlan,
        batch: ForwardBatch,
        taps: torch.Tensor | None,
        accepted: dict[int, int],
    ) -> None:
        """Append exactly the verified rows: prefill rows, or anchor + n accepted drafts."""
        assert taps is not None
        dropped: list[tuple[int, int]] = []  # row ranges of rejected drafts
        start, kept, state = 0, 0, self._state
        for s in plan.seqs:
            n = s.num_new_tokens
            keep = 1 + accepted.get(s.seq_id, 0) if s.draft_ids else n
            if keep != n:
                dropped.append((start + keep, start + n))
            start += n
            kept += keep
            st = state[s.seq_id]
            # from position 0 (a prompt, or one recomputed after preemption freed its blocks):
            # whatever it had queued is gone with those blocks
            st.queued_ctx = keep if s.start_pos == 0 else st.queued_ctx + keep
        # Blocks handed out since the last add hold only their last owners' rows (a new owner's
        # rows land here, after this): without this, those rows would wait (and count) as
        # the new owner's until it drafts.
        self._pending.supersede(self.pool.take_granted())
        if not dropped:  # every row verified (a step without drafts)
            self._pending.add(taps, batch.positions, batch.attn.slot_mapping)
        else:
            # through numpy: torch.tensor of a Python list costs ~10x more per element
            idx = torch.from_numpy(_kept_rows(dropped, batch.num_tokens)).to(taps.device)
            self._pending.add(taps[idx], batch.positions[idx], batch.attn.slot_mapping[idx])
        handoff = any(self.scheduler.seqs[s.seq_id].prefill_only for s in plan.seqs)
        if not handoff:
            row_bytes = taps.shape[-1] * taps.element_size()
            cap = max(_MIN_PENDING_CTX_ROWS * row_bytes, _MAX_PENDING_CTX_BYTES)
            if self._pending.nbytes >= max(cap, self._compact_at):
                # Mostly rows of requests gone since: drop those; project the live ones only
                # when their taps alone fill half the cap (long contexts) or all of it holds
                # _PENDING_CTX_FACTOR caps (adopted prompts' C), so memory stays bounded.
                live = [b for s in self.scheduler.seqs.values() for b in s.block_table]
                self._pending.compact(live)
                pend = self._pending
                if 2 * pend.taps_bytes >= cap or pend.nbytes >= _PENDING_CTX_FACTOR * cap:
                    self._flush_draft_context()
                # live C rows can sit near the cap: compact again only once the queue has
                # doubled, so the copies stay proportional to the rows added
                self._compact_at = 2 * self._pending.nbytes
            return
        # A step of prefill-only requests alone (a prefill worker's) projects its rows for the
        # handoffs and writes none into this engine's drafter cache: no drafter runs on them
        # here (0.54 ms of a 12.2 ms one-prompt prefill step on the CPU engine).
        own = not self.config.draft.context_only and (
            len(self._pending) > 1
            or not all(self.scheduler.seqs[s.seq_id].prefill_only for s in plan.seqs)
        )
        c = self._project_all(write=own)[-kept:]  # this step's rows come last
        for st in self._state.values():
            st.queued_ctx = 0
        start = 0
        for s in plan.seqs:  # prefill-only requests keep their C rows for the handoff
            n = 1 + accepted.get(s.seq_id, 0) if s.draft_ids else s.num_new_tokens
            seq = self.scheduler.seqs[s.seq_id]
            if seq.prefill_only:
                self._state[s.seq_id].ctx_chunks.append(c[start : start + n])
            start += n

    def _flush_draft_context(self, seqs: Seq[Sequence] | None = None) -> int:
        """Project the verified rows the drafter's context lacks, in one batch: those of `seqs`
        (None: of every live request); -> rows projected. Deferred until the drafter next runs
        on a request: a lagged K = 0 step has no use for them, one projection of many rows
        costs about what one of a few rows does, and rows of requests that finish first are
        never projected. Rows go in step order, and a slot written twice (its blocks freed and
        reused meanwhile) keeps its newest row, exactly as if each step had written its own."""
        if seqs is not None and len(seqs) == len(self.scheduler.seqs):
            seqs = None  # every request: a fast path when only one step's rows wait
        for st in self._state.values() if seqs is None else (self._state[s.seq_id] for s in seqs):
            st.queued_ctx = 0
        live = [b for s in self.scheduler.seqs.values() for b in s.block_table]
        wanted = None if seqs is None else [b for s in seqs for b in s.block_table]
        rows = self._pending.take(live, wanted)
        if rows is None:
            return 0
        c, pos, slot_ids = rows
        self._write_context(c, pos, slot_ids)
        return int(slot_ids.shape[0])

    def _project_all(self, write: bool) -> torch.Tensor:
        """C of every pending row, in order (a prefill step's rows leave in handoffs);
        write=True also writes them into this engine's drafter cache."""
        rows = self._pending.take_all()
        if rows is None:
            return torch.empty(0)
        c, pos, slot_ids, fresh = rows
        if write and bool(fresh.all()):
            self._write_context(c, pos, slot_ids)
        elif write:
            self._write_context(c[fresh], pos[fresh], slot_ids[fresh])
        return c

    def _write_context(self, c: torch.Tensor, pos: torch.Tensor, slot_ids: torch.Tensor) -> None:
        keep = _last_of_each(slot_ids)
        if keep is None:
            self.runner.write_draft_context(c, pos, slot_ids)
        else:
            self.runner.write_draft_context(c[keep], pos[keep], slot_ids[keep])

    def _count(
        self,
        plan: StepPlan,
        touched: dict[Sequence, list[int]],
        accepted: dict[int, int],
        proposal: Proposal | None,
    ) -> None:
        if self._last_plan is None:  # no speculation this step (no drafter, or only prefill)
            return
        self.stats.steps += 1
        # A skipped draft (lagged K = 0) is a round verifying nothing, as a row with l = 0 is.
        if proposal is None and self.rounds is None:  # the common plain step, in one pass
            self._count_skipped(plan, touched)
            return
        row = proposal.row_of() if proposal is not None else {}
        conf = (
            proposal.conf_logits.tolist()
            if proposal is not None and proposal.conf_logits is not None
            else None
        )
        planned = self._planned_ids
        for s in plan.seqs:
            seq = self.scheduler.seqs[s.seq_id]
            if seq not in touched or s.seq_id not in planned:
                continue
            n = min(accepted[s.seq_id], len(touched[seq]))
            self.stats.add_round(len(s.draft_ids), n, len(touched[seq]))
            if self.rounds is not None:
                i = row.get(s.seq_id)  # None: not drafted (a skipped step, or not probed)
                logits = tuple(conf[i][: self.gamma]) if conf and i is not None else ()
                self.rounds.append(
                    RoundRecord(s.seq_id, len(s.draft_ids), n, len(touched[seq]), logits)
                )
            st = self._state[s.seq_id]
            st.rounds += 1
            st.accepted += n

    def _count_skipped(self, plan: StepPlan, touched: dict[Sequence, list[int]]) -> None:
        planned, seqs, state = self._planned_ids, self.scheduler.seqs, self._state
        rounds = committed = 0
        for s in plan.seqs:
            if s.seq_id not in planned:
                continue
            got = touched.get(seqs[s.seq_id])
            if got is None:
                continue
            rounds += 1
            committed += len(got)
            state[s.seq_id].rounds += 1
        self.stats.add_skipped_rounds(rounds, committed)

    def _record(
        self,
        plan: StepPlan,
        num_tokens: int,
        kv_tokens: int,
        counts: torch.Tensor | None,
        t0: float,
        proposal: Proposal | None,
        accepted: dict[int, int],
    ) -> None:
        self._step_no += 1
        per_expert = counts.tolist() if counts is not None else []
        decodes = sum(1 for s in plan.seqs if s.sample and s.num_sample_rows == s.num_new_tokens)
        prefill = sum(s.num_new_tokens for s in plan.seqs if s.num_sample_rows != s.num_new_tokens)
        p = self._last_plan
        rec = StepRecord(
            step=self._step_no,
            num_reqs=len(plan.seqs),
            num_tokens=num_tokens,
            num_prefill_tokens=prefill,
            num_decode_reqs=decodes,
            kv_tokens=kv_tokens,
            step_seconds=time.perf_counter() - t0,
            routed_tokens_per_expert=tuple(per_expert),
            verify_budget_k=sum(len(s.draft_ids) for s in plan.seqs) if p else -1,
            predicted_seconds=p.predicted_seconds if p else float("nan"),
            predicted_theta=p.predicted_theta if p else float("nan"),
            capacity_version=(
                self.planner.capacity.version
                if self.planner is not None and self.planner.capacity is not None
                else -1
            ),
            fallback=p.fallback if p else "",
            routed_tokens_per_rank=_per_rank(per_expert, self.config.parallel.ep_size),
            draft_seconds=self._draft_seconds,
            forward_seconds=self._forward_seconds,
            num_draft_reqs=self._draft_rows,
            probe=p is not None and p.probe,
            draft_resumed=p is not None and (p.resumed or self._draft_backlog),
            num_accepted=sum(accepted.values()),
            planned_tokens=p.planned_tokens if p else float("nan"),
            plain_theta=p.plain_theta if p else float("nan"),
            started_at=self._started_at,
            adopt_seconds=self._adopt_seconds,
            plan_seconds=self._plan_seconds,
            context_seconds=self._context_seconds,
            pinned=p is not None and p.pinned,
            explored=p is not None and p.explored,
        )
        self._adopt_seconds = 0.0
        if self.planner is not None and p is not None:
            drafted = proposal.seq_ids if proposal is not None else ()
            verified = [s for s in plan.seqs if s.seq_id in drafted and s.sample]
            if not verified:  # a skipped (lagged K = 0) step: only the capacity record
                self.planner.observe(_NONE_VERIFIED, _NONE_VERIFIED, rec)
            else:
                self.planner.observe(
                    np.array([len(s.draft_ids) for s in verified], dtype=np.int64),
                    np.array([accepted.get(s.seq_id, 0) for s in verified], dtype=np.int64),
                    rec,
                    [s.seq_id for s in verified],
                )
        if self.on_step is not None:
            self.on_step(rec)

    def close(self) -> None:
        """Stop what outlives the engine: expert-parallel ranks, the planner's worker thread."""
        self.runner.close()
        if self.planner is not None:
            self.planner.close()

    def _collect(self, touched: dict[Sequence, list[int]]) -> list[RequestOutput]:
        outs = []
        for seq, new in touched.items():
            st = self._state[seq.seq_id]
            st.new_ids += new
            if st.detok is not None:
                self._detokenize(seq, st, new)
            outs.append(self._output(seq, st))
        # Finished requests leave the scheduler here; aborted ones are reported once too.
        handoffs = {}
        for sid in [i for i, s in self.scheduler.seqs.items() if s.is_finished]:
            seq = self.scheduler.seqs[sid]
            if seq.finish_reason is FinishReason.HANDOFF:
                handoffs[sid] = self._export(seq, self._state[sid])
            self.scheduler.pop_finished(sid)
            st = self._state.pop(sid)
            if seq not in touched:
                outs.append(self._output(seq, st))
        for o in outs:
            o.handoff = handoffs.get(o.seq_id)
        return outs

    def _export(self, seq: Sequence, st: _ReqState) -> SeqHandoff:
        n = seq.num_prompt_tokens
        slot_ids = torch.tensor(
            slots(seq.block_table, 0, n, self.runner.page_size), device=self.runner.device
        )
        ctx = torch.cat(st.ctx_chunks) if st.ctx_chunks else None
        return SeqHandoff(
            prompt_ids=list(seq.prompt_ids),
            first_token=seq.output_ids[0],
            params=seq.params,
            kv=self.runner.read_kv(slot_ids).cpu(),
            draft_ctx=ctx.cpu() if ctx is not None else None,
            rng_state=st.generator.get_state(),
        )

    def _detokenize(self, seq: Sequence, st: _ReqState, new: list[int]) -> None:
        assert st.detok is not None
        for j, tok in enumerate(new):
            start = len(st.text)
            st.text += st.detok.step([tok])
            if seq.is_finished and j == len(new) - 1:  # emit bytes held for a partial character
                st.text += st.detok.flush()
            cut = find_stop(st.text, seq.params.stop, start)
            if cut is not None:
                st.text = st.text[:cut]
                drop = len(new) - 1 - j
                self.scheduler.stop_at(seq, len(seq.output_ids) - drop)
                if drop:
                    del st.new_ids[-drop:]
                return

    def _output(self, seq: Sequence, st: _ReqState) -> RequestOutput:
        out = RequestOutput(
            seq_id=seq.seq_id,
            prompt_ids=seq.prompt_ids,
            output_ids=list(seq.output_ids),
            text=st.text,
            new_token_ids=st.new_ids,
            finished=seq.is_finished,
            finish_reason=seq.finish_reason.value if seq.finish_reason else None,
            num_preemptions=seq.num_preemptions,
            spec_rounds=st.rounds,
            spec_accepted=st.accepted,
        )
        st.new_ids = []
        return out

    def generate(
        self,
        prompts: Seq[str | list[int]],
        params: SamplingParams | Seq[SamplingParams] | None = None,
        use_tqdm: bool = False,
    ) -> list[RequestOutput]:
        if params is None or isinstance(params, SamplingParams):
            params = [params or SamplingParams()] * len(prompts)
        if len(params) != len(prompts):
            raise ConfigError("generate: one SamplingParams per prompt, or a single one")
        ids = [self.add_request(p, sp) for p, sp in zip(prompts, params, strict=True)]
        done: dict[int, RequestOutput] = {}
        bar = None
        if use_tqdm:
            from tqdm import tqdm

            bar = tqdm(total=len(ids), desc="generate")
        while len(done) < len(ids):
            for o in self.step():
                if o.finished:
                    done[o.seq_id] = o
                    if bar:
                        bar.update(1)
        if bar:
            bar.close()
        return [done[i] for i in ids]


class LLM(LLMEngine):
    """Offline entry point: `LLM("path/to/model").generate(["hello"], SamplingParams(...))`.

    `draft_model` turns on DSpark speculation; other options are config-tree field names.
    """

    def __init__(
        self,
        model: str,
        draft_model: str | None = None,
        seed: int = 0,
        record_rounds: bool = False,
        **kwargs: object,
    ) -> None:
        groups: dict[type, dict[str, object]] = {
            ModelConfig: {},
            CacheConfig: {},
            SchedConfig: {},
            DraftConfig: {"path": draft_model},
            ParallelConfig: {},
        }
        for k, v in kwargs.items():
            owner = next((c for c in groups if k in c.__dataclass_fields__), None)
            if owner is None or k == "path":
                raise ConfigError(f"LLM() got an unknown option {k!r}")
            groups[owner][k] = v
        super().__init__(
            Config(
                model=ModelConfig(path=model, **groups[ModelConfig]),
                cache=CacheConfig(**groups[CacheConfig]),
                sched=SchedConfig(**groups[SchedConfig]),
                draft=DraftConfig(**groups[DraftConfig]),
                seed=seed,
                parallel=ParallelConfig(**groups[ParallelConfig]),
            ),
            record_rounds=record_rounds,
        )
