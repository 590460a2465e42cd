"""`python -m dspark_sglang.profile --ep-size N`: expert-parallel step time vs B on this machine,
and how well the EP-aware capacity model predicts EP=N step times (docs/ep.md).

Decode forwards (R = B requests, one new token each, over a prefilled context) run at EP=1 and
EP=N on the same prompts, drawn from the whole vocabulary (balanced routing) or from the tokens
that route to rank 0's experts (skewed). The capacity model is calibrated on one balanced prompt
set plus a microbenchmark of one rank's experts, then predicts a second balanced set and the skewed
set, either from the measured expert popularity (EP-aware) or from the calibration's (EP-blind).

Two views of a step: wall seconds, and the critical path = the busiest rank's CPU seconds (Linux
/proc schedstat). On a host shared with other jobs, ranks do not get a core each, so wall time
follows total work; the critical path is what a step costs when every rank has its own core.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import tempfile
import time
from dataclasses import dataclass, replace
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import numpy as np
import torch

from dspark_sglang.algo.capacity import CapacityModel, Curve, ExpertParallelTerm
from dspark_sglang.algo.capacity_fit import fit_table
from dspark_sglang.config import CacheConfig, Config, ModelConfig, ParallelConfig
from dspark_sglang.engine.batch import build_batch
from dspark_sglang.engine.block_pool import BlockPool
from dspark_sglang.engine.ep import LeaderRunner, create_runner
from dspark_sglang.engine.profiler import expert_seconds
from dspark_sglang.engine.runner import ModelRunner
from dspark_sglang.engine.sequence import Sequence, Status
from dspark_sglang.hostinfo import cpu_model
from dspark_sglang.models.attention import ForwardContext, forward_context, packed_causal_metadata
from dspark_sglang.models.moe import SparseMoeBlock
from dspark_sglang.types import SamplingParams, ScheduledSeq, StepPlan

WALL_Q = 25  # wall seconds per point: lower quartile, robust to a shared host's preemptions
ROUTINGS = ("calibration", "balanced", "skewed")  # calibration, balanced: fresh random prompts
LARGE_B = 64  # MAPE is also reported from here up, where expert load imbalance shows
SKEW_TOKENS = 64  # the skewed prompt set draws from this many tokens
PREFILL_CHUNK = 32  # sequences per prefill forward


def rank0_affinity(runner: ModelRunner, ep_size: int) -> torch.Tensor:
    """[V] share of each token's routed pairs (over the MoE layers) that land on rank 0's experts,
    the token alone at position 0."""
    arch, model = runner.arch, runner.model
    vocab, owned = arch.vocab_size, arch.num_experts // ep_size
    hits = torch.zeros(vocab)
    gates = [m.gate for m in model.modules() if isinstance(m, SparseMoeBlock)]

    def count(_mod: torch.nn.Module, _inp: Any, out: tuple[torch.Tensor, torch.Tensor]) -> None:
        hits.add_((out[1] < owned).sum(-1).float().cpu())

    hooks = [g.register_forward_hook(count) for g in gates]
    meta = packed_causal_metadata([1] * vocab, runner.device)
    ids = torch.arange(vocab, device=runner.device)
    try:
        with torch.inference_mode(), forward_context(ForwardContext(meta, None)):
            model(ids, torch.zeros_like(ids))
    finally:
        for h in hooks:
            h.remove()
    return hits / (arch.num_experts_per_tok * len(gates))


@dataclass
class Workload:
    """`max_reqs` sequences of `ctx` prefilled tokens + 1 decode token, on one runner's pool."""

    seqs: dict[int, Sequence]
    ctx: int


def prefill(runner: ModelRunner, pool: BlockPool, prompts: list[list[int]], ctx: int) -> Workload:
    seqs: dict[int, Sequence] = {}
    for i, p in enumerate(prompts):
        seq = Sequence(i, p, SamplingParams(), arrival=i)
        seq.status = Status.RUNNING
        pool.grow(seq.block_table, len(p))
        seqs[i] = seq
    ids = list(seqs)
    for lo in range(0, len(ids), PREFILL_CHUNK):
        chunk = ids[lo : lo + PREFILL_CHUNK]
        plan = StepPlan(tuple(ScheduledSeq(i, 0, ctx, sample=False) for i in chunk))
        runner.forward(build_batch(plan, seqs, runner.page_size, runner.device))
    for s in seqs.values():
        s.num_cached = ctx
    return Workload(seqs, ctx)


def _cpu_seconds(runner: ModelRunner) -> np.ndarray:
    """CPU seconds so far of every rank's main thread (it runs the forward): this thread for
    rank 0, /proc/PID/schedstat for the followers."""
    out = [time.thread_time()]
    if isinstance(runner, LeaderRunner):
        for p in runner.followers.procs:
            with open(f"/proc/{p.pid}/schedstat") as f:
                out.append(int(f.read().split()[0]) * 1e-9)
    return np.asarray(out)


def time_decode(
    runner: ModelRunner, w: Workload, num_reqs: int, repeats: int, warmup: int
) -> tuple[list[float], np.ndarray, list[int]]:
    """Decode forwards of the first num_reqs sequences (all rows scored): wall seconds of each,
    CPU seconds per step of each rank, routed pairs per expert."""
    plan = StepPlan(tuple(ScheduledSeq(i, w.ctx, 1, sample=True) for i in range(num_reqs)))
    batch = build_batch(plan, w.seqs, runner.page_size, runner.device)
    for _ in range(warmup):
        runner.forward(batch)
    times, counts = [], []
    cpu0 = _cpu_seconds(runner)
    for _ in range(repeats):
        t0 = time.perf_counter()
        out = runner.forward(batch)
        times.append(time.perf_counter() - t0)
        assert out.expert_counts is not None
        counts = out.expert_counts.tolist()
    return times, (_cpu_seconds(runner) - cpu0) / repeats, counts


def prompts_for(tokens: np.ndarray, num: int, length: int, seed: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.choice(tokens, size=length).tolist() for _ in range(num)]


def mape(pred: np.ndarray, meas: np.ndarray) -> float:
    return float(np.mean(np.abs(pred - meas) / meas))


@dataclass
class Samples:
    wall: dict[tuple[int, str, int], list[float]]  # (ep, routing, B) -> seconds per step
    cpu: dict[tuple[int, str, int], list[np.ndarray]]  # -> per-rank CPU seconds per step
    counts: dict[tuple[int, str, int], list[int]]  # -> routed pairs per expert (one step)


def run(args: argparse.Namespace, model_path: str) -> tuple[Samples, list[int], list[float], Any]:
    n, sizes, (ctx,) = args.ep_size, list(args.batch_sizes), args.context_len
    max_reqs = max(sizes)
    cache = CacheConfig(num_blocks=len(ROUTINGS) * max_reqs * -(-(ctx + 1) // 16) + 8)
    model = ModelConfig(model_path, dtype=args.dtype, device=args.device)
    runners = {
        1: create_runner(Config(model, cache)),
        n: create_runner(Config(model, cache, parallel=ParallelConfig(ep_size=n))),
    }
    arch = runners[1].arch
    data = Samples({}, {}, {})
    try:
        affinity = rank0_affinity(runners[1], n)
        skew_set = torch.argsort(affinity, descending=True)[:SKEW_TOKENS].numpy()
        token_sets = {
            "calibration": np.arange(arch.vocab_size),
            "balanced": np.arange(arch.vocab_size),
            "skewed": skew_set,
        }
        work: dict[tuple[int, str], Workload] = {}
        for ep, runner in runners.items():
            pool = BlockPool(runner.num_blocks, runner.page_size)
            for seed, (name, toks) in enumerate(token_sets.items()):
                ps = prompts_for(toks, max_reqs, ctx + 1, seed)
                work[ep, name] = prefill(runner, pool, ps, ctx)
        for _ in range(args.rounds):  # interleaved rounds spread a busy host's noise evenly
            for b in sizes:
                for name in ROUTINGS:
                    for ep, runner in runners.items():
                        key = (ep, name, b)
                        ts, cpu, cs = time_decode(
                            runner, work[ep, name], b, args.repeats, args.warmup
                        )
                        data.wall.setdefault(key, []).extend(ts)
                        data.cpu.setdefault(key, []).append(cpu)
                        data.counts[key] = cs
        grid = np.unique(np.geomspace(1, 2 * max_reqs * arch.num_experts_per_tok, 16).astype(int))
        load_pairs = [0, *grid.tolist()]
        load_secs = expert_seconds(runners[n], load_pairs, 2 * args.repeats)
    finally:
        for r in runners.values():
            r.close()
    return data, load_pairs, load_secs, arch


def view(
    step: dict[tuple[int, str, int], float],
    data: Samples,
    arch: Any,
    n: int,
    sizes: list[int],
    load: Curve,
) -> dict[str, Any]:
    """Calibrate T(B) = table(B) + θ_moe(E[max rank load]) on the calibration set, then predict
    the balanced and skewed sets with their measured popularity (EP-aware) or the calibration's."""
    b, k = np.asarray(sizes), arch.num_experts_per_tok
    big = b >= min(LARGE_B, int(b.max()))

    def popularity(name: str) -> tuple[float, ...]:
        c = np.sum([data.counts[n, name, x] for x in sizes], axis=0).astype(np.float64)
        return tuple((c / c.sum()).tolist())

    pops = {name: popularity(name) for name in ROUTINGS}
    term = ExpertParallelTerm(arch.num_experts, k, n, load, popularity=pops["calibration"])
    cal = np.array([step[n, "calibration", x] for x in sizes])
    model = CapacityModel(fit_table(b, cal - term.seconds(b), sizes), term)
    out: dict[str, Any] = {"calibration_ms": _ms(cal), "capacity_model": model.to_dict()}
    for name in ("balanced", "skewed"):
        meas = np.array([step[n, name, x] for x in sizes])
        aware = replace(model, moe=replace(term, popularity=pops[name]))
        pred_aware, pred_blind = aware.step_seconds(b, b), model.step_seconds(b, b)
        out[name] = {
            "ep1_ms": _ms(np.array([step[1, name, x] for x in sizes])),
            "measured_ms": _ms(meas),
            "predicted_ep_aware_ms": _ms(pred_aware),
            "predicted_ep_blind_ms": _ms(pred_blind),
            "mape_ep_aware": round(mape(pred_aware, meas), 4),
            "mape_ep_blind": round(mape(pred_blind, meas), 4),
            "mape_ep_aware_large_b": round(mape(pred_aware[big], meas[big]), 4),
            "mape_ep_blind_large_b": round(mape(pred_blind[big], meas[big]), 4),
        }
    return out


def _ms(x: np.ndarray) -> list[float]:
    return (np.asarray(x) * 1e3).round(3).tolist()


def _per_rank(per_expert: list[int] | tuple[float, ...], n: int) -> list[float]:
    m = len(per_expert) // n
    return [float(sum(per_expert[r * m : (r + 1) * m])) for r in range(n)]


def report(
    args: argparse.Namespace,
    argv: list[str],
    data: Samples,
    load_pairs: list[int],
    load_secs: list[float],
    arch: Any,
    load_average: list[float],
) -> dict[str, Any]:
    n, sizes, k = args.ep_size, list(args.batch_sizes), arch.num_experts_per_tok
    wall = {key: float(np.percentile(v, WALL_Q)) for key, v in data.wall.items()}
    crit = {key: float(np.median([c.max() for c in v])) for key, v in data.cpu.items()}
    total = {key: float(np.median([c.sum() for c in v])) for key, v in data.cpu.items()}
    load = Curve(tuple(float(x) for x in load_pairs), tuple(load_secs))
    routing: dict[str, Any] = {}
    for name in ("calibration", "balanced", "skewed"):
        c = np.sum([data.counts[n, name, x] for x in sizes], axis=0).astype(np.float64)
        pop = c / c.sum()
        term = ExpertParallelTerm(arch.num_experts, k, n, load, popularity=tuple(pop.tolist()))
        routing[name] = {
            "popularity": pop.round(4).tolist(),
            "rank_shares": np.round(_per_rank(tuple(pop.tolist()), n), 4).tolist(),
            "busiest_rank_share_measured": [
                round(max(r) / sum(r), 4)
                for r in (_per_rank(data.counts[n, name, x], n) for x in sizes)
            ],
            "busiest_rank_share_expected": [
                round(float(term.max_loads(x)[x]) / (x * k), 4) for x in sizes
            ],
        }
    return {
        "tool": "dspark_sglang.profile --ep-size",
        "command": shlex.join(["python", "-m", "dspark_sglang.profile", *argv]),
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "hardware": {
            "cpu": cpu_model(),
            "num_cpus": os.cpu_count(),
            "num_threads_per_rank": torch.get_num_threads(),
            "load_average_1m": [round(x, 2) for x in load_average],
        },
        "torch": torch.__version__,
        "ep_size": n,
        "batch_sizes": sizes,
        "context_len": args.context_len[0],
        "samples_per_point": args.rounds * args.repeats,
        "load_curve": {"pairs_per_layer": load_pairs, "cpu_seconds": load_secs},
        "routing": routing,
        "cpu_total_ms": {
            f"ep{ep}_{name}": _ms(np.array([total[ep, name, x] for x in sizes]))
            for ep in (1, n)
            for name in ("balanced", "skewed")
        },
        "critical_path": view(crit, data, arch, n, sizes, load),
        f"wall_p{WALL_Q}": view(wall, data, arch, n, sizes, load),
    }


def format_report(rep: dict[str, Any]) -> str:
    n, hw = rep["ep_size"], rep["hardware"]
    lines = [
        f"EP={n} vs EP=1: decode steps (R = B), context {rep['context_len']}, "
        f"{rep['samples_per_point']} samples per point; host load average {hw['load_average_1m']}"
        f" on {hw['num_cpus']} CPUs",
    ]
    for key, title in (
        ("critical_path", "critical path = busiest rank's CPU ms per step"),
        (f"wall_p{WALL_Q}", f"wall ms per step (p{WALL_Q})"),
    ):
        v = rep[key]
        bal, skew = v["balanced"], v["skewed"]
        lines += [
            title,
            f"{'B':>5}{'EP1 bal':>9}{f'EP{n} bal':>9}{'pred':>8}{'EP1 skew':>10}"
            f"{f'EP{n} skew':>10}{'aware':>8}{'blind':>8}",
        ]
        for i, b in enumerate(rep["batch_sizes"]):
            lines.append(
                f"{b:>5}{bal['ep1_ms'][i]:>9.2f}{bal['measured_ms'][i]:>9.2f}"
                f"{bal['predicted_ep_aware_ms'][i]:>8.2f}{skew['ep1_ms'][i]:>10.2f}"
                f"{skew['measured_ms'][i]:>10.2f}{skew['predicted_ep_aware_ms'][i]:>8.2f}"
                f"{skew['predicted_ep_blind_ms'][i]:>8.2f}"
            )
        lines.append(
            f"  MAPE EP-aware / EP-blind: balanced {bal['mape_ep_aware']:.1%} / "
            f"{bal['mape_ep_blind']:.1%}, skewed {skew['mape_ep_aware']:.1%} / "
            f"{skew['mape_ep_blind']:.1%}; B >= {LARGE_B}: balanced "
            f"{bal['mape_ep_aware_large_b']:.1%} / {bal['mape_ep_blind_large_b']:.1%}, skewed "
            f"{skew['mape_ep_aware_large_b']:.1%} / {skew['mape_ep_blind_large_b']:.1%}"
        )
    for name in ("balanced", "skewed"):
        r = rep["routing"][name]
        lines.append(
            f"{name:<9} rank shares {r['rank_shares']}, busiest rank share measured "
            f"{r['busiest_rank_share_measured'][-1]} vs expected "
            f"{r['busiest_rank_share_expected'][-1]} at B={rep['batch_sizes'][-1]}"
        )
    return "\n".join(lines)


def plot(rep: dict[str, Any], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    n, b = rep["ep_size"], np.asarray(rep["batch_sizes"])
    keys = ("critical_path", f"wall_p{WALL_Q}")
    titles = ("busiest rank's CPU ms per step", f"wall ms per step (p{WALL_Q}, shared host)")
    fig, ax = plt.subplots(2, 2, figsize=(12, 8.5))
    for col, (key, title) in enumerate(zip(keys, titles, strict=True)):
        v = rep[key]
        top, bottom = ax[0][col], ax[1][col]
        for name, mk in (("balanced", "o"), ("skewed", "s")):
            top.plot(b, v[name]["ep1_ms"], mk + "--", label=f"EP=1 {name}")
            top.plot(b, v[name]["measured_ms"], mk + "-", label=f"EP={n} {name}")
        top.set(xscale="log", yscale="log", xlabel="B (decode tokens = requests)", ylabel="ms")
        top.set_title(title)
        top.legend(fontsize=8)
        bal, skew = v["balanced"], v["skewed"]
        ratio = lambda k: np.asarray(skew[k]) / np.asarray(bal[k])  # noqa: B023
        bottom.plot(b, ratio("measured_ms"), "ks", label="measured")
        bottom.plot(b, ratio("predicted_ep_aware_ms"), "-", label="EP-aware model")
        bottom.plot(b, np.ones(b.size), ":", label="EP-blind model (1.0)")
        bottom.set(xscale="log", xlabel="B", ylabel=f"EP={n} step: skewed / balanced")
        bottom.set_title(
            f"MAPE aware/blind: balanced {bal['mape_ep_aware']:.0%}/{bal['mape_ep_blind']:.0%}, "
            f"skewed {skew['mape_ep_aware']:.0%}/{skew['mape_ep_blind']:.0%} "
            f"(B>={LARGE_B}: {skew['mape_ep_aware_large_b']:.0%}/"
            f"{skew['mape_ep_blind_large_b']:.0%})",
            fontsize=9,
        )
        bottom.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main(args: argparse.Namespace, argv: list[str], write_model: Any) -> int:
    load_average = [os.getloadavg()[0]]
    with tempfile.TemporaryDirectory(prefix="dspark-ep-") as tmp:
        path = args.model_path
        if path is None:
            write_model(Path(tmp))
            path = tmp
        data, load_pairs, load_secs, arch = run(args, path)
    load_average.append(os.getloadavg()[0])
    rep = report(args, argv, data, load_pairs, load_secs, arch, load_average)
    line = json.dumps(rep)
    if args.output is not None:
        Path(args.output).write_text(line + "\n")
    if args.plot is not None:
        plot(rep, args.plot)
    print(line if args.json else format_report(rep))
    return 0
