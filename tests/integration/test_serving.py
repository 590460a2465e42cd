"""The OpenAI surface over real PD processes: completions, chat, streaming, stop strings, bad
input, concurrency, the real `openai` client, greedy parity with the one-process engine, KV freed
on disconnect."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import tempfile
import time
from pathlib import Path

import httpx
import openai
import pytest

from dspark_sglang.capacity_profile import load_profile
from dspark_sglang.engine.engine import LLM
from dspark_sglang.types import SamplingParams
from tests.integration.conftest import Cluster

pytestmark = pytest.mark.timeout(300)


def post(c: Cluster, path: str, body: dict, timeout: float = 60) -> httpx.Response:
    return httpx.post(f"{c.url}{path}", json=body, timeout=timeout)


def sse(c: Cluster, path: str, body: dict) -> list[dict]:
    events = []
    with httpx.stream("POST", f"{c.url}{path}", json={**body, "stream": True}, timeout=60) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                events.append(json.loads(line[6:]))
            if line == "data: [DONE]":
                events.append({"done": True})
    return events


def test_health_models_ready(cluster: Cluster) -> None:
    assert httpx.get(f"{cluster.url}/health").json() == {"status": "ok"}
    r = httpx.get(f"{cluster.url}/ready").json()
    assert r["ready"] and r["workers"] == {"prefill0": "up", "decode0": "up"}
    models = httpx.get(f"{cluster.url}/v1/models").json()
    assert models["data"][0]["id"] == "t"


def test_completion_usage_and_accept_length(cluster: Cluster) -> None:
    r = post(cluster, "/v1/completions", {"prompt": "hello", "max_tokens": 12, "temperature": 0})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "text_completion"
    assert body["choices"][0]["finish_reason"] == "length"
    assert body["usage"] == {"prompt_tokens": 5, "completion_tokens": 12, "total_tokens": 17}
    ext = body["dspark"]
    assert ext["spec_rounds"] >= 1 and ext["accept_length"] >= 1.0
    assert len(body["choices"][0]["text"]) >= 1


def test_chat_and_streaming_agree(cluster: Cluster) -> None:
    req = {
        "messages": [{"role": "user", "content": "hi there"}],
        "max_tokens": 10,
        "temperature": 0,
    }
    whole = post(cluster, "/v1/chat/completions", req).json()
    assert whole["object"] == "chat.completion"
    text = whole["choices"][0]["message"]["content"]
    events = sse(
        cluster, "/v1/chat/completions", {**req, "stream_options": {"include_usage": True}}
    )
    assert events[-1] == {"done": True}
    assert events[0]["choices"][0]["delta"]["role"] == "assistant"
    streamed = "".join(
        e["choices"][0]["delta"].get("content", "") for e in events[:-1] if e.get("choices")
    )
    assert streamed == text
    finals = [e for e in events if e.get("choices") and e["choices"][0]["finish_reason"]]
    assert finals[0]["choices"][0]["finish_reason"] == "length" and "dspark" in finals[0]
    assert events[-2]["usage"]["completion_tokens"] == 10


def test_continuous_usage_counts_tokens_chunk_by_chunk(cluster: Cluster) -> None:
    """stream_options.continuous_usage_stats (vLLM's and SGLang's spelling): every chunk carries
    the tokens generated so far, non-decreasing, ending at max_tokens; without it only the
    closing usage chunk has usage."""
    req = {"prompt": "count with me", "max_tokens": 24, "temperature": 0}
    opts = {"include_usage": True, "continuous_usage_stats": True}
    events = sse(cluster, "/v1/completions", {**req, "stream_options": opts})[:-1]
    content = [e for e in events if e.get("choices")]
    counts = [e["usage"]["completion_tokens"] for e in content]
    assert all(e["usage"]["prompt_tokens"] == content[0]["usage"]["prompt_tokens"] for e in content)
    assert counts == sorted(counts) and counts[-1] == 24 and counts[0] >= 1
    assert events[-1]["usage"]["completion_tokens"] == 24 and not events[-1]["choices"]
    plain = sse(cluster, "/v1/completions", {**req, "stream_options": {"include_usage": True}})
    assert sum("usage" in e for e in plain[:-1]) == 1


def test_stop_strings_cut_and_never_leak_in_streams(cluster: Cluster) -> None:
    base = {"prompt": "abc", "max_tokens": 60, "temperature": 0}
    full = post(cluster, "/v1/completions", base).json()["choices"][0]["text"]
    stop = full[7:9]  # a two-character stop that first occurs at or before index 7
    cut = full[: full.find(stop)]
    r = post(cluster, "/v1/completions", {**base, "stop": [stop]}).json()
    assert r["choices"][0]["text"] == cut and r["choices"][0]["finish_reason"] == "stop"
    events = sse(cluster, "/v1/completions", {**base, "stop": stop})
    assert "".join(e["choices"][0]["text"] for e in events[:-1]) == cut


@pytest.mark.parametrize(
    ("path", "body", "needle"),
    [
        ("/v1/completions", {"prompt": "hi", "n": 2}, "n=2"),
        ("/v1/completions", {"prompt": "hi", "max_tokens": -1}, "max_tokens"),
        ("/v1/completions", {"prompt": "hi", "max_tokens": 10**9}, "context length"),
        ("/v1/completions", {"prompt": "hi", "max_tokens": "9"}, "max_tokens"),
        ("/v1/completions", {"prompt": ""}, "empty"),
        ("/v1/completions", {"prompt": "x" * 5000}, "context length"),
        ("/v1/completions", {"prompt": "hi", "stop": [""]}, "stop"),
        ("/v1/completions", {"prompt": "hi", "stop": 3}, "stop"),
        ("/v1/completions", {"prompt": "hi", "bogus": 1}, "bogus"),
        ("/v1/completions", {"prompt": [1, 2, 999]}, "token ids"),
        ("/v1/completions", {"prompt": "hi", "temperature": -1}, "temperature"),
        ("/v1/completions", {"prompt": "hi", "model": "other"}, "not found"),
        ("/v1/chat/completions", {"messages": []}, "empty"),
        ("/v1/chat/completions", {"messages": [{"role": "robot", "content": "x"}]}, "role"),
    ],
)
def test_bad_input_is_a_clear_4xx(cluster: Cluster, path: str, body: dict, needle: str) -> None:
    r = post(cluster, path, body)
    assert 400 <= r.status_code < 500, r.text
    assert needle in r.json()["error"]["message"]


def test_invalid_json_is_400(cluster: Cluster) -> None:
    r = httpx.post(
        f"{cluster.url}/v1/completions",
        content=b"{\xff",
        timeout=10,
        headers={"content-type": "application/json"},
    )
    assert r.status_code == 400


def test_concurrency_32_mixed_lengths(cluster: Cluster) -> None:
    async def one(client: httpx.AsyncClient, i: int) -> tuple[int, dict]:
        body = {
            "prompt": "q" * (1 + i * 7 % 50),
            "max_tokens": 1 + i * 5 % 40,
            "temperature": 0.8 if i % 2 else 0.0,
            "seed": i,
            "stream": i % 3 == 0,
        }
        if body["stream"]:
            text = []
            async with client.stream("POST", "/v1/completions", json=body) as r:
                async for line in r.aiter_lines():
                    if line.startswith("data: {"):
                        ev = json.loads(line[6:])
                        text.append(ev["choices"][0]["text"])
                        if ev["choices"][0]["finish_reason"]:
                            last = ev
            return i, {"n": last["dspark"], "status": r.status_code}
        r = await client.post("/v1/completions", json=body)
        return i, {"usage": r.json()["usage"], "status": r.status_code}

    async def main() -> list[tuple[int, dict]]:
        async with httpx.AsyncClient(base_url=cluster.url, timeout=120) as client:
            return await asyncio.gather(*(one(client, i) for i in range(32)))

    results = asyncio.run(main())
    assert all(r["status"] == 200 for _, r in results)
    for i, r in results:
        if "usage" in r:
            assert r["usage"]["completion_tokens"] == 1 + i * 5 % 40


def test_real_openai_client(cluster: Cluster) -> None:
    client = openai.OpenAI(base_url=f"{cluster.url}/v1", api_key="unused", max_retries=0)
    assert [m.id for m in client.models.list()] == ["t"]
    c = client.completions.create(model="t", prompt="hello", max_tokens=8, temperature=0)
    assert c.usage.completion_tokens == 8 and c.choices[0].finish_reason == "length"
    chat = client.chat.completions.create(
        model="t", messages=[{"role": "user", "content": "hi"}], max_tokens=6, temperature=0
    )
    assert chat.choices[0].message.role == "assistant"
    stream = client.chat.completions.create(
        model="t",
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=6,
        temperature=0,
        stream=True,
    )
    text = "".join(ch.choices[0].delta.content or "" for ch in stream if ch.choices)
    assert text == chat.choices[0].message.content
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model="t", prompt="hi", n=3)


def test_greedy_pd_equals_single_process_engine(
    cluster: Cluster, model_pair: tuple[Path, Path]
) -> None:
    target, drafter = model_pair
    prompts = ["hello world", "abc", "The quick brown fox", "z" * 40]
    llm = LLM(str(target), draft_model=str(drafter))
    want = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=24))
    for p, w in zip(prompts, want, strict=True):
        r = post(cluster, "/v1/completions", {"prompt": p, "max_tokens": 24, "temperature": 0})
        assert r.json()["choices"][0]["text"] == w.text
    # Seeded sampling continues the same random stream across the handoff too.
    sp = SamplingParams(temperature=0.9, seed=7, max_tokens=24)
    w = llm.generate(["seeded"], sp)[0]
    body = {"prompt": "seeded", "max_tokens": 24, "temperature": 0.9, "seed": 7}
    assert post(cluster, "/v1/completions", body).json()["choices"][0]["text"] == w.text


def _pool_full(c: Cluster) -> bool:
    mt = c.metrics()
    return (
        all(
            mt[f'dspark_kv_pool_free_blocks{{worker="{w}"}}']
            == mt[f'dspark_kv_pool_blocks{{worker="{w}"}}']
            and mt[f'dspark_running_requests{{worker="{w}"}}'] == 0
            for w in ("prefill0", "decode0")
        )
        and mt["dspark_inflight_requests"] == 0
    )


def test_client_disconnect_frees_kv(cluster: Cluster) -> None:
    body = {"prompt": "long", "max_tokens": 3000, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{cluster.url}/v1/completions", json=body, timeout=60) as r:
        lines = r.iter_lines()
        while not next(lines).startswith("data: {"):
            pass
        deadline = time.monotonic() + 5
        while cluster.metrics()['dspark_running_requests{worker="decode0"}'] != 1:
            assert time.monotonic() < deadline, "the stream never showed up as running"
            time.sleep(0.1)
    # (the stream closes here, mid-generation)
    deadline = time.monotonic() + 10
    while not _pool_full(cluster):
        assert time.monotonic() < deadline, "KV not freed 10 s after the client left"
        time.sleep(0.2)
    # A non-streaming client that gives up frees its KV too.
    with pytest.raises(httpx.ReadTimeout):
        post(cluster, "/v1/completions", {**body, "stream": False}, timeout=1.0)
    deadline = time.monotonic() + 10
    while not _pool_full(cluster):
        assert time.monotonic() < deadline, "KV not freed after a non-streaming disconnect"
        time.sleep(0.2)


def test_default_lagged_scheduler_serves_greedy_identically(model_pair: tuple[Path, Path]) -> None:
    """The serving default (lagged top-K with a start-up capacity profile) stays lossless:
    greedy text over PD equals plain (non-speculative) decoding of the same target. With
    --step-log each worker writes its steps as JSON lines, and the decode worker's account for
    every token it committed."""
    target, _ = model_pair
    prompts = ["hello world", "The quick brown fox"]
    want = LLM(str(target)).generate(prompts, SamplingParams(temperature=0.0, max_tokens=24))
    logs = Path(tempfile.mkdtemp(prefix="dsp-steps"))
    extra = ("--schedule-mode", "lagged", "--startup-profile-seconds", "2")
    c = Cluster(model_pair, extra=(*extra, "--step-log", str(logs / "new")))
    try:
        c.start_all()
        for p, w in zip(prompts, want, strict=True):
            r = post(c, "/v1/completions", {"prompt": p, "max_tokens": 24, "temperature": 0})
            assert r.json()["choices"][0]["text"] == w.text
        # the first token of each request comes from the prefill worker, the other 23 from
        # decode steps that each commit one token per row plus the row's accepted drafts
        deadline, recs, pre = time.monotonic() + 10, [], []
        while time.monotonic() < deadline:  # each worker flushes its lines at its heartbeat
            recs = _read_steps(logs / "new" / "decode0.steps.jsonl")
            pre = _read_steps(logs / "new" / "prefill0.steps.jsonl")
            done = sum(r["num_decode_reqs"] + r["num_accepted"] for r in recs) >= 46
            if done and sum(r["num_prefill_tokens"] for r in pre) > 0:
                break
            time.sleep(0.1)
        assert sum(r["num_decode_reqs"] + r["num_accepted"] for r in recs) == 2 * 23
        planned = [r for r in recs if r["verify_budget_k"] >= 0]
        assert planned and all(r["predicted_seconds"] > 0 for r in planned)
        assert all(r["step_seconds"] > 0 and r["num_prefill_tokens"] == 0 for r in recs)
        assert sum(r["num_prefill_tokens"] for r in pre) > 0
        # GET /capacity: the decode worker's live model, a profile --capacity-profile loads
        cap = httpx.get(f"{c.url}/capacity", timeout=10).json()["workers"]
        assert list(cap) == ["decode0"] and cap["decode0"]["observed"] >= 0
        state = cap["decode0"]["planner"]  # and what its planner learned
        assert state["mode"] == "lagged" and len(state["prior_rates"]) == len(
            state["survival_ratios"]
        )
        text = httpx.get(f"{c.url}/capacity?format=profile", timeout=10).text
        (logs / "live.yaml").write_text(text)
        assert load_profile(logs / "live.yaml").gamma == cap["decode0"]["profile"]["gamma"]
    finally:
        c.stop()
        shutil.rmtree(logs, ignore_errors=True)


def _read_steps(path: Path) -> list[dict]:
    if not path.is_file():
        return []
    lines = path.read_bytes().split(b"\n")
    return [json.loads(x) for x in lines[:-1]]  # a last line without its newline is unwritten


def test_a_step_log_folder_that_cannot_be_made_is_a_clear_error(
    model_pair: tuple[Path, Path], tmp_path: Path
) -> None:
    """--step-log under a regular file: the decode worker exits naming the flag."""
    blocker = tmp_path / "file"
    blocker.write_text("")
    c = Cluster(model_pair, extra=("--step-log", str(blocker / "sub")))
    try:
        p = c.start("decode", 0)
        assert p.wait(120) != 0
        assert "--step-log" in c.log("decode0")
    finally:
        c.stop()


def test_bench_serving_reads_exact_per_run_counters(cluster: Cluster) -> None:
    """bench.serving's server-side signals are the workers' counters over the run alone: the
    rounds and accepted drafts the decode worker counted equal the sums the run's responses
    report per request, exactly, with earlier traffic (this module's other tests, a request
    just before, the warm-up) left out and the run's last steps in."""
    from dspark_sglang.bench import serving

    post(cluster, "/v1/completions", {"prompt": "before", "max_tokens": 30, "temperature": 0})
    argv = ["--base-url", cluster.url, "--num-prompts", "6", "--max-concurrency", "2",
            "--output-len", "20", "--ignore-eos", "--disable-tqdm",
            "--metrics-interval", "0.05"]  # fmt: skip
    rec = serving.run(serving.parse_args(argv))
    assert rec["completed"] == 6 and rec["server_counts"] == "run"
    run = rec["server_run_counts"]
    assert run["rounds"] == rec["spec_rounds"] > 0
    assert run["accepted_drafts"] == rec["spec_accepted_drafts"]
    # a round commits its accepted drafts and one token of the target's (EOS ignored)
    assert run["committed_tokens"] == run["rounds"] + run["accepted_drafts"]
    assert rec["server_accept_length"] == pytest.approx(run["committed_tokens"] / run["rounds"])
    acc = rec["per_position_acceptance"]
    assert acc and all(a is None or 0.0 <= a <= 1.0 for a in acc)
    # verify-all: every round verifies the drafter's gamma drafts (fewer near max_tokens)
    assert 1.0 < rec["verify_tokens_per_request"] <= 1 + len(acc)


def _children(pid: int) -> dict[str, int]:
    """Child processes of `pid` by the serve.launch role in their command line."""
    out = {}
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            ppid = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
            argv = (d / "cmdline").read_bytes().split(b"\0")
        except (OSError, IndexError, ValueError):
            continue
        if ppid == pid and b"dspark_sglang.serve.launch" in argv:
            out[argv[argv.index(b"dspark_sglang.serve.launch") + 1].decode()] = int(d.name)
    return out


@pytest.mark.skipif(not hasattr(os, "sched_getaffinity"), reason="CPU affinity is a Linux call")
def test_role_all_pins_the_router_and_workers(model_pair: tuple[Path, Path]) -> None:
    """--role all with --router-cpus and --decode-cpus: the router (the launcher) and the decode
    worker run on their own CPUs; the prefill worker, given none, keeps the launcher's CPUs, not
    the router's; and the deployment serves."""
    have = sorted(os.sched_getaffinity(0))
    router, decode = have[0], have[-1]
    c = Cluster(model_pair, extra=("--router-cpus", str(router), "--decode-cpus", str(decode)))
    try:
        launcher = c.start("all")
        c.wait_ready(workers=("prefill0", "decode0"))
        kids = _children(launcher.pid)
        assert set(kids) == {"prefill", "decode"}, kids
        assert os.sched_getaffinity(launcher.pid) == {router}
        assert os.sched_getaffinity(kids["decode"]) == {decode}
        assert os.sched_getaffinity(kids["prefill"]) == set(have)
        r = post(c, "/v1/completions", {"prompt": "hello", "max_tokens": 4, "temperature": 0})
        assert r.json()["usage"]["completion_tokens"] == 4
    finally:
        c.stop()
