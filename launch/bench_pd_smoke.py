"""PD serving smoke benchmark: TTFT / TPOT / output tok/s at a few concurrencies, for
`launch_server --role all` (HTTP + ZMQ + KV handoff) vs the same engine in-process (no server),
plus the handoff bytes per prompt token. The full load generator is `dspark_sglang.bench.serving`.

    python launch/bench_pd_smoke.py --model-path M [--draft-model-path D] --json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx


def _summary(ttft: list[float], tpot: list[float], tokens: int, wall: float) -> dict:
    return {
        "mean_ttft_ms": 1000 * statistics.mean(ttft),
        "p50_ttft_ms": 1000 * statistics.median(ttft),
        "mean_tpot_ms": 1000 * statistics.mean(tpot) if tpot else 0.0,
        "output_throughput": tokens / wall,
    }


async def _http_load(url: str, prompts: list[list[int]], out_len: int, conc: int) -> dict:
    sem = asyncio.Semaphore(conc)
    ttft, tpot, tokens = [], [], 0

    async def one(client: httpx.AsyncClient, ids: list[int]) -> None:
        nonlocal tokens
        body = {
            "prompt": ids,
            "max_tokens": out_len,
            "temperature": 0,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        async with sem:
            t0 = time.perf_counter()
            first = None
            async with client.stream("POST", "/v1/completions", json=body) as r:
                async for line in r.aiter_lines():
                    if not line.startswith("data: {"):
                        continue
                    ev = json.loads(line[6:])
                    if first is None and ev.get("choices"):
                        first = time.perf_counter()
                    if ev.get("usage"):
                        n = ev["usage"]["completion_tokens"]
            end = time.perf_counter()
            ttft.append(first - t0)
            tokens += n
            if n > 1:
                tpot.append((end - first) / (n - 1))

    async with httpx.AsyncClient(base_url=url, timeout=600) as client:
        await one(client, prompts[0])  # warm-up
        ttft.clear(), tpot.clear()
        tokens = 0
        t0 = time.perf_counter()
        await asyncio.gather(*(one(client, p) for p in prompts))
        return _summary(ttft, tpot, tokens, time.perf_counter() - t0)


def bench_server(args: argparse.Namespace, prompts: list[list[int]]) -> dict:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [
        sys.executable,
        "-m",
        "dspark_sglang.launch_server",
        "--role",
        "all",
        "--port",
        str(port),
        "--zmq-port",
        str(port + 1),
        "--model-path",
        args.model_path,
        "--num-prefill-workers",
        str(args.num_prefill),
        "--num-decode-workers",
        str(args.num_decode),
    ]
    if args.draft_model_path:
        cmd += ["--draft-model-path", args.draft_model_path]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 180
        while True:
            try:
                if httpx.get(f"{url}/ready", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline or proc.poll() is not None:
                raise RuntimeError("server did not become ready")
            time.sleep(0.5)
        return {
            c: asyncio.run(_http_load(url, prompts, args.output_len, c)) for c in args.concurrency
        }
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(30)


def bench_engine(args: argparse.Namespace, prompts: list[list[int]]) -> dict:
    from dspark_sglang.engine.engine import LLM
    from dspark_sglang.types import SamplingParams

    llm = LLM(args.model_path, draft_model=args.draft_model_path)
    sp = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    llm.generate(prompts[:1], sp)  # warm-up
    out = {}
    for conc in args.concurrency:
        queue, live, ttft, tpot, tokens = list(prompts), {}, [], [], 0
        t0 = time.perf_counter()
        while queue or live:
            while queue and len(live) < conc:
                live[llm.add_request(queue.pop(0), sp)] = [time.perf_counter(), None]
            for o in llm.step():
                st = live[o.seq_id]
                if st[1] is None and o.output_ids:
                    st[1] = time.perf_counter()
                if o.finished:
                    end, n = time.perf_counter(), len(o.output_ids)
                    ttft.append(st[1] - st[0])
                    tpot.append((end - st[1]) / max(n - 1, 1))
                    tokens += n
                    del live[o.seq_id]
        out[conc] = _summary(ttft, tpot, tokens, time.perf_counter() - t0)
    return out


def handoff_bytes(args: argparse.Namespace, n: int) -> dict:
    from dspark_sglang.engine.engine import LLM
    from dspark_sglang.serve.kv_handoff import pack
    from dspark_sglang.serve.messages import encode
    from dspark_sglang.types import SamplingParams

    llm = LLM(args.model_path, draft_model=args.draft_model_path)
    vocab = llm.runner.arch.vocab_size
    ids = [1 + i % (vocab - 2) for i in range(n)]
    llm.add_request(ids, SamplingParams(max_tokens=8), prefill_only=True)
    h = None
    while h is None:
        h = next((o.handoff for o in llm.step() if o.handoff is not None), None)
    frames = encode(*pack(0, h, ""))
    total = sum(memoryview(f).nbytes for f in frames)
    ctx = h.draft_ctx.nelement() * h.draft_ctx.element_size() if h.draft_ctx is not None else 0
    out = {
        "prompt_tokens": n,
        "message_bytes": total,
        "bytes_per_prompt_token": total / n,
        "target_kv_per_token": h.kv.nelement() * h.kv.element_size() / n,
        "draft_ctx_per_token": ctx / n,
    }
    d = llm.runner.drafter
    if d is not None:  # what per-layer draft K/V would have cost instead of C
        c = d.cfg
        out["draft_kv_per_token_alternative"] = (
            c.num_layers * 2 * c.num_key_value_heads * c.head_dim * h.kv.element_size()
        )
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model-path", required=True)
    p.add_argument("--draft-model-path")
    p.add_argument("--num-prompts", type=int, default=32)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 16])
    p.add_argument("--num-prefill", type=int, default=1)
    p.add_argument("--num-decode", type=int, default=1)
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch

    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    vocab = json.loads((Path(args.model_path) / "config.json").read_text())["vocab_size"]
    rng = random.Random(0)
    prompts = [
        [rng.randrange(1, vocab - 2) for _ in range(args.input_len)]
        for _ in range(args.num_prompts)
    ]
    res = {
        "handoff": handoff_bytes(args, args.input_len),
        "engine_in_process": bench_engine(args, prompts),
        "pd_role_all": bench_server(args, prompts),
    }
    if args.json:
        print(json.dumps(res))
        return
    print(json.dumps(res["handoff"], indent=1))
    print(f"{'mode':20} {'c':>3} {'TTFT ms':>9} {'TPOT ms':>9} {'tok/s':>8}")
    for mode in ("engine_in_process", "pd_role_all"):
        for c, r in res[mode].items():
            print(
                f"{mode:20} {c:>3} {r['mean_ttft_ms']:9.1f} {r['mean_tpot_ms']:9.2f} "
                f"{r['output_throughput']:8.1f}"
            )


if __name__ == "__main__":
    main()
