"""`python -m dspark_sglang.bench.steps`: where a deployment's decode time goes, by batch size.

Reads the step logs a server writes with `--step-log DIR` (one JSON `StepRecord` per line in
`DIR/<worker>.steps.jsonl`; `bench.sweep` puts one folder per policy under `{policy}`) and
reports, per policy and running-request bin R (1, 2, 3-4, 5-8, … : up to a power of two), the
decode steps' realised rate (tokens emitted per second of step time), tokens a step, how often
the drafter ran and how often a lagged K was pinned (no search: engine/planner.py PIN_PLANS),
median step / forward / drafter / host milliseconds (and the host's timed parts: the planner
before the forward, the drafter-context queue after it), the capacity model's
median predicted / measured step time, and for lagged the tokens emitted over the tokens its K
was planned on (the lagged survival's top K: what the lag costs the choice of K), and the time
between steps: the mean gap from one decode step's end to the next one's start where both ran
the same requests (none left or joined, so no wait for a handoff: output handling, the
planner's learning, the server loop), and the handoff adoptions (`adopt_seconds`: target KV
and drafter context writes) per step of the bin. Half of lagged's deficit sat there in
session 38.
Then each policy's forward and drafter time at identical shapes over a reference policy's
(`--speed-reference`, default verify-all): two deployments of one engine should run the same
forward, (R, B), in the same time, and on a shared host they do not (a served sweep on the
2-core VM: both lagged deployments ran them 7 % slower than verify-all's, one pass 15 %, the
next 2 %), which a throughput ratio between them cannot tell from a policy's effect.
And, for a schedule that verifies fewer than every draft (lagged, sync), what trimming saved:
its trimmed drafting steps over full ones at the same R nearby, measured and as the capacity
model predicted them (`trim_rows`). Last, per policy that ran more than one kind of step, the
time by step kind (plain, full, trimmed, resumed, probe, explore) and what each kind lost
against the best steady kind at the same R (`bench.step_kinds`).
Request-level throughput mixes arrivals, tails and prefill into every number; these rates
compare the policies' steps at equal load, which is what a verify schedule decides. Reads the
logs only: no engine, no network.
"""

from __future__ import annotations

import argparse
import bisect
import csv
import itertools
import json
import math
import shlex
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

import msgspec
import numpy as np

LOG_SUFFIX = ".steps.jsonl"


class _Step(msgspec.Struct):
    """The StepRecord fields this report reads (a log line carries more)."""

    num_reqs: int
    num_tokens: int
    num_prefill_tokens: int
    num_decode_reqs: int
    kv_tokens: int
    step_seconds: float
    predicted_seconds: float | None = None
    draft_seconds: float = 0.0
    forward_seconds: float | None = None
    num_draft_reqs: int = 0
    num_accepted: int = 0
    planned_tokens: float | None = None
    plain_theta: float | None = None
    draft_resumed: bool = False
    probe: bool = False
    started_at: float | None = None
    adopt_seconds: float = 0.0
    plan_seconds: float | None = None
    context_seconds: float | None = None
    pinned: bool = False
    explored: bool = False
    # set by read_steps from the next record: the gap to it when it is a decode step of the
    # same requests (None: a request left or joined, a prefill step, the log's end, or
    # unstamped records), and the adoptions it carries (those between the two steps)
    gap_after: float | None = None
    adopt_after: float = 0.0


@dataclass(frozen=True)
class BinRow:
    policy: str
    r_lo: int
    r_hi: int
    steps: int
    drafting_share: float  # steps that ran the drafter
    pinned_share: float  # lagged steps whose K was pinned, without a search (planner PIN_PLANS)
    mean_tokens_in_forward: float  # B
    tokens_per_step: float  # emitted: one per decode row plus the accepted drafts
    tok_per_s: float  # emitted tokens over summed step seconds
    step_ms: float  # medians
    forward_ms: float  # nan: the engine did not time its forward
    drafter_ms: float  # over drafting steps; nan: none drafted
    host_ms: float  # step - forward - drafter
    gap_ms: float  # mean gap to a next step of the same requests, adoptions out; nan: none
    adopt_ms: float  # handoff adoptions after the bin's steps, per step
    predicted_over_measured: float  # nan: no capacity model priced the steps
    # lagged: emitted / planned tokens over the steps whose K was planned on lagged survival
    realised_over_planned: float
    # lagged K > 0: median over those steps of the planned Θ (planned tokens / predicted seconds)
    # over the model's plain-step Θ when it was planned: the margin drafting was chosen on
    planned_over_plain: float = math.nan
    # the parts of host_ms the engine times (StepRecord.plan_seconds, .context_seconds): the
    # planner before the forward and the drafter-context queue after it; nan: an older log
    plan_ms: float = math.nan
    context_ms: float = math.nan


def r_bin_bounds(r: int) -> tuple[int, int]:
    """(lo, hi): the bin of R, hi the power of two at or above R and lo just past the one below."""
    hi = 1 << max(0, (int(r) - 1).bit_length())
    return (hi // 2 + 1 if hi > 1 else 1), hi


def bin_label(lo: int, hi: int) -> str:
    """An R bin as the tables print it: "1", "3-4", or "all" for (0, 0)."""
    return "all" if hi == 0 else f"{lo}" if lo == hi else f"{lo}-{hi}"


def read_steps(path: Path) -> list[_Step]:
    """Decode-only steps (no prompt tokens in the forward) of one step log, each with the gap
    to the next record and the adoptions that record carries."""
    dec = msgspec.json.Decoder(_Step)
    every = []
    with path.open("rb") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                every.append(dec.decode(line))
            except msgspec.DecodeError as e:
                raise ValueError(f"{path}:{n}: not a step record ({e})") from None
    decode = [s.num_prefill_tokens == 0 and s.num_reqs > 0 and s.step_seconds > 0.0 for s in every]
    for i, (s, nxt) in enumerate(itertools.pairwise(every)):
        if not decode[i]:
            continue
        s.adopt_after = nxt.adopt_seconds
        if decode[i + 1] and _same_requests(s, nxt) and _stamped(s, nxt):
            s.gap_after = nxt.started_at - s.started_at - s.step_seconds - nxt.adopt_seconds
    return [s for s, d in zip(every, decode, strict=True) if d]


def _same_requests(s: _Step, nxt: _Step) -> bool:
    """Whether `nxt` decodes the requests `s` did: as many, and its context (kv_tokens, less the
    tokens it forwards) is `s`'s plus what `s` emitted. A request that left and one that joined
    between them (a wait for its handoff: at c = 1 about 26 ms) break the sum."""
    ctx, emitted = s.kv_tokens - s.num_tokens, s.num_decode_reqs + s.num_accepted
    return nxt.num_reqs == s.num_reqs and nxt.kv_tokens - nxt.num_tokens == ctx + emitted


def _stamped(*ss: _Step) -> bool:
    return all(s.started_at is not None and math.isfinite(s.started_at) for s in ss)


def _median(xs: list[float]) -> float:
    xs = [x for x in xs if x is not None and math.isfinite(x)]
    return float(np.median(xs)) if xs else math.nan


def _finite(*xs: float | None) -> bool:
    return all(x is not None and math.isfinite(x) for x in xs)


def _mean(xs: list[float | None]) -> float:
    xs = [x for x in xs if x is not None and math.isfinite(x)]
    return float(np.mean(xs)) if xs else math.nan


def summarize(policy: str, steps: list[_Step]) -> list[BinRow]:
    """One row per R bin that has steps, smallest bin first."""
    bins: dict[tuple[int, int], list[_Step]] = {}
    for s in steps:
        bins.setdefault(r_bin_bounds(s.num_reqs), []).append(s)
    rows = []
    for (lo, hi), ss in sorted(bins.items()):
        drafted = [s for s in ss if s.num_draft_reqs > 0]
        tokens = [s.num_decode_reqs + s.num_accepted for s in ss]
        fwd = [s.forward_seconds for s in ss]
        host = [
            s.step_seconds - s.forward_seconds - s.draft_seconds
            for s in ss
            if s.forward_seconds is not None and math.isfinite(s.forward_seconds)
        ]
        ratio = [
            s.predicted_seconds / s.step_seconds for s in ss if s.predicted_seconds is not None
        ]
        planned = [
            (s.num_decode_reqs + s.num_accepted, s.planned_tokens)
            for s in ss
            if s.planned_tokens is not None and math.isfinite(s.planned_tokens)
        ]
        margin = [
            s.planned_tokens / s.predicted_seconds / s.plain_theta
            for s in ss
            if _finite(s.planned_tokens, s.predicted_seconds, s.plain_theta)
            and s.predicted_seconds > 0.0
            and s.plain_theta > 0.0
        ]
        rows.append(
            BinRow(
                policy=policy,
                r_lo=lo,
                r_hi=hi,
                steps=len(ss),
                drafting_share=len(drafted) / len(ss),
                pinned_share=sum(s.pinned for s in ss) / len(ss),
                mean_tokens_in_forward=float(np.mean([s.num_tokens for s in ss])),
                tokens_per_step=float(np.mean(tokens)),
                tok_per_s=float(sum(tokens) / sum(s.step_seconds for s in ss)),
                step_ms=1e3 * _median([s.step_seconds for s in ss]),
                forward_ms=1e3 * _median(fwd),
                drafter_ms=1e3 * _median([s.draft_seconds for s in drafted]),
                host_ms=1e3 * _median(host),
                gap_ms=1e3 * _mean([s.gap_after for s in ss]),
                adopt_ms=1e3 * float(np.mean([s.adopt_after for s in ss])),
                predicted_over_measured=_median(ratio),
                realised_over_planned=(
                    sum(t for t, _ in planned) / sum(p for _, p in planned) if planned else math.nan
                ),
                planned_over_plain=_median(margin),
                plan_ms=1e3 * _median([s.plan_seconds for s in ss]),
                context_ms=1e3 * _median([s.context_seconds for s in ss]),
            )
        )
    return rows


# steps each log needs at a shape (R, B) before its median forward time counts
MIN_SHAPE_STEPS = 10


@dataclass(frozen=True)
class SpeedRow:
    policy: str
    reference: str
    r_lo: int  # 0, 0: every R
    r_hi: int
    shapes: int  # (R, B) with MIN_SHAPE_STEPS steps in both logs
    forward_ratio: float  # median over those shapes of median forward / reference's; nan: none
    draft_sizes: int  # R whose steady whole-batch drafter runs both logs timed enough
    drafter_ratio: float


def by_shape(
    steps: list[_Step], min_steps: int = MIN_SHAPE_STEPS
) -> tuple[dict[tuple[int, int], float], dict[int, float]]:
    """Median forward seconds per (R, B), and median drafter seconds per R over steady runs that
    drafted every row (not resumed after plain steps), where `min_steps` steps had one."""
    fwd: dict[tuple[int, int], list[float]] = {}
    draft: dict[int, list[float]] = {}
    for s in steps:
        if s.forward_seconds is not None and math.isfinite(s.forward_seconds):
            fwd.setdefault((s.num_reqs, s.num_tokens), []).append(s.forward_seconds)
        if s.draft_seconds > 0.0 and s.num_draft_reqs == s.num_reqs and not s.draft_resumed:
            draft.setdefault(s.num_reqs, []).append(s.draft_seconds)
    med = lambda d: {k: float(np.median(v)) for k, v in d.items() if len(v) >= min_steps}
    return med(fwd), med(draft)


def speed_rows(logs: dict[str, list[_Step]], reference: str) -> list[SpeedRow]:
    """Each other policy's time at identical shapes over `reference`'s, per R bin and overall."""
    ref_fwd, ref_draft = by_shape(logs[reference])
    rows = []
    for policy, steps in logs.items():
        if policy == reference:
            continue
        fwd, draft = by_shape(steps)
        f = {k: fwd[k] / ref_fwd[k] for k in fwd.keys() & ref_fwd.keys()}
        d = {r: draft[r] / ref_draft[r] for r in draft.keys() & ref_draft.keys()}
        bins = sorted({r_bin_bounds(r) for r, _ in f} | {r_bin_bounds(r) for r in d})
        for lo, hi in [*bins, (0, 0)]:
            fb = [v for (r, _), v in f.items() if lo <= r <= hi or hi == 0]
            db = [v for r, v in d.items() if lo <= r <= hi or hi == 0]
            rows.append(
                SpeedRow(policy, reference, lo, hi, len(fb), _median(fb), len(db), _median(db))
            )
    return rows


# a trimmed drafting step pairs with a full one at its R up to this many decode steps apart
TRIM_WINDOW = 15


@dataclass(frozen=True)
class TrimRow:
    policy: str
    r_lo: int  # 0, 0: every R
    r_hi: int
    pairs: int  # (trimmed, full) drafting steps at one R, TRIM_WINDOW steps apart at most
    tokens_share: float  # median B of the trimmed over the full step's
    measured: float  # median step seconds, trimmed / full
    predicted: float  # median of the capacity model's predicted seconds, trimmed / full


def trim_rows(policy: str, steps: list[_Step], window: int = TRIM_WINDOW) -> list[TrimRow]:
    """What verifying fewer than every draft saved: each steady drafting step that drafted and
    verified every row in full (B = R x the log's largest tokens a row) paired with the steps at
    the same R within `window` decode steps of it that drafted every row but verified fewer
    tokens, and the median of their step times' ratio against the model's predicted one. A
    model that prices the trim right reads the same; session 55 found the model expecting twice
    the saving below R = 12 (docs/results/s55_notes.txt). Probes and resumed drafter runs (a
    backlog's projection) are left out. Empty without both kinds, or where no capacity model
    priced the steps."""
    drafting = [
        (i, s)
        for i, s in enumerate(steps)
        if s.draft_seconds > 0.0
        and not s.probe
        and not s.draft_resumed
        and s.num_draft_reqs in (0, s.num_reqs)
    ]
    per_row = max((s.num_tokens // s.num_reqs for _, s in drafting), default=0)
    if per_row < 2:
        return []
    full = [(i, s) for i, s in drafting if s.num_tokens == s.num_reqs * per_row]
    trimmed: dict[int, list[tuple[int, _Step]]] = {}
    for i, s in drafting:
        if s.num_tokens < s.num_reqs * per_row:
            trimmed.setdefault(s.num_reqs, []).append((i, s))
    pairs: list[tuple[int, float, float, float]] = []  # (R, B share, measured, predicted)
    at = {r: [j for j, _ in ts] for r, ts in trimmed.items()}  # step indices, ascending
    for i, f in full:
        near = trimmed.get(f.num_reqs, [])
        lo = bisect.bisect_left(at.get(f.num_reqs, []), i - window)
        hi = bisect.bisect_right(at.get(f.num_reqs, []), i + window)
        for _, t in near[lo:hi]:
            pred = (
                t.predicted_seconds / f.predicted_seconds
                if _finite(t.predicted_seconds, f.predicted_seconds) and f.predicted_seconds > 0
                else math.nan
            )
            share = t.num_tokens / f.num_tokens
            pairs.append((f.num_reqs, share, t.step_seconds / f.step_seconds, pred))
    if not any(math.isfinite(p[3]) for p in pairs):  # no model priced them (verify-all's
        return []  # shorter steps are rows capped near their end, not a planner's trim)
    rows = []
    bins = sorted({r_bin_bounds(r) for r, *_ in pairs})
    for lo, hi in [*bins, (0, 0)]:
        got = [p for p in pairs if lo <= p[0] <= hi or hi == 0]
        rows.append(
            TrimRow(
                policy,
                lo,
                hi,
                len(got),
                _median([p[1] for p in got]),
                _median([p[2] for p in got]),
                _median([p[3] for p in got]),
            )
        )
    return rows


def print_trim(rows: list[TrimRow]) -> None:
    if not rows:
        return
    print(
        f"trimmed drafting steps over full ones at the same R, <= {TRIM_WINDOW} steps apart "
        "(median of pairs; measured against the capacity model's prediction):"
    )
    print(f"{'R':>7s} {'policy':14s} {'pairs':>6s} {'B share':>7s} {'measured':>8s} {'model':>7s}")
    for r in rows:
        print(
            f"{bin_label(r.r_lo, r.r_hi):>7s} {r.policy:14s} {r.pairs:6d} "
            f"{_fmt(r.tokens_share, '7.3f')} {_fmt(r.measured, '8.3f')} "
            f"{_fmt(r.predicted, '7.3f')}"
        )


def print_speed(rows: list[SpeedRow]) -> None:
    if not rows:
        return
    print(
        f"time at identical shapes over {rows[0].reference}'s (median over (R, B) shapes / R "
        f"with >= {MIN_SHAPE_STEPS} steps in both logs; 1 = as fast):"
    )
    print(
        f"{'R':>7s} {'policy':14s} {'shapes':>6s} {'forward':>8s} {'R drafted':>9s} {'drafter':>8s}"
    )
    for r in rows:
        rng = bin_label(r.r_lo, r.r_hi)
        print(
            f"{rng:>7s} {r.policy:14s} {r.shapes:6d} {_fmt(r.forward_ratio, '8.3f')} "
            f"{r.draft_sizes:9d} {_fmt(r.drafter_ratio, '8.3f')}"
        )


def find_logs(folder: Path, worker: str) -> dict[str, Path]:
    """{policy: log}: FOLDER/<worker>.steps.jsonl is one policy (named by the folder), else each
    subfolder holding one is."""
    own = folder / f"{worker}{LOG_SUFFIX}"
    if own.is_file():
        return {folder.name: own}
    return {
        sub.name: sub / f"{worker}{LOG_SUFFIX}"
        for sub in sorted(folder.iterdir())
        if (sub / f"{worker}{LOG_SUFFIX}").is_file()
    }


def _plain(row: object) -> dict[str, object]:
    """A row as JSON/CSV values: nan as None."""
    return {
        k: None if isinstance(v, float) and not math.isfinite(v) else v
        for k, v in asdict(row).items()
    }


def _fmt(x: float, spec: str) -> str:
    return "-" if not math.isfinite(x) else format(x, spec)


def print_table(rows: list[BinRow]) -> None:
    best: dict[tuple[int, int], float] = {}
    for r in rows:
        best[(r.r_lo, r.r_hi)] = max(best.get((r.r_lo, r.r_hi), 0.0), r.tok_per_s)
    head = (
        f"{'R':>7s} {'policy':14s} {'steps':>6s} {'draft%':>6s} {'pin%':>5s} {'B':>6s} "
        f"{'tok/step':>8s} "
        f"{'tok/s':>8s} {'/best':>6s} {'step ms':>8s} {'fwd ms':>7s} {'draft ms':>8s} "
        f"{'host ms':>7s} {'plan ms':>7s} {'ctx ms':>6s} {'gap ms':>6s} {'adopt ms':>8s} "
        f"{'pred/real':>9s} {'real/plan':>9s} "
        f"{'plan/plain':>10s}"
    )
    print(head)
    for r in sorted(rows, key=lambda r: (r.r_hi, -r.tok_per_s)):
        rng = bin_label(r.r_lo, r.r_hi)
        print(
            f"{rng:>7s} {r.policy:14s} {r.steps:6d} {100 * r.drafting_share:6.1f} "
            f"{100 * r.pinned_share:5.1f} {r.mean_tokens_in_forward:6.1f} "
            f"{r.tokens_per_step:8.2f} {r.tok_per_s:8.1f} "
            f"{r.tok_per_s / best[(r.r_lo, r.r_hi)]:6.3f} {_fmt(r.step_ms, '8.2f')} "
            f"{_fmt(r.forward_ms, '7.2f')} {_fmt(r.drafter_ms, '8.2f')} "
            f"{_fmt(r.host_ms, '7.2f')} {_fmt(r.plan_ms, '7.2f')} {_fmt(r.context_ms, '6.2f')} "
            f"{_fmt(r.gap_ms, '6.2f')} {_fmt(r.adopt_ms, '8.2f')} "
            f"{_fmt(r.predicted_over_measured, '9.3f')} "
            f"{_fmt(r.realised_over_planned, '9.3f')} {_fmt(r.planned_over_plain, '10.3f')}"
        )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m dspark_sglang.bench.steps", description=__doc__)
    ap.add_argument("folders", nargs="+", type=Path, metavar="DIR", help="--step-log folders")
    ap.add_argument("--worker", default="decode0", help="whose log to read (default decode0)")
    ap.add_argument("--min-steps", type=int, default=20, help="hide bins with fewer steps")
    ap.add_argument("--csv", type=Path, help="write the rows as CSV here")
    ap.add_argument("--json", type=Path, help="write the rows and the command as JSON here")
    ap.add_argument(
        "--speed-reference",
        default="verify-all",
        metavar="POLICY",
        help="compare each policy's time at identical shapes with this one's (default "
        "%(default)s; absent: the first policy read)",
    )
    ap.add_argument(
        "--cells",
        type=Path,
        metavar="JSONL",
        help="a sweep's per-cell records (OUT_DIR/NAME.jsonl): also compare the identical "
        "shapes cell by cell, each policy's cell with the reference's at the same pass and c "
        "(bench.paired_speed)",
    )
    ap.add_argument(
        "--min-kind-steps",
        type=int,
        default=1,
        metavar="N",
        help="time by step kind: hide a bin's kinds with fewer steps (default %(default)s)",
    )
    args = ap.parse_args(argv)
    if args.min_kind_steps < 1:
        ap.error("--min-kind-steps must be >= 1")
    if args.cells is not None and not args.cells.is_file():
        ap.error(f"--cells {args.cells}: no such file")
    if args.min_steps < 1:
        ap.error("--min-steps must be >= 1")
    logs: dict[str, Path] = {}
    for folder in args.folders:
        if not folder.is_dir():
            ap.error(f"DIR {folder}: not a folder")
        found = find_logs(folder, args.worker)
        if not found:
            ap.error(f"DIR {folder}: no {args.worker}{LOG_SUFFIX} in it or its subfolders")
        clash = set(found) & set(logs)
        if clash:
            ap.error(f"DIR {folder}: policy {sorted(clash)[0]!r} already read from another DIR")
        logs.update(found)
    rows: list[BinRow] = []
    read: dict[str, list[_Step]] = {}
    try:
        for policy, path in logs.items():
            read[policy] = read_steps(path)
            rows += [r for r in summarize(policy, read[policy]) if r.steps >= args.min_steps]
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print_table(rows)
    ref = args.speed_reference if args.speed_reference in read else next(iter(read))
    speed = speed_rows(read, ref)
    print_speed(speed)
    trims = [t for policy, ss in read.items() for t in trim_rows(policy, ss)]
    print_trim(trims)
    from dspark_sglang.bench import step_kinds  # it builds on this module

    kinds = [
        k
        for policy, ss in read.items()
        for k in step_kinds.kind_rows(policy, ss)
        if k.r_hi == 0 or k.steps >= args.min_kind_steps
    ]
    step_kinds.print_kinds(kinds)
    paired = []
    if args.cells is not None:
        from dspark_sglang.bench import paired_speed  # it builds on this module

        try:
            paired = paired_speed.paired_rows(read, paired_speed.read_cells(args.cells), ref)
        except ValueError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        paired_speed.print_paired(paired)
    plain = [_plain(r) for r in rows]
    if args.csv:
        args.csv.parent.mkdir(parents=True, exist_ok=True)
        with args.csv.open("w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=list(asdict(rows[0])) if rows else ["policy"])
            w.writeheader()
            w.writerows(plain)
    if args.json:
        cmd = "python -m dspark_sglang.bench.steps " + shlex.join(argv or sys.argv[1:])
        args.json.parent.mkdir(parents=True, exist_ok=True)
        report = {
            "tool": "dspark_sglang.bench.steps",
            "command": cmd,
            "rows": plain,
            "speed": [_plain(r) for r in speed],
            "speed_paired": [_plain(r) for r in paired],
            "trim": [_plain(r) for r in trims],
            "kinds": [_plain(r) for r in kinds],
        }
        args.json.write_text(json.dumps(report, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
