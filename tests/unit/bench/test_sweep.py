"""bench.sweep: server command per policy and the goal analysis of a sweep's rows."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import msgspec
import pytest

from dspark_sglang.bench import sweep
from dspark_sglang.hostinfo import cpu_model


def _args(*extra: str) -> object:
    a = sweep.build_parser().parse_args(["--draft-model-path", "D", *extra])
    a.concurrency = (1, 8)
    return a


def test_server_command_per_policy() -> None:
    a = _args("--capacity-profile", "p.yaml")
    ns = sweep.server_command(a, "no-spec")
    assert ns[ns.index("--speculative-algorithm") + 1] == "none" and "D" not in ns
    lag = sweep.server_command(a, "lagged")
    assert lag[lag.index("--schedule-mode") + 1] == "lagged"
    assert lag[lag.index("--capacity-profile") + 1] == "p.yaml"
    assert lag[lag.index("--max-running-requests") + 1] == "8"
    fx = sweep.server_command(_args(), "fixed:3")
    assert fx[fx.index("--schedule-mode") + 1] == "fixed:3" and "--capacity-profile" not in fx
    b = sweep.bench_args(_args(), "lagged", 8)
    assert b.max_concurrency == 8 and b.num_prompts == 24 and b.ignore_eos
    logged = _args("--server-args=--step-log out/{policy} --disable-overlap-schedule")
    cmd = sweep.server_command(logged, "fixed:3")
    assert cmd[-3:] == ["--step-log", "out/fixed:3", "--disable-overlap-schedule"]


def _row(policy: str, c: int, thr: float, tps: float) -> dict:
    return {"policy": policy, "concurrency": c, "output_throughput": thr,
            "mean_tps_per_user": tps, "verify_tokens_per_request": 3.0}  # fmt: skip


def test_analyse_goals() -> None:
    rows = [
        _row("no-spec", 1, 100, 100), _row("no-spec", 8, 400, 50),
        _row("fixed:3", 1, 150, 150), _row("fixed:3", 8, 500, 62),
        _row("lagged", 1, 160, 160), _row("lagged", 8, 480, 60),
    ]  # fmt: skip
    g = sweep.analyse(rows, ["no-spec", "fixed:3", "lagged"], sla=(55.0, 200.0))
    per = {x["concurrency"]: x for x in g["per_concurrency"]}
    assert per[1]["best_rival"] == "fixed:3" and per[1]["pass"]
    assert per[8]["ratio"] == pytest.approx(0.96) and not per[8]["pass"]
    assert g["lagged_ge_best_minus_3pct_every_c"] is False
    m = g["matched_throughput_speedup_vs_nospec"]["lagged"]
    # no-spec's 400 tok/s point: lagged's frontier gives 60 + (480-400)/(480-160)·100 tok/s/user.
    assert m[-1]["speedup"] == pytest.approx((60 + 80 / 320 * 100) / 50)
    assert g["lagged_matched_speedup_ge_1.6"] is (g["lagged_matched_speedup_min"] >= 1.6)
    assert g["throughput_at_sla"]["55.0"]["lagged"] == pytest.approx(480.0)
    assert g["throughput_at_sla"]["200.0"]["lagged"] is None


def test_paired_ratios_compare_within_each_pass() -> None:
    """A host that runs pass 1 twice as fast as pass 0 moves every median but no paired ratio."""
    raw = [
        _row("no-spec", 4, 100, 25) | {"pass": 0}, _row("fixed:3", 4, 120, 30) | {"pass": 0},
        _row("lagged", 4, 114, 28) | {"pass": 0},
        _row("no-spec", 4, 200, 50) | {"pass": 1}, _row("fixed:3", 4, 240, 60) | {"pass": 1},
        _row("lagged", 4, 240, 60) | {"pass": 1},
        _row("lagged", 8, 50, 6) | {"pass": 0},  # no rival at c = 8: no ratio
    ]  # fmt: skip
    assert sweep.paired_ratios(raw) == {4: [pytest.approx(0.95), pytest.approx(1.0)]}
    rows = sweep.aggregate(raw)
    (x,) = sweep.analyse(rows, ["no-spec", "fixed:3", "lagged"], (), raw)["per_concurrency"]
    assert x["paired_median"] == pytest.approx(0.975) and x["paired_passes_ge_0.97"] == 1
    assert x["ratio"] == pytest.approx(177 / 180)  # ratio of medians, kept as it was


def test_the_goal_is_also_judged_on_the_steady_window() -> None:
    """Rows carrying steady_output_throughput get the same goal table on it (best rival picked
    on that key); rows without it (a server without continuous usage, a window too short) are
    left out, and then the steady goal does not hold at every c."""
    rows = [
        _row("no-spec", 32, 700, 22) | {"steady_output_throughput": 690},
        _row("fixed:3", 32, 650, 20) | {"steady_output_throughput": 720},
        _row("lagged", 32, 660, 21) | {"steady_output_throughput": 740},
        _row("no-spec", 64, 900, 14), _row("lagged", 64, 950, 15),
    ]  # fmt: skip
    g = sweep.analyse(rows, ["no-spec", "fixed:3", "lagged"], ())
    whole = {x["concurrency"]: x for x in g["per_concurrency"]}
    assert whole[32]["best_rival"] == "no-spec" and not whole[32]["pass"]
    (st,) = g["steady_per_concurrency"]
    assert st["concurrency"] == 32 and st["best_rival"] == "fixed:3"
    assert st["ratio"] == pytest.approx(740 / 720) and st["pass"]
    assert g["steady_lagged_ge_best_minus_3pct_every_c"] is False  # c = 64 has no window
    both = [*rows[:3], rows[3] | {"steady_output_throughput": 880}]
    both.append(rows[4] | {"steady_output_throughput": 930})
    g = sweep.analyse(both, ["no-spec", "fixed:3", "lagged"], ())
    assert len(g["steady_per_concurrency"]) == 2
    assert g["steady_lagged_ge_best_minus_3pct_every_c"] is True
    assert "steady_per_concurrency" not in sweep.analyse(rows[3:], ["no-spec", "lagged"], ())


def test_replot_from_jsonl(tmp_path: Path) -> None:
    rows = [_row(p, c, 100.0 * c, 100.0 / c) for p in ("no-spec", "lagged") for c in (1, 2)]
    (tmp_path / "s.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    argv = ["--replot", "--out-dir", str(tmp_path), "--name", "s", "--policies", "no-spec,lagged"]
    assert sweep.main(argv) == 0
    for f in ("s.csv", "s_pareto.png", "s_load.png", "s_summary.json"):
        assert (tmp_path / f).stat().st_size > 0
    summary = json.loads((tmp_path / "s_summary.json").read_text())
    assert summary["measured_on"] == ["unknown"]  # records without host_cpu
    assert summary["analysed_on"]["cpu"] == cpu_model()


def test_the_report_gives_each_c_its_cell_length_and_names_the_short_ones(capsys) -> None:
    """Per c the median and shortest cell duration over policies and passes; a c whose median
    cell is under SHORT_CELL_S is named with the flags that lengthen it."""
    raw = [
        _row("no-spec", 2, 300, 150) | {"pass": 0, "duration": 5.0},
        _row("lagged", 2, 330, 165) | {"pass": 0, "duration": 6.0},
        _row("no-spec", 2, 310, 155) | {"pass": 1, "duration": 9.0},
        _row("lagged", 2, 320, 160) | {"pass": 1, "duration": 4.0},
        _row("no-spec", 32, 1300, 40) | {"pass": 0, "duration": 20.0},
        _row("lagged", 32, 1350, 42) | {"pass": 0, "duration": 18.0},
        _row("lagged", 64, 1500, 23),  # an older record without a duration
    ]  # fmt: skip
    cells = sweep.cell_seconds(raw)
    assert cells == {2: {"median": 5.5, "shortest": 4.0}, 32: {"median": 19.0, "shortest": 18.0}}
    policies = ["no-spec", "lagged"]
    g = sweep.analyse(sweep.aggregate(raw), policies, (), raw)
    assert g["cell_seconds"] == {"2": cells[2], "32": cells[32]}
    json.dumps(g)  # the summary file holds it
    sweep.print_report(sweep.aggregate(raw), policies, g)
    out = capsys.readouterr().out
    assert "cell length, seconds (median / shortest): c=2 5.5 / 4.0, c=32 19.0 / 18.0" in out
    (short,) = [ln for ln in out.splitlines() if "cells under" in ln]
    assert short.strip().startswith("c=2:") and "--min-prompts" in short
    assert (
        sweep.analyse(sweep.aggregate(raw[-1:]), policies, (), raw[-1:]).get("cell_seconds") is None
    )


def test_passes_are_aggregated_by_median() -> None:
    raw = [_row("lagged", 4, t, 10.0) | {"pass": k} for k, t in enumerate((100.0, 300.0, 200.0))]
    (row,) = sweep.aggregate(raw)
    assert row["passes"] == 3 and row["output_throughput"] == 200.0
    assert row["output_throughput_passes"] == "100.0;300.0;200.0"


class _FakeServer:
    """Stands in for sweep.Server: starts nothing (its process group exists nowhere)."""

    pid = 2**22 + 1  # above Linux's largest pid

    def __init__(self, cmd: list[str], *_: object) -> None:
        pass

    def __enter__(self) -> _FakeServer:
        return self

    def __exit__(self, *_: object) -> None:
        pass


def _logging_server(events: list) -> type[_FakeServer]:
    """A fake server class that appends ("start" | "stop", policy's mode, port) to `events`."""

    class LoggingServer(_FakeServer):
        def __init__(self, cmd: list[str], url: str, *_: object) -> None:
            mode = cmd[cmd.index("--schedule-mode") + 1] if "--schedule-mode" in cmd else "none"
            self.key = (mode, url.rsplit(":", 1)[1])

        def __enter__(self) -> LoggingServer:
            events.append(("start", *self.key))
            return self

        def __exit__(self, *_: object) -> None:
            events.append(("stop", *self.key))

    return LoggingServer


def _fake_result(ns: object) -> dict:
    """What serving.run returns for one level, from the sweep's own arguments."""
    meta = dict(ns.metadata)  # type: ignore[attr-defined]
    return _row(meta["policy"], ns.max_concurrency, 100.0, 10.0) | {  # type: ignore[attr-defined]
        "accept_length": 1.0, "failed": 0}  # fmt: skip


def test_interleaved_sweep_runs_one_server_per_policy_and_rotates_the_order(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """--interleave: every policy's server is started once on its own ports, then each level is
    measured policy after policy, the order rotating from level to level and pass to pass."""
    started: list[list[str]] = []
    measured: list[tuple[str, str, int]] = []

    class FakeServer(_FakeServer):
        def __init__(self, cmd: list[str], url: str, *_: object) -> None:
            started.append(cmd)
            assert url.endswith(cmd[cmd.index("--port") + 1])

    def fake_run(ns: object) -> dict:
        meta = dict(ns.metadata)  # type: ignore[attr-defined]
        measured.append((ns.base_url, meta["policy"], ns.max_concurrency))  # type: ignore[attr-defined]
        return _fake_result(ns)

    monkeypatch.setattr(sweep, "Server", FakeServer)
    monkeypatch.setattr(sweep.serving, "run", fake_run)
    argv = ["--interleave", "--passes", "2", "--policies", "no-spec,fixed:3,lagged"]
    argv += ["--concurrency", "1,4", "--out-dir", str(tmp_path), "--name", "s"]
    assert sweep.main(argv) == 0
    ports = [cmd[cmd.index("--port") + 1] for cmd in started]
    zmq = [cmd[cmd.index("--zmq-port") + 1] for cmd in started]
    assert len(started) == 3 and len(set(ports)) == 3 and len(set(zmq)) == 3
    port_of = {cmd[cmd.index("--schedule-mode") + 1] if "--schedule-mode" in cmd else "no-spec":
               p for cmd, p in zip(started, ports, strict=True)}  # fmt: skip
    assert all(url.endswith(port_of[p]) for url, p, _ in measured)
    order = [p for _, p, _ in measured]
    a, b, c = "no-spec", "fixed:3", "lagged"
    assert order == [a, b, c, b, c, a, b, c, a, c, a, b]  # pass 0: c=1, c=4; pass 1
    assert all(x != y for x, y in itertools.pairwise(order))  # never twice in a row
    assert [c for *_, c in measured] == [1] * 3 + [4] * 3 + [1] * 3 + [4] * 3
    rows = (tmp_path / "s.jsonl").read_text().splitlines()
    assert len(rows) == 12


def test_fresh_deployments_start_every_policy_anew_each_pass_on_its_own_ports(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """--fresh-deployments: each pass starts every policy's server (in a rotating order) and
    stops them all before the next pass starts its own; a policy keeps its ports. Without
    --interleave the flag is an error naming it."""
    events: list[tuple[str, str, str]] = []

    def fake_run(ns: object) -> dict:
        meta = dict(ns.metadata)  # type: ignore[attr-defined]
        events.append(("measure", meta["policy"], ns.base_url.rsplit(":", 1)[1]))  # type: ignore[attr-defined]
        return _fake_result(ns)

    monkeypatch.setattr(sweep, "Server", _logging_server(events))
    monkeypatch.setattr(sweep.serving, "run", fake_run)
    argv = ["--interleave", "--fresh-deployments", "--passes", "3", "--policies"]
    argv += ["verify-all,lagged", "--concurrency", "1,2", "--out-dir", str(tmp_path)]
    assert sweep.main([*argv, "--name", "f"]) == 0
    kinds = [e[0] for e in events]
    assert kinds == (["start"] * 2 + ["measure"] * 4 + ["stop"] * 2) * 3
    starts = [e[1] for e in events if e[0] == "start"]
    assert starts == ["verify-all", "lagged", "lagged", "verify-all", "verify-all", "lagged"]
    port = {e[1]: e[2] for e in events if e[0] == "start"}
    assert all(e[2] == port[e[1]] for e in events if e[0] == "start")
    assert all(e[2] == port[e[1]] for e in events if e[0] == "measure")
    assert len((tmp_path / "f.jsonl").read_text().splitlines()) == 12
    assert sweep.main([*argv[1:], "--name", "g"]) == 2
    assert "--fresh-deployments needs --interleave" in capsys.readouterr().err


def test_burn_in_runs_every_level_untimed_before_each_fresh_pass_and_keeps_none(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """--burn-in: after each pass's deployments start, every policy serves every concurrency
    level once (the timed cells' order, on its own port) before the first timed cell; the burn-in
    runs are not in the JSONL. Without --interleave the one deployment burns in before its
    cells; without --fresh-deployments the shared deployments burn in once."""
    events: list[tuple[str, ...]] = []

    def fake_run(ns: object) -> dict:
        meta = dict(ns.metadata)  # type: ignore[attr-defined]
        port = ns.base_url.rsplit(":", 1)[1]  # type: ignore[attr-defined]
        events.append(("run", meta["policy"], str(meta["concurrency"]), port))
        return _fake_result(ns)

    monkeypatch.setattr(sweep, "Server", _logging_server(events))
    monkeypatch.setattr(sweep.serving, "run", fake_run)
    argv = ["--interleave", "--fresh-deployments", "--burn-in", "--passes", "2", "--policies"]
    argv += ["verify-all,lagged", "--concurrency", "1,2", "--out-dir", str(tmp_path)]
    assert sweep.main([*argv, "--name", "b"]) == 0
    kinds = [e[0] for e in events]
    assert kinds == (["start"] * 2 + ["run"] * 8 + ["stop"] * 2) * 2  # 4 burn-in, 4 timed
    runs = [e[1:3] for e in events if e[0] == "run"]
    assert runs[:4] == runs[4:8]  # the burn-in visits the levels in the timed cells' order
    assert {e[1:3] for e in events[2:6]} == {(p, c) for p in ("verify-all", "lagged") for c in "12"}
    port = {e[1]: e[2] for e in events if e[0] == "start"}
    assert all(e[3] == port[e[1]] for e in events if e[0] == "run")
    assert len((tmp_path / "b.jsonl").read_text().splitlines()) == 8  # 2 passes x 4 timed cells
    assert "burn-in c=1" in capsys.readouterr().err
    events.clear()
    assert sweep.main(["--burn-in", *argv[3:], "--name", "s"]) == 0  # sequential, per policy
    kinds = [e[0] for e in events]
    assert kinds == (["start"] + ["run"] * 4 + ["stop"]) * 4
    events.clear()
    assert sweep.main(["--interleave", *argv[2:], "--name", "o"]) == 0  # shared deployments
    assert [e[0] for e in events] == ["start"] * 2 + ["run"] * 12 + ["stop"] * 2


def test_level_order_never_measures_a_policy_twice_in_a_row_and_balances_places() -> None:
    """Within a pass no policy runs two cells back to back, and over n passes each policy takes
    every place at every level once (two policies: the order flips from pass to pass)."""
    for pols in (["a", "b", "c"], ["a", "b", "c", "d"]):
        n = len(pols)
        for k in range(2 * n):
            seq = [p for j in range(7) for p in sweep.level_order(pols, k, j)]
            assert all(x != y for x, y in itertools.pairwise(seq))
        for j in range(7):
            for pos in range(n):
                got = sorted(sweep.level_order(pols, k, j)[pos] for k in range(n))
                assert got == sorted(pols)
    two = [p for j in range(5) for p in sweep.level_order(["a", "b"], 1, j)]
    assert two == ["b", "a"] * 5
    assert sweep.level_order(["a", "b"], 0, 3) == ["a", "b"]
    assert sweep.level_order(["a"], 3, 2) == ["a"]


def test_a_variant_is_its_policy_with_more_flags_and_is_reported_against_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`lagged@noexp` with --variant noexp='--explore-ratio 0' starts lagged's server with the
    flags last; the report gives its per-pass ratio to lagged; the goal still reads `lagged`
    (a variant of a rival is no rival). A label naming no variant is an error naming the flag."""
    a = _args("--capacity-profile", "p.yaml", "--variant", "noexp=--explore-ratio 0",
              "--server-args=--step-log out/{policy}")  # fmt: skip
    cmd = sweep.server_command(a, "lagged@noexp", 1)
    assert cmd[cmd.index("--schedule-mode") + 1] == "lagged"
    assert cmd[cmd.index("--capacity-profile") + 1] == "p.yaml"
    assert cmd[-4:] == ["--step-log", "out/lagged@noexp", "--explore-ratio", "0"]
    assert cmd[cmd.index("--port") + 1] == str(a.port + 1)
    raw = [
        _row("fixed:3", 1, 100.0, 1.0) | {"pass": 0},
        _row("lagged", 1, 100.0, 1.0) | {"pass": 0},
        _row("lagged@noexp", 1, 90.0, 1.0) | {"pass": 0},
        _row("fixed:3@x", 1, 200.0, 1.0) | {"pass": 0},
        _row("fixed:3", 1, 120.0, 1.0) | {"pass": 1},
        _row("lagged", 1, 110.0, 1.0) | {"pass": 1},
        _row("lagged@noexp", 1, 121.0, 1.0) | {"pass": 1},
        _row("fixed:3@x", 1, 200.0, 1.0) | {"pass": 1},
    ]
    assert sweep.variant_ratios(raw) == {
        "lagged@noexp": {1: [0.9, pytest.approx(1.1)]},
        "fixed:3@x": {1: [2.0, pytest.approx(200 / 120)]},
    }
    rows = sweep.aggregate(raw)
    g = sweep.analyse(rows, ["fixed:3", "lagged", "lagged@noexp", "fixed:3@x"], (1.0,), raw)
    (per,) = g["per_concurrency"]
    assert per["best_rival"] == "fixed:3" and per["paired_ratios"] == [
        1.0,
        pytest.approx(110 / 120),
    ]
    assert g["variant_vs_base"]["lagged@noexp"]["1"]["paired_median"] == pytest.approx(1.0)
    with pytest.raises(ValueError, match="no --variant other="):
        sweep.check_policies(["lagged", "lagged@other"], {"noexp": []})
    with pytest.raises(ValueError, match="twice"):
        sweep.check_policies(["lagged", "lagged"], {})
    with pytest.raises(ValueError, match="--variant"):
        sweep.parse_variants(["noexp"])
    argv = ["--policies", "lagged,lagged@nope", "--out-dir", str(tmp_path)]
    assert sweep.main(argv) == 2
    assert "lagged@nope" in capsys.readouterr().err
    # a replot starts no server: without --policies it reads every label the file holds, and
    # needs no --variant
    (tmp_path / "v.jsonl").write_text("\n".join(json.dumps(r) for r in raw))
    assert sweep.main(["--replot", "--out-dir", str(tmp_path), "--name", "v"]) == 0
    summary = json.loads((tmp_path / "v_summary.json").read_text())
    assert summary["policies"] == ["fixed:3", "lagged", "fixed:3@x", "lagged@noexp"]
    assert summary["goals"]["variant_vs_base"]["lagged@noexp"]["1"]["paired_ratios"] == [
        0.9,
        pytest.approx(1.1),
    ]


def test_step_logs_go_one_folder_per_policy_and_end_in_a_step_report(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """--step-logs DIR: each deployment gets --step-log DIR/<label>; the sweep then writes the
    bench.steps report of those folders next to its other outputs."""
    from dspark_sglang.types import StepRecord

    enc = msgspec.json.Encoder()

    class FakeServer(_FakeServer):  # writes a step log where the worker would
        def __init__(self, cmd: list[str], *_: object) -> None:
            folder = Path(cmd[cmd.index("--step-log") + 1])
            folder.mkdir(parents=True, exist_ok=True)
            rec = StepRecord(step=0, num_reqs=2, num_tokens=2, num_prefill_tokens=0,
                             num_decode_reqs=2, kv_tokens=50, step_seconds=0.004)  # fmt: skip
            with (folder / "decode0.steps.jsonl").open("ab") as f:  # as the worker: append
                f.write((enc.encode(rec) + b"\n") * 30)

    monkeypatch.setattr(sweep, "Server", FakeServer)
    monkeypatch.setattr(sweep.serving, "run", _fake_result)
    logs = tmp_path / "steps"
    (logs / "lagged").mkdir(parents=True)  # a previous run's log: a new sweep starts anew
    (logs / "lagged" / "decode0.steps.jsonl").write_text("{not a record\n")
    argv = ["--interleave", "--policies", "no-spec,lagged", "--concurrency", "1"]
    argv += ["--out-dir", str(tmp_path), "--name", "s", "--step-logs", str(logs)]
    assert sweep.main(argv) == 0
    assert sorted(p.name for p in logs.iterdir()) == ["lagged", "no-spec"]
    report = json.loads((tmp_path / "s_steps.json").read_text())
    assert sorted(r["policy"] for r in report["rows"]) == ["lagged", "no-spec"]
    assert all(r["tok_per_s"] == pytest.approx(500.0) for r in report["rows"])
    assert (tmp_path / "s_steps.csv").is_file()
    assert "decode steps by batch size" in capsys.readouterr().out


def test_each_record_says_where_the_hosts_cpu_went(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """On Linux every measurement carries the host's and the deployments' CPU over its window
    (bench.hostcpu): here the 'deployment' under test is this process's own group, which burns
    CPU while serving.run runs, and the other deployment is idle (no such process)."""
    import os
    import time

    from dspark_sglang.bench import hostcpu

    if hostcpu.read() is None:
        pytest.skip("needs Linux /proc (the feature records nothing elsewhere)")

    class FakeServer(_FakeServer):
        def __init__(self, cmd: list[str], *_: object) -> None:
            self.pid = os.getpid() if "lagged" in cmd else 2**22 + 2

    def busy_run(ns: object) -> dict:
        end = time.process_time() + 0.3
        while time.process_time() < end:
            pass
        return _fake_result(ns)

    monkeypatch.setattr(sweep, "Server", FakeServer)
    monkeypatch.setattr(sweep.serving, "run", busy_run)
    argv = ["--interleave", "--policies", "no-spec,lagged", "--concurrency", "1"]
    argv += ["--out-dir", str(tmp_path), "--name", "s"]
    assert sweep.main(argv) == 0
    recs = {
        r["policy"]: r for r in map(json.loads, (tmp_path / "s.jsonl").read_text().splitlines())
    }
    lag, ns = recs["lagged"], recs["no-spec"]
    assert lag["cpu_measured_deployment"] > 0.5  # this process, busy for the whole window
    assert ns["cpu_measured_deployment"] == 0.0 and ns["cpu_other_deployments"] > 0.5
    assert lag["cpu_other_deployments"] == 0.0
    for r in (lag, ns):
        total = sum(r[f"cpu_host_{k}"] for k in ("user", "system", "idle", "steal"))
        assert total == pytest.approx(os.cpu_count(), rel=0.2)
    summary = json.loads((tmp_path / "s_summary.json").read_text())
    assert summary["goals"]["host_cpu"]["lagged"]["measured_deployment"] > 0.5
    assert lag["host_cpu"] == ns["host_cpu"] == cpu_model()
    assert summary["measured_on"] == [cpu_model()]
    assert "host CPU during each policy's runs" in capsys.readouterr().out


def test_with_step_logs_each_cell_is_also_scaled_to_its_deployments_usual_host_speed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """--step-logs: each record carries its window; the sweep reads each cell's host speed from
    the forwards its deployment logged in it (bench.host_speed) and judges the goal again on the
    scaled throughputs. Here pass 1 ran on a host 1.5x slower for every policy, and lagged's
    forwards are its own 1.2x slower: the scaling removes the first and keeps the second."""
    import time

    from dspark_sglang.types import StepRecord

    enc = msgspec.json.Encoder()
    logs = tmp_path / "steps"
    calls: dict[str, int] = {}
    level = {"no-spec": 1.0, "lagged": 1.2}

    def fake_run(ns: object) -> dict:
        policy = dict(ns.metadata)["policy"]  # type: ignore[attr-defined]
        k = calls[policy] = calls.get(policy, -1) + 1
        slow = (1.0, 1.5, 1.0, 1.5)[k] * level[policy]
        now = time.time()
        with (logs / policy / "decode0.steps.jsonl").open("ab") as f:
            for i in range(20):
                rec = StepRecord(step=i, num_reqs=1, num_tokens=4, num_prefill_tokens=0,
                                 num_decode_reqs=1, kv_tokens=50, step_seconds=0.006 * slow,
                                 forward_seconds=0.004 * slow, started_at=now)  # fmt: skip
                f.write(enc.encode(rec) + b"\n")
        time.sleep(0.002)  # the window closes after the steps started
        return _fake_result(ns) | {"output_throughput": 100.0 / slow}

    class FakeServer(_FakeServer):
        def __init__(self, cmd: list[str], *_: object) -> None:
            Path(cmd[cmd.index("--step-log") + 1]).mkdir(parents=True, exist_ok=True)

    monkeypatch.setattr(sweep, "Server", FakeServer)
    monkeypatch.setattr(sweep.serving, "run", fake_run)
    argv = ["--interleave", "--passes", "4", "--policies", "no-spec,lagged", "--concurrency", "1"]
    argv += ["--out-dir", str(tmp_path), "--name", "s", "--step-logs", str(logs)]
    assert sweep.main(argv) == 0
    recs = [json.loads(x) for x in (tmp_path / "s.jsonl").read_text().splitlines()]
    assert all(r["cell_start"] <= r["cell_end"] for r in recs)
    adj = json.loads((tmp_path / "s_summary.json").read_text())["goals"]["host_adjusted"]
    assert adj["cells"] == adj["cells_with_factor"] == 8
    assert adj["factor_max"] / adj["factor_min"] == pytest.approx(1.5)
    (x,) = adj["per_concurrency"]
    assert x["ratio"] == pytest.approx(1 / 1.2) and not x["pass"]  # lagged's own 1.2x stays
    assert x["paired_ratios"] == [pytest.approx(1 / 1.2)] * 4
    (pair,) = adj["pair_log_spread"]
    assert pair["adjusted"] == pytest.approx(0.0, abs=1e-9)
    rows = (tmp_path / "s.csv").read_text().splitlines()
    assert "host_adjusted_output_throughput" in rows[0] and "host_speed_factor" in rows[0]
    cells = [json.loads(x) for x in (tmp_path / "s_host_speed.jsonl").read_text().splitlines()]
    assert len(cells) == 8 and all(c["host_speed_factor"] for c in cells)
    assert {c["policy"] for c in cells} == {"no-spec", "lagged"}
    from dspark_sglang.bench import verdict

    assert verdict.summary(cells, sweep.is_rival, key="host_adjusted_output_throughput")
    out = capsys.readouterr().out
    assert "host speed per cell (bench.host_speed): 8 of 8 cells have a factor" in out
