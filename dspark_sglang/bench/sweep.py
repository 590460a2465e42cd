"""`python -m dspark_sglang.bench.sweep`: Pareto sweeps of the live CPU deployment (Figs. 7-8).

Starts `launch_server --role all` once per policy, drives it with `bench.serving` at each
concurrency, and writes CSV + PNG + JSON under docs/results/ with the goal ratios printed.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shlex
import signal
import statistics
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Iterator, Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from dspark_sglang.bench import host_speed, hostcpu, serving, steps, verdict
from dspark_sglang.bench.pareto import (
    frontier,
    matched_speedups,
    plot_load,
    plot_pareto,
    throughput_at_sla,
    write_csv,
)
from dspark_sglang.hostinfo import cpu_model, host_facts

ROOT = Path(__file__).resolve().parents[2]
POLICIES = ("no-spec", "mtp1", "fixed:3", "verify-all", "sync", "lagged")
CONCURRENCY = (1, 2, 4, 8, 16, 32, 64)
QUICK = {"policies": ("no-spec", "fixed:3", "lagged"), "concurrency": (1, 4, 16)}
FIXED = ("mtp1", "verify-all")  # plus every fixed:N


def base_policy(label: str) -> str:
    """`POLICY@VARIANT` -> POLICY: a variant is its base policy with the flags --variant names."""
    return label.partition("@")[0]


def parse_variants(specs: Sequence[str]) -> dict[str, list[str]]:
    """--variant NAME='--flag value ...' -> {NAME: flags}; ValueError naming --variant."""
    out: dict[str, list[str]] = {}
    for spec in specs:
        name, sep, flags = spec.partition("=")
        if not sep or not name or "@" in name or "," in name:
            raise ValueError(
                f"--variant {spec!r}: expected NAME='--flag ...' (NAME without @ or ,)"
            )
        if name in out:
            raise ValueError(f"--variant {name!r} given twice")
        out[name] = shlex.split(flags)
    return out


def check_policies(
    policies: Sequence[str], variants: dict[str, list[str]], need_flags: bool = True
) -> None:
    """No label repeats and, when servers will start (`need_flags`), every `POLICY@VARIANT`
    label names a --variant; ValueError."""
    if len(set(policies)) != len(policies):
        raise ValueError(f"--policies {','.join(policies)}: a policy is listed twice")
    for label in policies:
        base, at, name = label.partition("@")
        if not base:
            raise ValueError(f"--policies: {label!r} has no policy before @")
        if at and need_flags and name not in variants:
            raise ValueError(f"--policies: {label!r} names variant {name!r}, no --variant {name}=")


def server_command(args: argparse.Namespace, label: str, slot: int = 0) -> list[str]:
    """`slot` i serves on port + i and zmq-port + 10·i (interleaved sweeps run one per policy).
    A label `POLICY@VARIANT` starts POLICY with the variant's flags last (they win)."""
    policy, _, variant = label.partition("@")
    port, zmq_port = args.port + slot, args.zmq_port + 10 * slot
    cmd = [sys.executable, "-m", "dspark_sglang.launch_server", "--role", "all"]
    cmd += ["--host", "127.0.0.1", "--port", str(port), "--zmq-port", str(zmq_port)]
    if args.model_path:
        cmd += ["--model-path", args.model_path]
    if policy == "no-spec":
        cmd += ["--speculative-algorithm", "none"]
    else:
        if args.draft_model_path:
            cmd += ["--draft-model-path", args.draft_model_path]
        cmd += ["--schedule-mode", policy]
        if policy.split(":")[0] in ("lagged", "sync"):
            if args.capacity_profile:
                cmd += ["--capacity-profile", args.capacity_profile]
            else:
                cmd += ["--startup-profile-seconds", str(args.startup_profile_seconds)]
    cmd += ["--max-running-requests", str(max(args.concurrency))]
    if args.step_logs:
        cmd += ["--step-log", str(args.step_logs / label)]
    # {policy} lets per-deployment outputs (--step-log DIR) go to one folder per policy
    cmd += shlex.split(args.server_args.replace("{policy}", label))
    return cmd + (parse_variants(args.variant)[variant] if variant else [])


class Server:
    """One `--role all` deployment in its own process group; SIGTERM on exit."""

    def __init__(self, cmd: list[str], url: str, log_path: Path, timeout: float) -> None:
        self.cmd, self.url, self.log_path, self.timeout = cmd, url, log_path, timeout
        self.proc: subprocess.Popen[bytes] | None = None

    def __enter__(self) -> Server:
        env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
        self.log = self.log_path.open("ab")
        self.log.write(f"\n$ {shlex.join(self.cmd)}\n".encode())
        self.log.flush()
        self.proc = subprocess.Popen(
            self.cmd, stdout=self.log, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
        deadline = time.monotonic() + self.timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"server exited with {self.proc.returncode}; see {self.log_path}"
                )
            try:
                with urllib.request.urlopen(f"{self.url}/ready", timeout=2) as r:
                    if r.status == 200:
                        return self
            except OSError:
                pass
            time.sleep(1.0)
        self.__exit__(None, None, None)
        raise RuntimeError(f"server not ready after {self.timeout:.0f}s; see {self.log_path}")

    @property
    def pid(self) -> int:
        """The deployment's root process (its API process; the workers are its children)."""
        assert self.proc is not None
        return self.proc.pid

    def __exit__(self, *exc: object) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self.log.close()


def bench_args(args: argparse.Namespace, policy: str, c: int, slot: int = 0) -> argparse.Namespace:
    n = max(args.prompts_per_concurrency * c, args.min_prompts)
    argv = [
        "--base-url", f"http://127.0.0.1:{args.port + slot}",
        "--num-prompts", str(n),
        "--max-concurrency", str(c),
        "--output-len", str(args.output_len),
        "--output-len-range-ratio", str(args.output_len_range_ratio),
        "--temperature", str(args.temperature),
        "--warmup-requests", str(args.warmup_requests),
        "--seed", str(args.seed),
        "--disable-tqdm",
        "--metadata", f"policy={policy}", f"concurrency={c}",
    ]  # fmt: skip
    if args.dataset_path:
        argv += ["--dataset-path", str(args.dataset_path), "--backend", "oai-chat"]
    if args.ignore_eos:
        argv.append("--ignore-eos")
    if args.slo:
        argv += ["--slo", *args.slo]
    return serving.parse_args(argv)


def is_rival(policy: str) -> bool:
    """No-spec and the fixed policies, as given (a variant of one is not the one the goal names)."""
    if "@" in policy:
        return False
    return policy == "no-spec" or policy in FIXED or policy.startswith("fixed:")


def variant_ratios(
    raw: Sequence[dict[str, Any]], key: str = "output_throughput"
) -> dict[str, dict[int, list[float]]]:
    """Per `POLICY@VARIANT` label and c: its throughput over POLICY's within each pass (a same-run
    A/B of the variant's flags)."""
    by: dict[tuple[int, int], dict[str, float]] = {}
    for r in raw:
        if r.get(key) is not None:
            by.setdefault((r["concurrency"], r.get("pass", 0)), {})[r["policy"]] = r[key]
    out: dict[str, dict[int, list[float]]] = {}
    for (c, _), tps in sorted(by.items()):
        for label, v in tps.items():
            base = base_policy(label)
            if base != label and tps.get(base, 0.0) > 0:
                out.setdefault(label, {}).setdefault(c, []).append(v / tps[base])
    return out


def paired_ratios(
    raw: Sequence[dict[str, Any]], key: str = "output_throughput"
) -> dict[int, list[float]]:
    """Per c, lagged / best rival within each pass: rivals measured seconds apart (interleaved),
    so the host's slow drift between passes cancels in each ratio; their spread says how far
    the ratio of medians can be trusted."""
    by: dict[tuple[int, int], dict[str, float]] = {}
    for r in raw:
        if r.get(key) is not None:
            by.setdefault((r["concurrency"], r.get("pass", 0)), {})[r["policy"]] = r[key]
    out: dict[int, list[float]] = {}
    for (c, _), tps in sorted(by.items()):
        rivals = [v for p, v in tps.items() if is_rival(p) and v > 0]
        if "lagged" in tps and rivals:
            out.setdefault(c, []).append(tps["lagged"] / max(rivals))
    return out


def goal_rows(
    rows: list[dict[str, Any]],
    policies: Sequence[str],
    raw: Sequence[dict[str, Any]] = (),
    key: str = "output_throughput",
) -> list[dict[str, Any]]:
    """Per c: lagged against the best of no-spec and the fixed policies on `key` (the
    whole-run throughput, or the steady window's), with the per-pass paired ratios."""
    by = {(r["policy"], r["concurrency"]): r for r in rows}
    paired = paired_ratios(raw, key)
    out = []
    for c in sorted({r["concurrency"] for r in rows}):
        lag = by.get(("lagged", c))
        rivals = [
            by[(p, c)]
            for p in policies
            if (p, c) in by and is_rival(p) and (by[(p, c)].get(key) or 0.0) > 0.0
        ]
        if lag is None or lag.get(key) is None or not rivals:
            continue
        best = max(rivals, key=lambda r: r[key])
        ratio = lag[key] / best[key]
        x = {
            "concurrency": c,
            "lagged": lag[key],
            "best_rival": best["policy"],
            "best_rival_throughput": best[key],
            "ratio": ratio,
            "pass": ratio >= 0.97,
            "lagged_budget": lag.get("verify_tokens_per_request"),
        }
        if c in paired:
            pr = paired[c]
            x |= {
                "paired_ratios": pr,
                "paired_median": float(statistics.median(pr)),
                "paired_passes_ge_0.97": sum(v >= 0.97 for v in pr),
            }
        out.append(x)
    return out


def analyse(
    rows: list[dict[str, Any]],
    policies: Sequence[str],
    sla: Sequence[float],
    raw: Sequence[dict[str, Any]] = (),
) -> dict:
    """Goal ratios of issue 9 from one sweep's rows (and, given the raw per-pass records, the
    per-pass paired ratios beside the ratio of medians)."""
    pts = {
        p: [(r["mean_tps_per_user"], r["output_throughput"]) for r in rows if r["policy"] == p]
        for p in policies
    }
    fronts = {p: frontier(v) for p, v in pts.items() if v}
    out: dict[str, Any] = {"per_concurrency": goal_rows(rows, policies, raw)}
    if out["per_concurrency"]:
        out["lagged_ge_best_minus_3pct_every_c"] = all(x["pass"] for x in out["per_concurrency"])
    # The same goal on the steady window (bench/serving.py steady_window): throughput while
    # exactly c requests were in flight, without the lock-step first wave and the drain.
    # A c without a steady window (too short to be a rate) is not a pass: "every c" holds only
    # when every c of the whole-run table has one.
    steady = goal_rows(rows, policies, raw, "steady_output_throughput")
    if steady:
        out["steady_per_concurrency"] = steady
        out["steady_lagged_ge_best_minus_3pct_every_c"] = len(steady) == len(
            out["per_concurrency"]
        ) and all(x["pass"] for x in steady)
    if "no-spec" in fronts:
        for p in policies:
            if p != "no-spec" and p in fronts:
                m = matched_speedups(fronts["no-spec"], fronts[p])
                out.setdefault("matched_throughput_speedup_vs_nospec", {})[p] = m
        m = out.get("matched_throughput_speedup_vs_nospec", {}).get("lagged")
        if m:
            out["lagged_matched_speedup_min"] = min(x["speedup"] for x in m)
            out["lagged_matched_speedup_max"] = max(x["speedup"] for x in m)
            out["lagged_matched_speedup_ge_1.6"] = min(x["speedup"] for x in m) >= 1.6
    ab = variant_ratios(raw)
    if ab:
        out["variant_vs_base"] = {
            label: {
                str(c): {"paired_ratios": v, "paired_median": float(statistics.median(v))}
                for c, v in per_c.items()
            }
            for label, per_c in ab.items()
        }
    # How far the verdict above can be trusted on this host (bench/verdict.py): the per-pass
    # noise, an interval for lagged / best rival, and the verdict's pass rate for a tie.
    noise = verdict.summary(raw, is_rival) if raw else {}
    if noise:
        out["noise"] = noise
    if any(r.get(ADJUSTED) for r in raw):
        out["host_adjusted"] = host_adjusted(rows, policies, raw)
    cells = cell_seconds(raw)
    if cells:
        out["cell_seconds"] = {str(c): x for c, x in cells.items()}
    host = host_cpu(raw)
    if host:
        out["host_cpu"] = host
    anchors: dict[str, Any] = {}
    for a in sla:
        anchors[str(a)] = {p: throughput_at_sla(f, a) for p, f in fronts.items()}
    out["throughput_at_sla"] = anchors
    return out


ADJUSTED = host_speed.ADJUSTED
HOST_SPEED_FIELDS = (
    "policy",
    "concurrency",
    "pass",
    "output_throughput",
    "host_speed_factor",
    "host_speed_steps",
    ADJUSTED,
)


def host_adjusted(
    rows: list[dict[str, Any]], policies: Sequence[str], raw: Sequence[dict[str, Any]]
) -> dict[str, Any]:
    """The goal again on throughputs scaled to each deployment's usual host speed
    (bench.host_speed), its noise, and how far the per-pass ratio of each pair of policies
    scattered before and after the scaling: the scaling is worth reading only where it
    narrowed those."""
    out: dict[str, Any] = {"per_concurrency": goal_rows(rows, policies, raw, ADJUSTED)}
    if out["per_concurrency"]:
        out["lagged_ge_best_minus_3pct_every_c"] = all(x["pass"] for x in out["per_concurrency"])
    noise = verdict.summary(raw, is_rival, key=ADJUSTED)
    if noise:
        out["noise"] = noise
    spread = []
    for i, a in enumerate(policies):
        for b in policies[i + 1 :]:
            before = host_speed.log_spread(raw, "output_throughput", a, b)
            after = host_speed.log_spread(raw, ADJUSTED, a, b)
            if before is not None and after is not None:
                spread.append({"a": a, "b": b, "measured": before, "adjusted": after})
    out["pair_log_spread"] = spread
    factors = [r["host_speed_factor"] for r in raw if r.get("host_speed_factor")]
    out["cells"] = len(raw)
    out["cells_with_factor"] = len(factors)
    if factors:
        out["factor_min"], out["factor_max"] = min(factors), max(factors)
    return out


HOST_KEYS = ("host_steal", "host_idle", "measured_deployment", "other_deployments", "client")


def host_cpu(raw: Sequence[dict[str, Any]]) -> dict[str, dict[str, float]]:
    """Per policy, over its measured windows: the median and the largest of each `cpu_*` figure
    (cores; bench.hostcpu). Empty when the records carry none (not Linux, or older files)."""
    by: dict[str, dict[str, list[float]]] = {}
    for r in raw:
        for k in HOST_KEYS:
            v = r.get(f"cpu_{k}")
            if v is not None:
                by.setdefault(r["policy"], {}).setdefault(k, []).append(float(v))
    return {
        p: {
            **{k: float(statistics.median(v)) for k, v in per.items()},
            **{f"{k}_max": max(v) for k, v in per.items()},
        }
        for p, per in by.items()
    }


# A cell shorter than this is a few of the host's slow spells long: on the 2-vCPU VM of session
# 60 the same c = 2 and 4 cells gave a per-pass noise sd of 0.126 (log tok/s) at 5-7 s a cell
# (`s60_lo`) and 0.046 at 15-30 s (`s60_lolong`, four times the prompts).
SHORT_CELL_S = 10.0


def cell_seconds(raw: Sequence[dict[str, Any]]) -> dict[int, dict[str, float]]:
    """Per c: the median and the shortest `duration` (seconds) of its measured cells, over
    policies and passes. Empty when the records carry no duration."""
    by: dict[int, list[float]] = {}
    for r in raw:
        d = r.get("duration")
        if isinstance(d, int | float) and d > 0.0:
            by.setdefault(int(r["concurrency"]), []).append(float(d))
    return {
        c: {"median": float(statistics.median(v)), "shortest": min(v)}
        for c, v in sorted(by.items())
    }


def _print_cell_seconds(cells: dict[int, dict[str, float]]) -> None:
    print(
        "\ncell length, seconds (median / shortest): "
        + ", ".join(f"c={c} {x['median']:.1f} / {x['shortest']:.1f}" for c, x in cells.items())
    )
    short = [c for c, x in cells.items() if x["median"] < SHORT_CELL_S]
    if short:
        print(
            f"  c={', '.join(map(str, short))}: cells under {SHORT_CELL_S:.0f} s, where one slow "
            "spell of a shared host moves a cell; more prompts a cell (--min-prompts, "
            '--prompts-per-concurrency) narrow the verdict (docs/bench.md "Cell length")'
        )


def print_report(rows: list[dict[str, Any]], policies: Sequence[str], goals: dict) -> None:
    concs = sorted({r["concurrency"] for r in rows})
    by = {(r["policy"], r["concurrency"]): r for r in rows}
    print("\noutput tok/s (per-user tok/s) [verify tokens/req]")
    print(f"{'policy':<12s}" + "".join(f"{'c=' + str(c):>22s}" for c in concs))
    for p in policies:
        line = f"{p:<12s}"
        for c in concs:
            r = by.get((p, c))
            b = r.get("verify_tokens_per_request") if r else None
            line += (
                f"{r['output_throughput']:9.1f} ({r['mean_tps_per_user']:5.1f}) "
                f"[{'-' if b is None else f'{b:.1f}'}]"
                if r
                else f"{'-':>22s}"
            )
        print(line)
    for title, k in (("whole run", "per_concurrency"), ("steady window", "steady_per_concurrency")):
        if goals.get(k):
            _print_goal(title, goals[k])
    if goals.get("steady_per_concurrency"):
        have = {x["concurrency"] for x in goals["steady_per_concurrency"]}
        none = [x["concurrency"] for x in goals["per_concurrency"] if x["concurrency"] not in have]
        if none:
            print(f"  c={', '.join(map(str, none))}: no steady window (too short to be a rate)")
    if goals.get("cell_seconds"):
        _print_cell_seconds({int(c): x for c, x in goals["cell_seconds"].items()})
    if goals.get("noise"):
        print()
        verdict.print_summary(goals["noise"], "whole run:")
    adj = goals.get("host_adjusted")
    if adj:
        print(
            f"\nhost speed per cell (bench.host_speed): {adj['cells_with_factor']} of "
            f"{adj['cells']} cells have a factor"
            + (
                f", {adj['factor_min']:.2f}-{adj['factor_max']:.2f}x its deployment's usual forward"
                if "factor_min" in adj
                else ""
            )
        )
        for x in adj["pair_log_spread"]:
            print(
                f"  per-pass log({x['a']} / {x['b']}) scatter: measured {x['measured']:.3f}, "
                f"adjusted {x['adjusted']:.3f}"
            )
        if adj["per_concurrency"]:
            _print_goal(
                "whole run, scaled to each deployment's usual host speed", adj["per_concurrency"]
            )
        if adj.get("noise"):
            verdict.print_summary(adj["noise"], "adjusted:")
    if goals.get("host_cpu"):
        print("\nhost CPU during each policy's runs, cores (median / largest):")
        for p, h in goals["host_cpu"].items():
            print(
                f"  {p:<12s} "
                + "  ".join(f"{k} {h[k]:.2f}/{h[k + '_max']:.2f}" for k in HOST_KEYS if k in h)
            )
    for label, per_c in goals.get("variant_vs_base", {}).items():
        s = ", ".join(
            f"c={c} {x['paired_median']:.3f} ({' / '.join(f'{v:.3f}' for v in x['paired_ratios'])})"
            for c, x in per_c.items()
        )
        print(f"{label} / {base_policy(label)} per pass, median (each pass): {s}")
    for p, m in goals.get("matched_throughput_speedup_vs_nospec", {}).items():
        s = ", ".join(f"{x['throughput']:.0f} tok/s: {x['speedup']:.2f}x" for x in m)
        print(f"per-user speed-up vs no-spec at matched throughput, {p}: {s or '-'}")
    for a, d in goals["throughput_at_sla"].items():
        s = ", ".join(f"{p} {'-' if v is None else f'{v:.0f}'}" for p, v in d.items())
        print(f"throughput at SLA {a} tok/s/user: {s}")


def _print_goal(title: str, per_c: list[dict[str, Any]]) -> None:
    print(f"\nlagged vs max(no-spec, fixed policies) per concurrency, {title}:")
    for x in per_c:
        print(
            f"  c={x['concurrency']:<3d} lagged {x['lagged']:8.1f}  best {x['best_rival']:<10s} "
            f"{x['best_rival_throughput']:8.1f}  ratio {x['ratio']:.3f} "
            f"{'PASS' if x['pass'] else 'MISS'}"
            + (
                f"  per pass {' / '.join(f'{v:.3f}' for v in x['paired_ratios'])}"
                f" (median {x['paired_median']:.3f})"
                if "paired_ratios" in x
                else ""
            )
        )


def measure(
    args: argparse.Namespace,
    policy: str,
    c: int,
    pass_no: int,
    jsonl: Path,
    slot: int = 0,
    groups: dict[str, int] | None = None,
) -> dict[str, Any]:
    """One bench.serving run against `policy`'s deployment. `groups`: each running
    deployment's pid by label (the root of its process tree); the record then carries where the
    host's CPU went during the run (`cpu_*`, in cores; bench.hostcpu): the measured deployment,
    the others, and the client (this process and its children outside every deployment)."""
    before = hostcpu.read() if groups else None
    start = time.time()  # the cell's window in the step logs' clock (bench.host_speed)
    rec = serving.run(bench_args(args, policy, c, slot))
    rec |= {"policy": policy, "concurrency": c, "pass": pass_no, "host_cpu": cpu_model()}
    rec |= {"cell_start": start, "cell_end": time.time()}
    after = hostcpu.read() if before is not None else None
    if before is not None and after is not None and groups:
        labels = {
            "measured_deployment": (groups[policy],) if policy in groups else (),
            "other_deployments": tuple(g for p, g in groups.items() if p != policy),
            "everything_here": (os.getpid(),),
        }
        cpu = hostcpu.usage(before, after, labels)
        here = cpu.pop("everything_here")
        deployments = cpu["measured_deployment"] + cpu["other_deployments"]
        cpu["client"] = max(here - deployments, 0.0)
        rec |= {f"cpu_{k}": v for k, v in cpu.items()}
    with jsonl.open("a") as f:
        f.write(json.dumps(rec) + "\n")
    budget = rec.get("verify_tokens_per_request") or float("nan")
    secs = rec.get("duration") or float("nan")
    host = (
        f"  host: steal {rec['cpu_host_steal']:.2f} idle {rec['cpu_host_idle']:.2f} "
        f"other deployments {rec['cpu_other_deployments']:.2f} cores"
        if "cpu_host_steal" in rec
        else ""
    )
    print(
        f"   c={c:<3d} {policy:<10s} {rec['output_throughput']:8.1f} tok/s  "
        f"{rec['mean_tps_per_user']:6.1f} tok/s/user  accept {rec['accept_length']:.2f}"
        f"  budget {budget:.2f}  failed {rec['failed']}  {secs:.1f} s{host}",
        file=sys.stderr,
        flush=True,
    )
    return rec


def run_policy(
    args: argparse.Namespace, policy: str, pass_no: int, jsonl: Path, log_path: Path
) -> list[dict[str, Any]]:
    cmd = server_command(args, policy)
    print(f"== pass {pass_no} {policy}: {shlex.join(cmd)}", file=sys.stderr, flush=True)
    with Server(cmd, f"http://127.0.0.1:{args.port}", log_path, args.ready_timeout) as server:
        groups = {policy: server.pid}
        if args.burn_in:
            burn_in(args, (policy,), pass_no, lambda p: 0)
        return [measure(args, policy, c, pass_no, jsonl, 0, groups) for c in args.concurrency]


def burn_in(
    args: argparse.Namespace, order: Sequence[str], pass_no: int, slot: Callable[[str], int]
) -> None:
    """--burn-in: each deployment serves one untimed run at every concurrency level, in the
    timed cells' order, before any is measured; nothing is kept but a line on stderr. A lagged
    deployment's first visit to a load pays what it learns there (the drafter's price explored
    at each new batch size, young step-kind and capacity corrections; session 56: exploration
    alone was 1-3 % of its decode time at R 17-64 on fresh deployments), and a sweep that starts
    every deployment cold and visits each load once books all of it on the timed cells, where a
    long-running deployment pays it once."""
    for j, c in enumerate(args.concurrency):
        for p in level_order(order, pass_no, j):
            rec = serving.run(bench_args(args, p, c, slot(p)))
            print(
                f"   burn-in c={c:<3d} {p:<10s} {rec['output_throughput']:8.1f} tok/s (not kept)",
                file=sys.stderr,
                flush=True,
            )


def level_order(policies: Sequence[str], pass_no: int, level: int) -> list[str]:
    """The order an interleaved sweep measures the policies in at one (pass, level): rotated by
    one place from level to level and from pass to pass (two policies: from pass to pass only).
    Flipping the order instead ran the last policy of one level first at the next, two cells in
    a row: a slow spell of the host half a minute long then fell on one policy at two levels
    (short_461e3e6, pass 4: lagged's cells at c = 4 and c = 8 ran their forwards 30-50 % slower
    than the cells around them). Rotation leaves every policy n - 1 cells apart from one level
    to the next and puts each in every place equally often over n passes; a pass boundary can
    still repeat one."""
    n = len(policies)
    shift = (pass_no if n == 2 else pass_no + level) % max(n, 1)
    return list(policies[shift:]) + list(policies[:shift])


def run_interleaved(
    args: argparse.Namespace, first: int, jsonl: Path, log_path: Path
) -> list[dict[str, Any]]:
    """Every policy's server up at once (started one after another, so no start-up profile
    shares the CPU), then each concurrency level measured policy after policy, in the order
    `level_order` gives: rivals are measured seconds apart instead of minutes, so the host's drift
    (up to 13 % between passes on the shared 2-core VM) does not land on one policy.

    --fresh-deployments starts every policy's servers anew for each pass (the start order
    rotating with the pass): two deployments of one configuration ran 4-5 % apart here for
    reasons of their own (docs/results/s40_notes.txt), and one deployment per policy for the
    whole sweep books that luck on the policy in every pass; fresh ones spread it over the
    passes, where the verdict's interval sees it."""
    out = []
    passes = range(first, first + args.passes)
    slot = args.policies.index
    if not args.fresh_deployments:
        with deployments(args, args.policies, log_path) as groups:
            if args.burn_in:
                burn_in(args, args.policies, first, slot)
            for k in passes:
                out += measure_pass(args, k, jsonl, groups)
        return out
    for k in passes:
        with deployments(args, level_order(args.policies, k, 0), log_path) as groups:
            if args.burn_in:
                burn_in(args, args.policies, k, slot)
            out += measure_pass(args, k, jsonl, groups)
    return out


@contextlib.contextmanager
def deployments(
    args: argparse.Namespace, order: Sequence[str], log_path: Path
) -> Iterator[dict[str, int]]:
    """Each policy's server, started in `order` on its own slot (its place in --policies, so a
    policy keeps its ports across restarts) -> each deployment's root pid by label."""
    groups: dict[str, int] = {}
    with contextlib.ExitStack() as stack:
        for policy in order:
            i = args.policies.index(policy)
            cmd = server_command(args, policy, i)
            print(f"== server {i} {policy}: {shlex.join(cmd)}", file=sys.stderr, flush=True)
            url = f"http://127.0.0.1:{args.port + i}"
            server = stack.enter_context(Server(cmd, url, log_path, args.ready_timeout))
            groups[policy] = server.pid
        yield groups


def measure_pass(
    args: argparse.Namespace, k: int, jsonl: Path, groups: dict[str, int]
) -> list[dict[str, Any]]:
    print(f"== pass {k}", file=sys.stderr, flush=True)
    out = []
    for j, c in enumerate(args.concurrency):
        order = level_order(args.policies, k, j)
        out += [measure(args, p, c, k, jsonl, args.policies.index(p), groups) for p in order]
    return out


MEDIAN_KEYS = (
    "output_throughput",
    "steady_output_throughput",
    "mean_tps_per_user",
    "median_tps_per_user",
    "accept_length",
    "verify_tokens_per_request",
    "mean_verify_budget_k",
    "mean_ttft_ms",
    "mean_tpot_ms",
    "p99_tpot_ms",
    "request_goodput",
    "server_step_ms",
    "cpu_host_steal",
    "cpu_host_idle",
    "cpu_other_deployments",
    "host_speed_factor",
    "host_adjusted_output_throughput",
)


def aggregate(raw: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per (policy, c): the median over passes of the headline keys, the pass count and
    the per-pass throughputs (their spread is the machine's noise)."""
    groups: dict[tuple[str, int], list[dict[str, Any]]] = {}
    for r in raw:
        groups.setdefault((r["policy"], r["concurrency"]), []).append(r)
    out = []
    for (p, c), rs in groups.items():
        row: dict[str, Any] = {"policy": p, "concurrency": c, "passes": len(rs)}
        for k in MEDIAN_KEYS:
            vals = [r[k] for r in rs if r.get(k) is not None]
            row[k] = float(statistics.median(vals)) if vals else None
        row["output_throughput_passes"] = ";".join(f"{r['output_throughput']:.1f}" for r in rs)
        row["failed"] = sum(r.get("failed", 0) for r in rs)
        out.append(row)
    return out


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="python -m dspark_sglang.bench.sweep",
        description=__doc__,
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    ap.add_argument("--model-path", help="target (default: the bundled tiny model)")
    ap.add_argument("--draft-model-path", help="drafter (default: the bundled DSpark drafter)")
    ap.add_argument(
        "--policies",
        type=lambda s: tuple(s.split(",")),
        default=None,
        help=f"default {','.join(POLICIES)}",
    )
    ap.add_argument(
        "--concurrency",
        type=lambda s: tuple(int(x) for x in s.split(",")),
        default=None,
        help=f"default {','.join(map(str, CONCURRENCY))}",
    )
    ap.add_argument(
        "--quick",
        action="store_true",
        help=f"smoke: {QUICK['policies']} at c={QUICK['concurrency']}, few prompts",
    )
    ap.add_argument("--prompts-per-concurrency", type=int, default=3)
    ap.add_argument("--min-prompts", type=int, default=12)
    ap.add_argument("--warmup-requests", type=int, default=2)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument(
        "--output-len-range-ratio",
        type=float,
        default=1.0,
        help="max_tokens per request uniform in [output-len*ratio, output-len] (bench.serving)",
    )
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--ignore-eos", action=argparse.BooleanOptionalAction, default=True)
    ap.add_argument("--dataset-path", type=Path, help="jsonl turns (sent as chat)")
    ap.add_argument("--slo", nargs="+", default=None, metavar="KEY:MS")
    ap.add_argument(
        "--sla",
        type=lambda s: tuple(float(x) for x in s.split(",")),
        default=(20.0, 40.0),
        help="per-user tok/s anchors",
    )
    ap.add_argument("--capacity-profile", help="engine profile for lagged/sync (else start-up)")
    ap.add_argument("--startup-profile-seconds", type=float, default=20.0)
    ap.add_argument(
        "--server-args",
        default="",
        help="extra launch_server flags ({policy} becomes the deployment's policy); "
        "pass as --server-args='--flag ...'",
    )
    ap.add_argument(
        "--step-logs",
        type=Path,
        metavar="DIR",
        help="each deployment writes its per-step records to DIR/<policy> (launch_server "
        "--step-log), and the sweep ends with their per-batch-size report "
        "(bench.steps) in OUT_DIR/NAME_steps.{csv,json}",
    )
    ap.add_argument(
        "--variant",
        action="append",
        default=[],
        metavar="NAME='--flag ...'",
        help="launch_server flags a policy label POLICY@NAME adds to POLICY's, e.g. --policies "
        "lagged,lagged@noexp --variant noexp='--explore-ratio 0': a same-run A/B (reported as "
        "the per-pass ratio to POLICY); the goal ratios read the plain policies only",
    )
    ap.add_argument("--port", type=int, default=30400)
    ap.add_argument("--zmq-port", type=int, default=30500)
    ap.add_argument("--ready-timeout", type=float, default=300.0)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--out-dir", type=Path, default=ROOT / "docs" / "results")
    ap.add_argument("--name", default="sweep")
    ap.add_argument(
        "--interleave",
        action="store_true",
        help="start every policy's server up front and measure each concurrency level policy "
        "after policy (rivals seconds apart; needs memory for all servers at once)",
    )
    ap.add_argument(
        "--fresh-deployments",
        action="store_true",
        help="with --interleave: start every policy's server anew for each pass (a deployment's "
        "own speed then varies between passes instead of staying with the policy)",
    )
    ap.add_argument(
        "--burn-in",
        action="store_true",
        help="before its timed cells each deployment serves one untimed run at every "
        "concurrency level (with --fresh-deployments: every pass's deployments), so the cells "
        "measure engines that have served every load once, as a long-running one has",
    )
    ap.add_argument(
        "--passes",
        type=int,
        default=1,
        help="repeat the sweep (odd passes run the policies in reverse); per-point medians",
    )
    ap.add_argument(
        "--append", action="store_true", help="add passes to OUT_DIR/NAME.jsonl, keep the old"
    )
    ap.add_argument(
        "--replot", action="store_true", help="only re-analyse and re-plot OUT_DIR/NAME.jsonl"
    )
    return ap  # fmt: skip


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    if args.quick:
        args.policies = args.policies or QUICK["policies"]
        args.concurrency = args.concurrency or QUICK["concurrency"]
        args.min_prompts = min(args.min_prompts, 6)
        args.prompts_per_concurrency = min(args.prompts_per_concurrency, 2)
        args.output_len = min(args.output_len, 64)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    jsonl = args.out_dir / f"{args.name}.jsonl"
    old: list[dict[str, Any]] = []
    if (args.replot or args.append) and jsonl.is_file():
        old = [json.loads(x) for x in jsonl.read_text().splitlines() if x.strip()]
    if args.replot and args.policies is None:  # every policy and variant the file holds
        seen = {r["policy"] for r in old}
        args.policies = tuple(p for p in POLICIES if p in seen) + tuple(
            sorted(seen - set(POLICIES))
        )
    args.policies = args.policies or POLICIES
    args.concurrency = args.concurrency or CONCURRENCY
    try:  # a replot starts no server: a variant's flags need not be given again
        check_policies(args.policies, parse_variants(args.variant), need_flags=not args.replot)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.fresh_deployments and not args.interleave:
        print(
            "error: --fresh-deployments needs --interleave (without it every pass already "
            "starts each policy's server anew)",
            file=sys.stderr,
        )
        return 2
    raw = list(old)
    if not args.replot:
        log_path = args.out_dir / f"{args.name}_server.log"
        if not args.append:
            jsonl.write_text("")
            log_path.write_text("")
            for label in args.policies if args.step_logs else ():  # workers append: start anew
                for old_log in (args.step_logs / label).glob("*.steps.jsonl"):
                    old_log.unlink()
        first = 1 + max((r.get("pass", 0) for r in old), default=-1)
        if args.interleave:
            raw += run_interleaved(args, first, jsonl, log_path)
        else:
            for k in range(first, first + args.passes):
                # Odd passes run the policies in reverse, so machine drift does not favour one.
                order = list(args.policies)[:: -1 if k % 2 else 1]
                for policy in order:
                    raw += run_policy(args, policy, k, jsonl, log_path)
    if args.step_logs and args.step_logs.is_dir():  # each cell's host speed, from its forwards
        raw = host_speed.adjust(raw, args.step_logs, args.policies)
        # beside the measurements, not in them: bench.verdict --key reads this file
        with (args.out_dir / f"{args.name}_host_speed.jsonl").open("w") as f:
            for r in raw:
                f.write(json.dumps({k: r.get(k) for k in HOST_SPEED_FIELDS}) + "\n")
    rows = aggregate(raw)
    policies = [p for p in args.policies if any(r["policy"] == p for r in rows)]
    goals = analyse(rows, policies, args.sla, raw)
    write_csv(args.out_dir / f"{args.name}.csv", rows)
    series = {
        p: [(r["mean_tps_per_user"], r["output_throughput"]) for r in rows if r["policy"] == p]
        for p in policies
    }
    model = Path(args.model_path).name if args.model_path else "bundled tiny-moe"
    title = f"CPU engine, {model}, PD --role all"
    plot_pareto(args.out_dir / f"{args.name}_pareto.png", series, f"Fig. 7 shape: {title}",
                anchors=args.sla)  # fmt: skip
    plot_load(args.out_dir / f"{args.name}_load.png", rows, policies, f"Fig. 8 shape: {title}")
    summary = {
        "tool": "dspark_sglang.bench.sweep",
        "command": shlex.join(["python", "-m", "dspark_sglang.bench.sweep", *argv]),
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        # The machines the records were measured on (a replot may run elsewhere); records from
        # before the field existed count as unknown.
        "measured_on": sorted({r.get("host_cpu", "unknown") for r in raw}),
        "analysed_on": host_facts(),
        "policies": policies,
        "concurrency": sorted({r["concurrency"] for r in rows}),
        "passes": max((r["passes"] for r in rows), default=0),
        "goals": goals,
    }
    (args.out_dir / f"{args.name}_summary.json").write_text(json.dumps(summary, indent=1))
    print_report(rows, policies, goals)
    if args.step_logs and args.step_logs.is_dir():
        print(f"\ndecode steps by batch size (bench.steps on {args.step_logs}):")
        out = args.out_dir / f"{args.name}_steps"
        files = ["--csv", f"{out}.csv", "--json", f"{out}.json", "--cells", str(jsonl)]
        return steps.main([str(args.step_logs), *files])
    return 0


if __name__ == "__main__":
    sys.exit(main())
