"""`python -m dspark_sglang.bench.gemm`: fp32 products through MKL and through packed oneDNN.

Times `[M, K] x [K, N]` for the weight shapes of the bundled target and drafter (or `--shapes`)
at several row counts M three ways, on one thread by default: MKL on the checkpoint's row-major
[N, K] weight, MKL on the same weight stored column-major (what `--cpu-gemm mkl` runs:
models/weight_layout.py), and packed oneDNN. It prints the medians and the ratios, with the row
count from which `--cpu-gemm onednn` sends a product to oneDNN
(models/cpu_gemm.crossover_rows) and the rows `--cpu-gemm auto` would give oneDNN from these
timings (models/cpu_gemm.onednn_rows; the engine times its own probes at load). `--cold` cycles
through enough copies of each weight to overflow the last-level cache, as a model larger than
it does.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable

import torch
from torch.nn import functional as F

from dspark_sglang.models import cpu_gemm

# (K, N): attention q/o, k/v, expert gate_up / MLP gate, MLP down, drafter fc, LM head, Markov
BUNDLED_SHAPES = "256x256,256x128,256x512,512x256,768x256,256x4096,64x4096"


def _median_us(fn: Callable[[], object], repeats: int) -> float:
    for _ in range(3):
        fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return 1e6 * statistics.median(times)


def measure(k: int, n: int, m: int, repeats: int, cold: bool) -> dict[str, float | int]:
    copies = max(1, (64 << 20) // (4 * k * n)) if cold else 1
    gen = torch.Generator().manual_seed(k * n)
    ws = [torch.randn(n, k, generator=gen) / k**0.5 for _ in range(copies)]
    cols = [w.t().contiguous().t() for w in ws]  # the same [N, K] values, column-major
    packed = [torch.ops.mkldnn._reorder_linear_weight(w) for w in ws]
    x = torch.randn(m, k, generator=gen)
    i = [0]

    def mkl() -> object:
        i[0] = (i[0] + 1) % copies
        return F.linear(x, ws[i[0]])

    def mkl_col() -> object:
        i[0] = (i[0] + 1) % copies
        return F.linear(x, cols[i[0]])

    def onednn() -> object:
        i[0] = (i[0] + 1) % copies
        return torch.ops.mkldnn._linear_pointwise(x, packed[i[0]], None, "none", [], "")

    a, c, b = _median_us(mkl, repeats), _median_us(mkl_col, repeats), _median_us(onednn, repeats)
    return {
        "k": k,
        "n": n,
        "rows": m,
        "mkl_us": a,
        "mkl_col_us": c,
        "onednn_us": b,
        "speedup": a / b,  # oneDNN over row-major MKL
        "col_speedup": a / c,  # column-major over row-major MKL
        "onednn_over_col": c / b,  # oneDNN over what --cpu-gemm mkl runs
    }


def parse_shapes(text: str) -> list[tuple[int, int]]:
    out = []
    for item in text.split(","):
        k, sep, n = item.partition("x")
        if not sep or not k.isdigit() or not n.isdigit() or int(k) <= 0 or int(n) <= 0:
            raise SystemExit(f"error: --shapes: expected KxN items like 256x512, got {item!r}")
        out.append((int(k), int(n)))
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m dspark_sglang.bench.gemm",
        description=__doc__,
        epilog="text output: MKL row-major / MKL column-major / oneDNN, median us per product",
    )
    ap.add_argument("--shapes", default=BUNDLED_SHAPES, help="KxN weight shapes, comma-separated")
    ap.add_argument("--rows", default="1,2,4,8,16,64,512", help="row counts M, comma-separated")
    ap.add_argument("--repeats", type=int, default=200)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--cold", action="store_true", help="weights out of the last-level cache")
    ap.add_argument("--json", action="store_true", help="one JSON line per measurement")
    args = ap.parse_args(argv)
    shapes = parse_shapes(args.shapes)
    try:
        rows = [int(r) for r in args.rows.split(",")]
    except ValueError:
        raise SystemExit(f"error: --rows: expected integers, got {args.rows!r}") from None
    if min(rows) <= 0 or args.repeats <= 0 or args.threads <= 0:
        raise SystemExit("error: --rows, --repeats and --threads must be positive")
    if not cpu_gemm.available():
        raise SystemExit("error: this torch build has no oneDNN packed linear")
    torch.set_num_threads(args.threads)
    for k, n in shapes:
        cells = [measure(k, n, m, args.repeats, args.cold) for m in rows]
        if args.json:
            for c in cells:
                print(json.dumps(c))
            continue
        cross = cpu_gemm.crossover_rows(k, n)
        span = cpu_gemm.onednn_rows([(c["rows"], c["mkl_col_us"], c["onednn_us"]) for c in cells])
        auto = (
            "none"
            if span is None
            else f"{span[0]}+"
            if span[1] == cpu_gemm.ALL_ROWS
            else f"{span[0]}-{span[1]}"
        )
        line = "  ".join(
            f"M={c['rows']}: {c['mkl_us']:.0f}/{c['mkl_col_us']:.0f}/{c['onednn_us']:.0f} us"
            for c in cells
        )
        print(
            f"[M, {k}] x [{k}, {n}] (onednn: from {cross} rows; auto: {auto})  {line}", flush=True
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
