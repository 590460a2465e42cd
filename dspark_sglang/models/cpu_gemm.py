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
"""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.nn import functional as F

from dspark_sglang.config import ConfigError
from dspark_sglang.hostinfo import CPUINFO, cpu_vendor

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


def amd_cpu(cpuinfo: str = CPUINFO) -> bool:
    """An AMD CPU (MKL picks its generic code paths on non-Intel CPUs)."""
    return cpu_vendor(cpuinfo) == "AuthenticAMD"


def use_onednn(choice: str, device: str, cpuinfo: str = CPUINFO) -> bool:
    """--cpu-gemm -> pack the fp32 weights for oneDNN? Never off the CPU; `onednn` where this
    torch has it (a clear error otherwise), `auto` on AMD CPUs where it has it."""
    if not device.startswith("cpu") or choice == "mkl":
        return False
    if choice == "onednn":
        if not available():
            raise ConfigError("--cpu-gemm onednn: this torch build has no oneDNN packed linear")
        return True
    return amd_cpu(cpuinfo) and available()


def crossover_rows(k: int, n: int) -> int:
    """Fewest rows a product by a [n, k] weight runs in oneDNN (2 … 16)."""
    return max(_MIN_CROSSOVER, min(_MAX_CROSSOVER, math.ceil(_CROSSOVER_WORK / (k * n))))


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

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, max_rows: int) -> None:
        n, k = weight.shape
        self.k, self.n = k, n
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach())
        self.bias = None if bias is None else bias.detach()
        self.min_rows, self.max_rows = crossover_rows(k, n), max_rows

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


def pack_model(module: nn.Module, max_rows: int) -> list[PackedWeight]:
    """Pack every fp32 product under `module` for up to `max_rows` rows: a plain nn.Linear
    becomes a PackedLinear; a RowBucketedLinear with a reduced-precision copy gets packed weights
    for the fp32 products it keeps (fewer than its min_rows); a module with `pack_gemm` (the MoE
    experts) packs its own. Returns them all, for warm_up."""
    out: list[PackedWeight] = []
    for m in module.modules():
        pack = getattr(m, "pack_gemm", None)
        if pack is not None:
            out += pack(max_rows)
        elif isinstance(m, nn.Linear) and m.weight.dtype == torch.float32:
            if type(m) is nn.Linear:
                m.__class__ = PackedLinear
                m.gemm = PackedWeight(m.weight, m.bias, max_rows)
            elif getattr(m, "low_weight", None) is not None:
                m.gemm = PackedWeight(m.weight, m.bias, min(max_rows, m.min_rows - 1))
            else:
                continue
            out.append(m.gemm)
    return out


def warm_up(weights: list[PackedWeight]) -> None:
    """Every grid size once per distinct product (shape, bias, rows): oneDNN shares kernels."""
    seen: dict[tuple[int, int, bool, int, int], PackedWeight] = {}
    for w in weights:
        seen.setdefault((w.k, w.n, w.bias is None, w.min_rows, w.max_rows), w)
    for w in seen.values():
        w.warm_up()
