"""bench.serving: arrival statistics, metric math on synthetic timestamps, JSONL schema."""

from __future__ import annotations

import json
import math
from dataclasses import replace
from pathlib import Path

import httpx
import numpy as np
import pytest

from dspark_sglang.bench import serving
from dspark_sglang.bench.serving import Outcome, arrival_offsets, compute_metrics


@pytest.mark.parametrize("process", ["poisson", "gamma", "constant"])
def test_arrival_mean_rate(process: str) -> None:
    t = arrival_offsets(20001, 50.0, process, burstiness=0.5, rng=np.random.default_rng(3))
    gaps = np.diff(t)
    assert t[0] == 0.0 and np.all(gaps >= 0)
    assert abs(1.0 / gaps.mean() - 50.0) / 50.0 < 0.03


@pytest.mark.parametrize(("process", "burstiness", "cv2"), [
    ("poisson", 1.0, 1.0), ("gamma", 1.0, 1.0), ("gamma", 0.25, 4.0), ("gamma", 4.0, 0.25),
    ("constant", 1.0, 0.0),
])  # fmt: skip
def test_arrival_burstiness(process: str, burstiness: float, cv2: float) -> None:
    """Squared coefficient of variation of the gaps: 1 for Poisson, 1/shape for gamma."""
    gaps = np.diff(arrival_offsets(40001, 10.0, process, burstiness, np.random.default_rng(5)))
    got = gaps.var() / gaps.mean() ** 2
    assert abs(got - cv2) <= 0.08 * max(cv2, 0.5)


def test_arrival_infinite_rate_and_seed() -> None:
    assert np.all(arrival_offsets(7, math.inf) == 0)
    a = arrival_offsets(100, 5.0, "poisson", rng=np.random.default_rng(9))
    b = arrival_offsets(100, 5.0, "poisson", rng=np.random.default_rng(9))
    assert np.array_equal(a, b)
    with pytest.raises(ValueError):
        arrival_offsets(3, 1.0, "weibull")


def _outcome(ttft: float, latency: float, n_out: int, rounds: int = 0) -> Outcome:
    gaps = [(latency - ttft) / (n_out - 1)] * (n_out - 1) if n_out > 1 else []
    return Outcome(True, "", 10, n_out, 0.0, ttft, latency, gaps, None, rounds)


def test_metric_math_on_synthetic_timestamps() -> None:
    outs = [_outcome(0.1, 1.1, 11, rounds=5), _outcome(0.3, 2.3, 21, rounds=4)]
    outs.append(Outcome(False, "HTTP 503: busy"))
    m = compute_metrics(outs, duration=4.0, slo={"ttft": 0.2, "tpot": 0.15})
    assert m["completed"] == 2 and m["failed"] == 1
    assert m["total_output_tokens"] == 32 and m["total_input_tokens"] == 20
    assert m["output_throughput"] == pytest.approx(8.0)
    assert m["total_throughput"] == pytest.approx(13.0)
    assert m["request_throughput"] == pytest.approx(0.5)
    assert m["mean_ttft_ms"] == pytest.approx(200.0)
    assert m["median_ttft_ms"] == pytest.approx(200.0)
    assert m["mean_tpot_ms"] == pytest.approx(100.0)  # both requests: 100 ms per token
    assert m["mean_itl_ms"] == pytest.approx(100.0)
    assert m["mean_e2e_latency_ms"] == pytest.approx(1700.0) == m["mean_e2el_ms"]
    assert m["p99_e2e_latency_ms"] == pytest.approx(np.percentile([1100, 2300], 99))
    assert m["mean_tps_per_user"] == pytest.approx(10.0)
    assert m["accept_length"] == pytest.approx((10 + 20) / (5 + 4))
    assert m["concurrency"] == pytest.approx((1.1 + 2.3) / 4.0)
    # Only the first meets ttft <= 200 ms; goodput counts good requests over the duration.
    assert m["request_goodput"] == pytest.approx(0.25)
    assert m["output_goodput"] == pytest.approx(11 / 4.0)
    assert m["good_request_fraction"] == pytest.approx(1 / 3)
    assert m["errors"] == ["HTTP 503: busy"]


def test_steady_window_throughput_on_synthetic_timestamps() -> None:
    """Closed loop at c = 2, five requests: the window runs from the second completion (t = 4)
    to the last send (t = 7); tokens are counted from each request's running usage, so a chunk
    of several tokens counts them all, and the ramp and the drain stay out."""

    def req(start: float, end: float, times: list[tuple[float, int]]) -> Outcome:
        n = times[-1][1]
        return Outcome(True, "", 10, n, start, times[0][0] - start, end - start, token_times=times)

    outs = [
        req(0.0, 3.0, [(1.0, 1), (2.0, 5), (3.0, 10)]),
        req(0.0, 4.0, [(1.0, 1), (3.5, 6), (4.0, 10)]),
        req(3.0, 7.0, [(3.5, 1), (4.5, 4), (6.0, 8), (7.0, 10)]),  # 9 tokens in (4, 7]
        req(4.0, 8.0, [(4.5, 1), (6.5, 7), (8.0, 10)]),  # 7 in the window
        req(7.0, 9.0, [(7.5, 1), (9.0, 10)]),  # sent at the window's end: none
    ]
    assert serving.steady_window(outs, 2) == (4.0, 7.0)
    m = compute_metrics(outs, duration=9.0, closed_loop=2)
    assert m["steady_window_s"] == pytest.approx(3.0)
    assert m["steady_output_throughput"] == pytest.approx((9 + 7) / 3.0)
    assert m["output_throughput"] == pytest.approx(50 / 9.0)
    # No window (every request in the first wave), no continuous usage, or an open loop: None.
    assert compute_metrics(outs[:2], 4.0, closed_loop=2)["steady_output_throughput"] is None
    bare = [replace(o, token_times=[]) for o in outs]
    assert compute_metrics(bare, 9.0, closed_loop=2)["steady_output_throughput"] is None
    assert "steady_output_throughput" not in compute_metrics(outs, 9.0)
    # A window under a quarter of the run (3 s of 13), or with fewer than 8 tokens a slot, is
    # too short to measure: one step's burst over a few ms is not a rate.
    assert compute_metrics(outs, 13.0, closed_loop=2)["steady_output_throughput"] is None
    assert compute_metrics(outs, 11.0, closed_loop=2)["steady_output_throughput"] is not None
    thin = [*outs[:3], req(4.0, 8.0, [(4.5, 1), (8.0, 10)]), outs[4]]  # 9 + 1 tokens < 2 x 8
    assert compute_metrics(thin, 9.0, closed_loop=2)["steady_output_throughput"] is None


def test_slo_parsing() -> None:
    assert serving.parse_slo(["ttft:300", "tpot:50"]) == {"ttft": 0.3, "tpot": 0.05}
    for bad in (["ttft"], ["foo:1"], ["tpot:-1"]):
        with pytest.raises(ValueError):
            serving.parse_slo(bad)


def test_prompt_order_is_fixed_by_seed(tmp_path: Path) -> None:
    a = serving.build_prompts(serving.parse_args(["--num-prompts", "20", "--seed", "4"]))
    b = serving.build_prompts(serving.parse_args(["--num-prompts", "20", "--seed", "4"]))
    c = serving.build_prompts(serving.parse_args(["--num-prompts", "20", "--seed", "5"]))
    assert [p.prompt for p in a] == [p.prompt for p in b] != [p.prompt for p in c]
    r = serving.build_prompts(
        serving.parse_args(["--dataset-name", "random", "--num-prompts", "30",
                            "--random-input-len", "50", "--random-range-ratio", "0.5"])
    )  # fmt: skip
    assert all(25 <= len(p.prompt) <= 50 and p.prompt_len == len(p.prompt) for p in r)
    turns = tmp_path / "d.jsonl"
    turns.write_text('{"turns": ["hello", "again"]}\n{"prompt": "p2"}\n')
    d = serving.build_prompts(serving.parse_args(["--dataset-path", str(turns), "--num-prompts",
                                                  "2", "--disable-shuffle"]))  # fmt: skip
    assert [p.prompt for p in d] == ["hello", "hello", "p2"]  # warm-up request first


def test_output_len_range_ratio_varies_max_tokens_not_the_order() -> None:
    """--output-len-range-ratio draws each text prompt's max_tokens in [len*ratio, len] (so a
    closed loop with --ignore-eos does not finish in lock-step); same seed, same lengths; the
    prompt order is the fixed-length run's; a ratio outside (0, 1] is a CLI error."""
    argv = ["--num-prompts", "200", "--seed", "3", "--output-len", "128"]
    fixed = serving.build_prompts(serving.parse_args(argv))
    a = serving.build_prompts(serving.parse_args([*argv, "--output-len-range-ratio", "0.5"]))
    b = serving.build_prompts(serving.parse_args([*argv, "--output-len-range-ratio", "0.5"]))
    assert [p.prompt for p in a] == [p.prompt for p in fixed]
    assert [p.output_len for p in a] == [p.output_len for p in b]
    lens = [p.output_len for p in a]
    assert min(lens) >= 64 and max(lens) <= 128 and len(set(lens)) > 30
    assert {p.output_len for p in fixed} == {128}
    for bad in ("0", "1.5", "-1"):
        with pytest.raises(SystemExit):
            serving.parse_args([*argv, "--output-len-range-ratio", bad])


def test_mooncake_trace_shares_prefixes_and_timestamps(tmp_path: Path) -> None:
    f = tmp_path / "trace.jsonl"
    rows = [
        {"timestamp": 1000, "input_length": 10, "output_length": 3, "hash_ids": [7, 8]},
        {"timestamp": 1500, "input_length": 6, "output_length": 2, "hash_ids": [7]},
    ]
    f.write_text("\n".join(json.dumps(r) for r in rows))
    p = serving.trace_prompts(f, (10, 100), block_size=4, seed=0)
    assert [x.timestamp for x in p] == [0.0, 0.5]
    assert p[0].prompt[:4] == p[1].prompt[:4] and len(p[0].prompt) == 8 + 2 - 0
    assert p[1].prompt_len == 6 and len(p[1].prompt) == 6


METRICS = """\
# TYPE dspark_verify_budget_k gauge
dspark_verify_budget_k{worker="decode0"} 12.0
dspark_verify_budget_k{worker="prefill0"} 0.0
dspark_running_requests{worker="decode0"} 4.0
dspark_step_seconds{worker="decode0"} 0.02
dspark_worker_accept_length{worker="decode0"} 3.5
dspark_verify_tokens_per_step{worker="decode0"} 15.0
dspark_acceptance_rate{position="1",worker="decode0"} 0.9
dspark_acceptance_rate{position="2",worker="decode0"} 0.8
"""


CAPACITY = {
    "version": 3, "observed": 96, "drift_events": 0, "mape": 0.08,
    "profile": {"name": "live-decode0", "model": {"kind": "table", "version": 3, "params": {}}},
}  # fmt: skip


def _fake_server(request: httpx.Request) -> httpx.Response:
    if request.url.path == "/v1/models":
        return httpx.Response(200, json={"data": [{"id": "tiny"}]})
    if request.url.path == "/metrics":
        return httpx.Response(200, text=METRICS)
    if request.url.path == "/capacity":
        return httpx.Response(200, json={"workers": {"decode0": CAPACITY}})
    body = json.loads(request.content)
    n = body["max_tokens"]
    ext = {"accept_length": 2.0, "spec_rounds": (n - 1) // 2, "spec_accepted": 3}
    chunks = [{"choices": [{"index": 0, "text": "ab", "finish_reason": None}]}] * (n - 1)
    chunks.append({"choices": [{"index": 0, "text": "c", "finish_reason": "length"}],
                   "dspark": ext})  # fmt: skip
    chunks.append({"choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": n}})
    sse = "".join(f"data: {json.dumps(c)}\n\n" for c in chunks) + "data: [DONE]\n\n"
    return httpx.Response(200, text=sse, headers={"content-type": "text/event-stream"})


# sglang.bench_serving's result keys that plotting scripts read, plus ours.
REQUIRED = {
    "backend": str, "request_rate": (str, float), "max_concurrency": int, "duration": float,
    "completed": int, "total_input_tokens": int, "total_output_tokens": int,
    "request_throughput": float, "input_throughput": float, "output_throughput": float,
    "total_throughput": float, "mean_e2e_latency_ms": float, "median_e2e_latency_ms": float,
    "p99_e2e_latency_ms": float, "mean_ttft_ms": float, "median_ttft_ms": float,
    "p90_ttft_ms": float, "p99_ttft_ms": float, "mean_tpot_ms": float, "median_tpot_ms": float,
    "p99_tpot_ms": float, "mean_itl_ms": float, "median_itl_ms": float, "p95_itl_ms": float,
    "p99_itl_ms": float, "concurrency": float, "accept_length": float,
    "mean_tps_per_user": float, "request_goodput": float, "per_position_acceptance": list,
    "verify_tokens_per_step": float, "verify_tokens_per_request": float,
    "server_accept_length": float,
}  # fmt: skip


def test_jsonl_schema_against_a_fake_server(tmp_path: Path) -> None:
    out = tmp_path / "res.jsonl"
    argv = ["--num-prompts", "6", "--max-concurrency", "2", "--output-len", "5",
            "--output-file", str(out), "--slo", "ttft:1000", "--disable-tqdm",
            "--metrics-interval", "0.01", "--metadata", "policy=lagged"]  # fmt: skip
    args = serving.parse_args(argv)
    rec = serving.run(args, transport=httpx.MockTransport(_fake_server))
    rec2 = serving.run(args, transport=httpx.MockTransport(_fake_server))
    lines = out.read_text().splitlines()
    assert len(lines) == 2  # appended, one object per run
    row = json.loads(lines[0])
    for key, kind in REQUIRED.items():
        assert isinstance(row[key], kind), key
    assert row["completed"] == 6 and row["failed"] == 0 and row["policy"] == "lagged"
    assert row["total_output_tokens"] == 30 and row["total_input_tokens"] == 30
    assert row["accept_length"] == pytest.approx(24 / 12)
    assert row["per_position_acceptance"] == [0.9, 0.8]
    assert row["verify_tokens_per_request"] == pytest.approx(1 + 12 / 4)
    assert row["server_accept_length"] == 3.5
    assert row["server_counts"] == "cumulative"  # a server without counters: its ratios
    assert row["server_capacity"] == {
        "decode0": {"version": 3, "observed": 96, "drift_events": 0, "mape": 0.08,
                    "model": CAPACITY["profile"]["model"]}
    }  # fmt: skip
    assert rec["model_id"] == "tiny" and rec2["completed"] == 6
    assert "Serving Benchmark Result" in serving.format_summary(rec)


class _CountingServer:
    """A fake server whose decode worker's counters since boot (dspark_spec_*_total) grow with
    every completion it serves and whose heartbeat count grows with every scrape. It starts
    with 100 earlier rounds at other ratios, so cumulative values differ from the run's."""

    def __init__(self) -> None:
        self.done, self.beats = 0, 0

    def metrics(self) -> str:
        self.beats += 1
        n = self.done
        c = {
            "rounds": 100 + 2 * n,
            "committed_tokens": 120 + 5 * n,
            "verified_drafts": 700 + 8 * n,
            "accepted_drafts": 20 + 3 * n,
            "verify_tokens": 800 + 10 * n,
            "steps": 100 + 2 * n,
        }
        lines = [f'dspark_worker_heartbeats_total{{worker="decode0"}} {self.beats}']
        lines += [f'dspark_spec_{k}_total{{worker="decode0"}} {v}' for k, v in c.items()]
        for pos, (risk, passed) in enumerate([(100 + 2 * n, 10 + 2 * n), (10 + 2 * n, 1 + n)], 1):
            lines.append(f'dspark_spec_at_risk_total{{position="{pos}",worker="decode0"}} {risk}')
            lines.append(f'dspark_spec_passed_total{{position="{pos}",worker="decode0"}} {passed}')
        return METRICS + "\n".join(lines) + "\n"

    def __call__(self, request: httpx.Request) -> httpx.Response:
        if request.url.path == "/metrics":
            return httpx.Response(200, text=self.metrics())
        if request.url.path.startswith("/v1/completions"):
            self.done += 1
        return _fake_server(request)


def test_server_signals_are_the_counters_difference_over_the_run() -> None:
    """Accept length, acceptance per position and verify tokens come from the counters read
    after the warm-up and after the run: the warm-up's and earlier traffic's rounds drop out."""
    argv = ["--num-prompts", "6", "--max-concurrency", "2", "--output-len", "5",
            "--warmup-requests", "2", "--disable-tqdm", "--metrics-interval", "0.01"]  # fmt: skip
    fake = _CountingServer()
    rec = serving.run(serving.parse_args(argv), transport=httpx.MockTransport(fake))
    assert fake.done == 8 and rec["completed"] == 6
    assert rec["server_counts"] == "run"
    assert rec["server_accept_length"] == pytest.approx(5 / 2)  # cumulative: 160 / 116
    assert rec["per_position_acceptance"] == pytest.approx([1.0, 0.5])
    assert rec["verify_tokens_per_step"] == pytest.approx(10 / 2)
    assert rec["mean_verify_budget_k"] == pytest.approx(8 / 2)
    assert rec["verify_tokens_per_request"] == pytest.approx(10 / 2)


def test_run_counts_refuse_a_restarted_worker() -> None:
    text = lambda beats, rounds, boot=7: (
        f'dspark_worker_heartbeats_total{{worker="decode0"}} {beats}\n'
        f'dspark_worker_boot{{worker="decode0"}} {boot}\n'
        + "".join(f'dspark_spec_{k}_total{{worker="decode0"}} {rounds}\n' for k in serving._SPEC)
    )
    a, b = serving.parse_metrics(text(9, 50)), serving.parse_metrics(text(12, 70))
    assert serving.run_counts(a, b)["rounds"] == 20
    assert serving.run_counts(a, serving.parse_metrics(text(2, 70))) is None  # rebooted
    assert serving.run_counts(a, serving.parse_metrics(text(90, 70, boot=8))) is None  # rebooted
    assert serving.run_counts(a, serving.parse_metrics(text(12, 40))) is None  # counts went back
    assert serving.run_counts(None, b) is None
    assert serving.run_counts(serving.parse_metrics(METRICS), b) is None  # no counters there
