"""fp32 products on the CPU through oneDNN, the weights packed once (`--cpu-gemm`).

torch multiplies fp32 matrices on x86 CPUs with MKL. On the project's CPU (AMD EPYC, Zen 5;
torch 2.14.1 with MKL 2024.2 and oneDNN 3.12) MKL's sgemm ran at about 35 GFLOP/s at every size
this engine meets, and oneDNN's fp32 matmul on a weight packed for it 2-3x faster once a
product has a few rows: `[7, 256] x [256, 4096]` (the drafter's LM head at one request) 259
against 80 us, `[512, 256] x [256, 256]` 611 against 275 us; one- or two-row products of narrow
weights are faster in MKL (`[1, 256] x [256, 256]` 4 against 13 us: oneDNN's fixed cost). So a
packed linear calls oneDNN from `crossover_rows(K, N)` rows up (a fit to those timings: the
fixed cost weighs less the wider the weight) and MKL below. The two differ in summation order
only (max abs difference 4e-5 on unit-normal 256-wide products).

oneDNN builds a kernel for every row count it meets and keeps it (about 0.5 MB each here), so rows
are padded to a grid of two sizes per octave (1, 2, 3, 4, 6, 8, 12, 16, 24, ...) and `warm_up`
builds every grid size up to the engine's largest step once, at load: memory is spent then and
does not grow with traffic.

Which products oneDNN pays on depends on the CPU more than the vendor: on a Zen 3 EPYC (AVX2, no
AVX-512; 2026-12-06) MKL ran 60-90 GFLOP/s and oneDNN paid about 25 us a call, so oneDNN lost
every product of the bundled pair but the 4096-wide LM heads. `--cpu-gemm auto` therefore times
each distinct product shape both ways at load (`measured_crossover`: PROBE_ROWS, about 1 s for
the bundled pair) and packs a weight only for the rows where oneDNN saved time (`onednn_rows`);
`--cpu-gemm onednn` keeps the fitted `crossover_rows` below.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable

import torch
from torch import nn
from torch.nn import functional as F

from dspark_sglang.config import ConfigError

# Fit of the MKL / oneDNN crossover on the project's CPU: K*N * rows >= 2^19, from two rows up
# (a one-row LM-head product was faster in oneDNN alone, 58 against 63 us, but a B = 1 decode
# forward ran 6 % slower with it there than without).
_CROSSOVER_WORK = 1 << 19
_MIN_CROSSOVER, _MAX_CROSSOVER = 2, 16


def available() -> bool:
    """oneDNN's packed fp32 linear is in this torch build (a CPU build with mkldnn)."""
    if not torch.backends.mkldnn.is_available():
        return False
    try:
        w = torch.ops.mkldnn._reorder_linear_weight(torch.ones(2, 2))
        torch.ops.mkldnn._linear_pointwise(torch.ones(1, 2), w, None, "none", [], "")
    except (AttributeError, RuntimeError):
        return False
    return True


def gemm_mode(choice: str, device: str) -> str:
    """--cpu-gemm -> what multiplies the fp32 weights: "none" off the CPU, "mkl", "onednn" (the
    fitted crossovers; a clear error where this torch has no oneDNN) or "measured" (auto: the
    crossovers timed at load, MKL where this torch has no oneDNN)."""
    if not device.startswith("cpu"):
        return "none"
    if choice == "onednn":
        if not available():
            raise ConfigError("--cpu-gemm onednn: this torch build has no oneDNN packed linear")
        return "onednn"
    if choice == "auto" and available():
        return "measured"
    return "mkl"


def crossover_rows(k: int, n: int) -> int:
    """Fewest rows a product by a [n, k] weight runs in oneDNN (2 … 16)."""
    return max(_MIN_CROSSOVER, min(_MAX_CROSSOVER, math.ceil(_CROSSOVER_WORK / (k * n))))


# What `auto` times (grid sizes, so oneDNN pads none of them). It starts at two rows for the reason
# crossover_rows does: a one-row product that oneDNN wins alone still slowed the whole forward.
PROBE_ROWS = (2, 4, 8, 16, 32, 64, 128, 256)
# Each probe alternates the two paths until each has run this long (and at least MIN_PAIRS times).
_PROBE_SECONDS, _MIN_PAIRS, _MAX_PAIRS = 5e-3, 9, 60
# A probe counts as oneDNN's only when it saved more than this: a tie is noise, not a reason to
# hold a packed copy and split a product's path.
_MARGIN = 0.03

# (k, n, bias) -> the rows oneDNN takes (first, last), None = none; measured once a process, so
# every engine in it (a test's two LLMs, a server's rebuilt engine) multiplies the same way.
_measured: dict[tuple[int, int, bool], tuple[int, int] | None] = {}

ALL_ROWS = 1 << 30  # "and every row count above": a range's open end

# (k, n, bias) -> the rows oneDNN multiplies, (first, last) inclusive, or None for none
Crossover = Callable[[int, int, bool], tuple[int, int] | None]


def fitted_crossover(k: int, n: int, bias: bool) -> tuple[int, int]:
    """`--cpu-gemm onednn`: the fitted rule, whatever the CPU."""
    return crossover_rows(k, n), ALL_ROWS


def onednn_rows(times: list[tuple[int, float, float]]) -> tuple[int, int] | None:
    """(rows, MKL seconds, oneDNN seconds) by increasing rows -> the rows oneDNN should take:
    the run of consecutive probes where its relative saving (MKL - oneDNN) / MKL, less a 3 %
    margin, sums highest, from its first probe to just below the probe after it (every row above
    the last probe when the run ends there); None when no run saves anything. A run rather than
    single probes, so a near-tie at one probe does not split the range (a product in between
    takes its neighbours' path), and a sum, so a tie at the large products does not veto a clear
    win at the small."""
    best, best_span = 0.0, None
    acc, start = 0.0, 0
    for i, (_, mkl, dnn) in enumerate(times):
        if acc <= 0:
            acc, start = 0.0, i
        acc += (mkl - dnn) / mkl - _MARGIN
        if acc > best:
            best, best_span = acc, (start, i)
    if best_span is None:
        return None
    a, b = best_span
    last = times[b + 1][0] - 1 if b + 1 < len(times) else ALL_ROWS
    return times[a][0], last


def time_product(k: int, n: int, rows: int, bias: bool) -> tuple[float, float]:
    """Median seconds of `[rows, k] x [k, n]` through MKL on a column-major weight (what runs
    where oneDNN does not: models/weight_layout.py) and through oneDNN on the packed weight, the
    two alternated so a drift of the host hits both."""
    gen = torch.Generator().manual_seed(k * n + rows)
    w = torch.randn(n, k, generator=gen) / k**0.5
    col = w.t().contiguous().t()
    b = torch.randn(n, generator=gen) if bias else None
    packed = torch.ops.mkldnn._reorder_linear_weight(w)
    x = torch.randn(rows, k, generator=gen)
    mkl: list[float] = []
    dnn: list[float] = []
    with torch.no_grad():
        F.linear(x, col, b)
        torch.ops.mkldnn._linear_pointwise(x, packed, b, "none", [], "")
        while len(mkl) < _MAX_PAIRS and (
            len(mkl) < _MIN_PAIRS or min(sum(mkl), sum(dnn)) < _PROBE_SECONDS
        ):
            t0 = time.perf_counter()
            F.linear(x, col, b)
            t1 = time.perf_counter()
            torch.ops.mkldnn._linear_pointwise(x, packed, b, "none", [], "")
            t2 = time.perf_counter()
            mkl.append(t1 - t0)
            dnn.append(t2 - t1)
    return statistics.median(mkl), statistics.median(dnn)


def measured_crossover(k: int, n: int, bias: bool) -> tuple[int, int] | None:
    """`--cpu-gemm auto`: the rows oneDNN multiplies by a [n, k] weight on this CPU (None:
    none), timed at PROBE_ROWS the first time a process meets the shape."""
    key = (k, n, bias)
    if key not in _measured:
        _measured[key] = onednn_rows([(m, *time_product(k, n, m, bias)) for m in PROBE_ROWS])
    return _measured[key]


def measured_shapes() -> dict[str, list[int | None] | None]:
    """What `auto` chose in this process: "KxN" (+ "+bias") -> [first, last] rows through
    oneDNN (last None: every row above), or None for MKL only."""
    out: dict[str, list[int | None] | None] = {}
    for (k, n, b), span in sorted(_measured.items()):
        key = f"{k}x{n}" + ("+bias" if b else "")
        out[key] = None if span is None else [span[0], None if span[1] == ALL_ROWS else span[1]]
    return out


def grid_rows(m: int) -> int:
    """The row grid: 1, 2, 3, 4, 6, 8, 12, 16, … (2^k and 1.5 * 2^k) at or above m."""
    if m <= 4:
        return m
    p = 1 << (m - 1).bit_length()
    return p * 3 // 4 if m <= p * 3 // 4 else p


def grid_sizes(lo: int, hi: int) -> list[int]:
    """Every grid size from grid_rows(lo) to grid_rows(hi)."""
    out, m = [], grid_rows(max(1, lo))
    while m <= grid_rows(hi):
        out.append(m)
        m = grid_rows(m + 1)
    return out


# Below this many tokens a forward's cost grows token by token even with every product packed:
# the narrow products (the attention's k / v, the router) stay in MKL, unpadded, below 16 rows,
# and each expert a token reaches adds a call. From it up, every product pads to the grid and a
# forward costs what the grid size above it costs (in-process, R = 2: 13-16 tokens 5.8-6.0 ms
# against 3.9-5.1 for 5-8; docs/capacity.md "Row tiers").
EXACT_TIER_ROWS = 8


def row_tiers(max_rows: int) -> tuple[int, ...]:
    """The token counts a packed target forward executes at, as the capacity model's buckets:
    every count up to EXACT_TIER_ROWS, then the grid up to grid_rows(max_rows)."""
    exact = tuple(range(1, min(EXACT_TIER_ROWS, max_rows) + 1))
    if max_rows <= EXACT_TIER_ROWS:
        return exact
    return exact + tuple(grid_sizes(EXACT_TIER_ROWS + 1, max_rows))


class PackedWeight:
    """A fp32 [n, k] weight in oneDNN's layout, its bias, and the products it takes: from
    crossover_rows(k, n) to `max_rows` rows (the others go to MKL)."""

    def __init__(
        self,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        max_rows: int,
        min_rows: int | None = None,
    ) -> None:
        n, k = weight.shape
        self.k, self.n = k, n
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach())
        self.bias = None if bias is None else bias.detach()
        self.min_rows = crossover_rows(k, n) if min_rows is None else min_rows
        self.max_rows = max_rows

    def takes(self, x: torch.Tensor) -> bool:
        """Whether oneDNN multiplies x (its row count in range); checked before every product,
        so kept to one shape read: a decode step makes about 40 products of one row."""
        return self.min_rows <= x.numel() // self.k <= self.max_rows

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x @ weight.T + bias through oneDNN, for an fp32 x that `takes` admits."""
        lead = x.shape[:-1]
        flat = x.reshape(-1, self.k)
        m = flat.shape[0]
        pad = grid_rows(m) - m
        if pad:
            flat = F.pad(flat, (0, 0, 0, pad))
        out = torch.ops.mkldnn._linear_pointwise(flat, self.packed, self.bias, "none", [], "")
        return out[:m].view(*lead, self.n)

    def warm_up(self) -> None:
        """Build the kernel of every grid size this weight takes (see the module doc)."""
        for m in grid_sizes(self.min_rows, self.max_rows):
            x = torch.zeros(m, self.k)
            torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")


class PackedLinear(nn.Linear):
    """nn.Linear with a oneDNN copy of its fp32 weight; same parameters and state-dict keys.
    The copy is taken once (pack_model): the weights must not change afterwards."""

    gemm: PackedWeight | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gemm = self.gemm
        if gemm is not None and gemm.takes(x):
            return gemm(x)
        return F.linear(x, self.weight, self.bias)


def pack_model(
    module: nn.Module, max_rows: int, crossover: Crossover = fitted_crossover
) -> list[PackedWeight]:
    """Pack every fp32 product under `module` for `crossover(k, n, bias)` to `max_rows` rows: a
    plain nn.Linear becomes a PackedLinear; a RowBucketedLinear with a reduced-precision copy
    gets packed weights for the fp32 products it keeps (fewer than its min_rows); a module with
    `pack_gemm` (the MoE experts) packs its own. A weight oneDNN takes no rows of stays as it
    is. Returns them all, for warm_up."""
    out: list[PackedWeight] = []
    for m in module.modules():
        pack = getattr(m, "pack_gemm", None)
        if pack is not None:
            out += pack(max_rows, crossover)
        elif isinstance(m, nn.Linear) and m.weight.dtype == torch.float32:
            top = max_rows
            if type(m) is not nn.Linear:
                if getattr(m, "low_weight", None) is None:
                    continue
                top = min(max_rows, m.min_rows - 1)
            w = packed_weight(m.weight, m.bias, top, crossover)
            if w is None:
                continue
            if type(m) is nn.Linear:
                m.__class__ = PackedLinear
            m.gemm = w
            out.append(w)
    return out


def packed_weight(
    weight: torch.Tensor, bias: torch.Tensor | None, max_rows: int, crossover: Crossover
) -> PackedWeight | None:
    """The weight packed for the rows `crossover` gives it up to max_rows, or None when that
    is none of them."""
    n, k = weight.shape
    span = crossover(k, n, bias is not None)
    if span is None or span[0] > max_rows:
        return None
    return PackedWeight(weight, bias, min(max_rows, span[1]), span[0])


def packed_share(module: nn.Module, max_rows: int) -> float:
    """The fraction of the fp32 product weights under `module` (elements; every expert counts)
    that pad their rows to the grid from at most 16 rows up to max_rows: the runner's forward
    follows the row grid (row_tiers) when it is most of them."""

    def grid(w: PackedWeight | None) -> bool:
        return w is not None and w.min_rows <= _MAX_CROSSOVER and w.max_rows >= max_rows

    total = padded = 0
    for m in module.modules():
        gemm = getattr(m, "gemm", None)
        if hasattr(m, "pack_gemm") and m.gate_up_proj.dtype == torch.float32:
            per = (m.gate_up_proj[0].numel(), m.down_proj[0].numel())
            total += m.num_experts * sum(per)
            for pair in gemm or ():
                padded += sum(size for w, size in zip(pair, per, strict=True) if grid(w))
        elif isinstance(m, nn.Linear) and m.weight.dtype == torch.float32:
            total += m.weight.numel()
            padded += m.weight.numel() if grid(gemm) else 0
    return padded / total if total else 0.0


def warm_up(weights: list[PackedWeight]) -> None:
    """Every grid size once per distinct product (shape, bias, rows): oneDNN shares kernels."""
    seen: dict[tuple[int, int, bool, int, int], PackedWeight] = {}
    for w in weights:
        seen.setdefault((w.k, w.n, w.bias is None, w.min_rows, w.max_rows), w)
    for w in seen.values():
        w.warm_up()
