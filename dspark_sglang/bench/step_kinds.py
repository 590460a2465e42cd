"""Time by step kind (`bench.steps`): what a schedule's learning and switching cost, per R bin.

A lagged deployment's decode steps are not all the steps its K search would take at a settled
load: some draft the whole batch only to time an untested drafter price (exploration,
`StepRecord.explored`), some draft a few rows while K = 0 to refresh the acceptance evidence
(probes), some run a drafter that first projects a backlog of context rows (after plain steps,
or an adopted prompt's: `draft_resumed`). The rest are steady: plain (K = 0), full (every row
verifies every draft) or trimmed (fewer tokens than that: a K below every draft, a selective
subset, or rows capped near their end). Each step is set against the best steady kind's rate at
its R (tokens emitted per second of step time; at its exact R where that kind ran there at
least MIN_KIND_STEPS times, else over its R bin): `lost` is its seconds less the seconds that
rate takes for its tokens. Summed per kind, that is what each kind cost against the best steady
way this deployment decoded at that load. It is an average rate, not what the step would have
made the other way: the planner trims or skips drafting where it expects the drafts to fare
badly, so its trimmed and plain steps run in worse spells than its full ones, and their lost
seconds overstate what mixing cost (s56_full: lagged's trimmed steps at R = 2 "lost" 7.8 % of
that load's time to its full ones there, while lagged's R = 2 rate was the best of the four
policies'). The learning kinds (explore, probe, resumed) are not chosen on the drafts' outlook,
so theirs read closer to a cost.

In session 56's sweep (docs/results/s56_notes.txt) lagged's exploration steps lost 2.4 s of its
decode time over every R (1.0 %), 3.0 % of it at R 33-64; probes 0.9 s, resumed steps 4.2 s.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from dspark_sglang.bench.steps import _fmt, _Step, bin_label, r_bin_bounds

KINDS = ("plain", "full", "trimmed", "resumed", "probe", "explore")
STEADY = ("plain", "full", "trimmed")
MIN_KIND_STEPS = 10  # steps of a steady kind at an R (or R bin) before its rate is a reference


@dataclass(frozen=True)
class KindRow:
    policy: str
    r_lo: int  # 0, 0: every R
    r_hi: int
    kind: str
    steps: int
    seconds: float  # summed step seconds
    time_share: float  # of the bin's decode step seconds
    tok_per_s: float  # emitted tokens over the kind's step seconds
    lost_seconds: float  # over the best steady kind's rate at each step's R; nan: no reference
    lost_share: float  # lost seconds over the bin's decode step seconds


@dataclass(slots=True)
class _Tagged:
    """A decode step as this table reads it: its R, emitted tokens, seconds and kind, and its
    lost seconds once every reference rate is known."""

    num_reqs: int
    tokens: int
    seconds: float
    kind: str
    lost: float = math.nan


def step_kind(s: _Step, per_row: int) -> str:
    """One of KINDS. per_row: the log's largest tokens a row verifies (1 + the drafts)."""
    if s.num_draft_reqs <= 0 and s.draft_seconds <= 0.0:
        return "plain"
    if s.probe:
        return "probe"
    if s.explored:
        return "explore"
    if s.draft_resumed:
        return "resumed"
    whole = s.num_draft_reqs in (0, s.num_reqs)
    return "full" if whole and s.num_tokens >= s.num_reqs * per_row else "trimmed"


def _best_rate(ts: list[_Tagged]) -> float:
    """The best tokens/s of a steady kind with at least MIN_KIND_STEPS steps in ts; nan: none."""
    best = math.nan
    for kind in STEADY:
        got = [t for t in ts if t.kind == kind]
        secs = math.fsum(t.seconds for t in got)
        if len(got) >= MIN_KIND_STEPS and secs > 0.0:
            rate = sum(t.tokens for t in got) / secs
            best = rate if not math.isfinite(best) else max(best, rate)
    return best


def kind_rows(policy: str, steps: list[_Step]) -> list[KindRow]:
    """One row per (R bin, kind) that has steps, then the same over every R ("all", each step
    still against its own R's reference). Empty for a log of one kind only (no-spec)."""
    if not steps:
        return []
    per_row = max(s.num_tokens // s.num_reqs for s in steps)
    tagged = [
        _Tagged(
            s.num_reqs, s.num_decode_reqs + s.num_accepted, s.step_seconds, step_kind(s, per_row)
        )
        for s in steps
    ]
    if len({t.kind for t in tagged}) < 2:
        return []
    by_r: dict[int, list[_Tagged]] = {}
    by_bin: dict[tuple[int, int], list[_Tagged]] = {}
    for t in tagged:
        by_r.setdefault(t.num_reqs, []).append(t)
        by_bin.setdefault(r_bin_bounds(t.num_reqs), []).append(t)
    at_r = {r: _best_rate(ts) for r, ts in by_r.items()}
    at_bin = {b: _best_rate(ts) for b, ts in by_bin.items()}
    for t in tagged:
        ref = at_r[t.num_reqs]
        if not math.isfinite(ref):
            ref = at_bin[r_bin_bounds(t.num_reqs)]
        t.lost = t.seconds - t.tokens / ref if math.isfinite(ref) else math.nan
    rows = []
    for (lo, hi), ts in [*sorted(by_bin.items()), ((0, 0), tagged)]:
        total = math.fsum(t.seconds for t in ts)
        for kind in KINDS:
            got = [t for t in ts if t.kind == kind]
            if not got:
                continue
            secs = math.fsum(t.seconds for t in got)
            lost = math.fsum(t.lost for t in got)  # nan where a step had no reference
            rows.append(
                KindRow(
                    policy,
                    lo,
                    hi,
                    kind,
                    len(got),
                    secs,
                    secs / total if total > 0.0 else math.nan,
                    sum(t.tokens for t in got) / secs if secs > 0.0 else math.nan,
                    lost,
                    lost / total if total > 0.0 else math.nan,
                )
            )
    return rows


def print_kinds(rows: list[KindRow]) -> None:
    if not rows:
        return
    print(
        "time by step kind (lost: a kind's step seconds over what the best steady kind at the "
        f"same R, >= {MIN_KIND_STEPS} steps there, takes for its tokens; share of the bin's "
        "decode time):"
    )
    print(
        f"{'R':>7s} {'policy':14s} {'kind':8s} {'steps':>6s} {'time%':>6s} {'tok/s':>8s} "
        f"{'lost s':>7s} {'lost%':>6s}"
    )
    for r in rows:
        print(
            f"{bin_label(r.r_lo, r.r_hi):>7s} {r.policy:14s} {r.kind:8s} {r.steps:6d} "
            f"{_fmt(100 * r.time_share, '6.1f')} {_fmt(r.tok_per_s, '8.1f')} "
            f"{_fmt(r.lost_seconds, '7.2f')} {_fmt(100 * r.lost_share, '6.1f')}"
        )
