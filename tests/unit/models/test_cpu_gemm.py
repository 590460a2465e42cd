"""oneDNN-packed fp32 products: the row grid, the crossover, the same outputs as nn.Linear and the
MoE experts, what pack_model converts, and what `auto` measures and packs."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn
from torch.nn import functional as F

from dspark_sglang.config import ConfigError, ModelConfig
from dspark_sglang.models import cpu_gemm
from dspark_sglang.models.cpu_gemm import (
    PackedLinear,
    PackedWeight,
    crossover_rows,
    gemm_mode,
    grid_rows,
    grid_sizes,
    onednn_rows,
    pack_model,
    packed_share,
    row_tiers,
)
from dspark_sglang.models.moe import SparseMoeBlock
from dspark_sglang.models.row_buckets import RowBucketedLinear, bucket_linears
from tests.conftest import moe_arch


def test_this_torch_has_the_packed_linear() -> None:
    # the CPU wheels torch ships for x86 carry oneDNN; without it `onednn` is a clear error
    assert cpu_gemm.available()


def test_the_grid_pads_by_less_than_half_and_is_small() -> None:
    sizes = {grid_rows(m) for m in range(1, 4097)}
    assert sorted(sizes)[:8] == [1, 2, 3, 4, 6, 8, 12, 16] and max(sizes) == 4096
    assert len(sizes) == 24  # 1, 2, then 3, 4, 6, 8, ...: two per octave
    for m in range(1, 4097):
        g = grid_rows(m)
        assert m <= g < 1.5 * m and grid_rows(g) == g
    assert grid_sizes(5, 20) == [6, 8, 12, 16, 24]
    assert grid_sizes(1, 4) == [1, 2, 3, 4]


def test_row_tiers_are_the_sizes_packed_products_execute() -> None:
    """The capacity model's buckets: a B-token forward is priced at the smallest tier >= B, which
    is B itself up to EXACT_TIER_ROWS and the grid size a packed product pads B to above."""
    from dspark_sglang.algo.capacity import executed_tokens

    tiers = row_tiers(2048)
    assert tiers[:10] == (1, 2, 3, 4, 5, 6, 7, 8, 12, 16) and tiers[-1] == 2048
    for m in range(1, 2049):
        want = m if m <= cpu_gemm.EXACT_TIER_ROWS else grid_rows(m)
        assert int(executed_tokens(tiers, m)) == want
    assert row_tiers(6) == (1, 2, 3, 4, 5, 6)
    assert row_tiers(100) == (1, 2, 3, 4, 5, 6, 7, 8, 12, 16, 24, 32, 48, 64, 96, 128)


def test_the_crossover_falls_as_the_weight_widens() -> None:
    # the measured crossovers (module doc): LM head from two rows, narrow projections from 8-16
    assert crossover_rows(256, 4096) == 2
    assert crossover_rows(768, 256) == 3
    assert crossover_rows(256, 512) == 4
    assert crossover_rows(256, 256) == 8
    assert crossover_rows(256, 128) == 16
    assert crossover_rows(8, 8) == 16


@settings(max_examples=40, deadline=None)
@given(
    k=st.sampled_from([8, 64, 256]),
    n=st.sampled_from([4, 128, 4096]),
    lead=st.lists(st.integers(1, 9), min_size=1, max_size=3),
    bias=st.booleans(),
)
def test_a_packed_linear_equals_the_linear(k: int, n: int, lead: list[int], bias: bool) -> None:
    g = torch.Generator().manual_seed(k * n + len(lead))
    lin = nn.Linear(k, n, bias=bias)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(n, k, generator=g) / k**0.5)
        x = torch.randn(*lead, k, generator=g)
        want = lin(x)
        pack_model(lin, max_rows=64)
        assert type(lin) is PackedLinear
        got = lin(x)
    assert got.shape == want.shape
    rows = x.numel() // k
    if rows < crossover_rows(k, n) or rows > 64:  # MKL's products, bit for bit
        assert torch.equal(got, want)
    else:  # oneDNN's: the same sums in another order
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_pack_model_keeps_parameters_and_skips_what_it_does_not_own() -> None:
    net = nn.Sequential(nn.Linear(256, 512), nn.ReLU(), nn.Linear(512, 8, bias=False))
    keys = list(net.state_dict())
    low = nn.Sequential(nn.Linear(256, 4096, bias=False))
    bucket_linears(low, torch.bfloat16)  # fp32 weight, bf16 copy for >= 16 rows
    half = nn.Sequential(nn.Linear(16, 16)).to(torch.bfloat16)
    packed = pack_model(net, max_rows=128)
    assert [type(m) for m in net] == [PackedLinear, nn.ReLU, PackedLinear]
    assert list(net.state_dict()) == keys and len(packed) == 2
    assert [w.max_rows for w in packed] == [128, 128]
    (w,) = pack_model(low, max_rows=128)
    assert type(low[0]) is RowBucketedLinear and low[0].gemm is w
    assert (w.min_rows, w.max_rows) == (2, 15)  # its fp32 products only: the copy takes 16+
    x = torch.randn(3, 256)
    with torch.no_grad():
        torch.testing.assert_close(low(x), F.linear(x, low[0].weight), rtol=1e-5, atol=1e-5)
    assert pack_model(half, max_rows=128) == [] and type(half[0]) is nn.Linear


def test_packed_experts_give_the_same_moe_output() -> None:
    cfg = moe_arch()
    g = torch.Generator().manual_seed(0)
    block = SparseMoeBlock(cfg)
    with torch.no_grad():
        for p in block.parameters():
            p.copy_(torch.randn(p.shape, generator=g) / 8)
        xs = [torch.randn(t, 64, generator=g) for t in (1, 3, 17, 40)]
        want = [_moe(block, x) for x in xs]
        packed = pack_model(block, max_rows=32)
        assert len(packed) == 2 * 4 and block.experts.gemm is not None
        for x, w in zip(xs, want, strict=True):
            torch.testing.assert_close(_moe(block, x), w, rtol=1e-5, atol=1e-5)


def _moe(block: SparseMoeBlock, x: torch.Tensor) -> torch.Tensor:
    weights, experts = block.gate(x)
    return block.experts(x, experts, weights)


def test_warm_up_builds_each_grid_size_once_per_distinct_product(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    seen: list[tuple[int, int]] = []
    monkeypatch.setattr(PackedWeight, "warm_up", lambda self: seen.append((self.k, self.n)))
    net = nn.Sequential(nn.Linear(256, 512), nn.Linear(512, 256), nn.Linear(256, 512))
    cpu_gemm.warm_up(pack_model(net, max_rows=64))
    assert seen == [(256, 512), (512, 256)]  # the third shares the first's kernels


def test_gemm_mode_packs_on_the_cpu_only_and_auto_measures(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    assert gemm_mode("auto", "cpu") == "measured"
    assert gemm_mode("onednn", "cpu") == "onednn" and gemm_mode("mkl", "cpu") == "mkl"
    assert {gemm_mode(c, "cuda:0") for c in ("auto", "onednn", "mkl")} == {"none"}
    monkeypatch.setattr(cpu_gemm, "available", lambda: False)
    assert gemm_mode("auto", "cpu") == "mkl"  # a torch without oneDNN: MKL, silently
    with pytest.raises(ConfigError, match="--cpu-gemm onednn"):
        gemm_mode("onednn", "cpu")
    with pytest.raises(ConfigError, match="--cpu-gemm"):
        ModelConfig("m", cpu_gemm="blas")


def test_onednn_takes_the_run_of_probes_where_it_saved_most() -> None:
    def times(saving: list[float]) -> list[tuple[int, float, float]]:
        return [(2 << i, 1.0, 1.0 - s) for i, s in enumerate(saving)]  # rows 2, 4, 8, ...

    assert onednn_rows(times([-0.5, -0.2, -0.1, -0.05])) is None  # MKL everywhere (Zen 3)
    assert onednn_rows(times([0.02, 0.01, 0.0, -0.01])) is None  # ties are MKL's (3 % margin)
    assert onednn_rows(times([-0.5, -0.1, 0.3, 0.5])) == (8, cpu_gemm.ALL_ROWS)  # Zen 5-like
    # a clear win at few rows, ties above: the ties do not veto it, the range ends below them
    assert onednn_rows(times([0.2, 0.4, 0.3, -0.02, -0.04])) == (2, 15)
    # one near-tie inside a winning run does not split it
    assert onednn_rows(times([0.2, 0.01, 0.3, 0.3])) == (2, cpu_gemm.ALL_ROWS)
    # two runs: the larger summed saving wins
    assert onednn_rows(times([0.1, -0.5, 0.2, 0.2, -0.5])) == (8, 31)


def test_auto_times_each_shape_once_a_process_and_packs_what_it_chose(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    calls: list[tuple[int, int, int, bool]] = []

    def fake(k: int, n: int, rows: int, bias: bool) -> tuple[float, float]:
        calls.append((k, n, rows, bias))
        return 1.0, (0.5 if n == 512 and rows <= 8 else 2.0)  # oneDNN wins 256x512 at <= 8 rows

    monkeypatch.setattr(cpu_gemm, "time_product", fake)
    monkeypatch.setattr(cpu_gemm, "_measured", {})
    net = nn.Sequential(nn.Linear(256, 512, bias=False), nn.Linear(512, 256, bias=False))
    packed = pack_model(net, max_rows=64, crossover=cpu_gemm.measured_crossover)
    assert type(net[0]) is PackedLinear and type(net[1]) is nn.Linear  # MKL only: left as is
    assert [(w.min_rows, w.max_rows) for w in packed] == [(2, 15)]
    assert len(calls) == 2 * len(cpu_gemm.PROBE_ROWS)
    again = nn.Sequential(nn.Linear(256, 512, bias=False))
    pack_model(again, max_rows=64, crossover=cpu_gemm.measured_crossover)
    assert len(calls) == 2 * len(cpu_gemm.PROBE_ROWS)  # memoised: one choice per process
    assert cpu_gemm.measured_shapes() == {"256x512": [2, 15], "512x256": None}
    x = torch.randn(5, 256)
    with torch.no_grad():  # 5 rows go through oneDNN, 20 through MKL: the same products
        torch.testing.assert_close(net[0](x), F.linear(x, net[0].weight), rtol=1e-5, atol=1e-5)
        y = torch.randn(20, 256)
        assert torch.equal(net[0](y), F.linear(y, net[0].weight))
    # the row grid governs a forward only when most weights pad from few rows to the top
    assert packed_share(net, 64) == 0.0
    full = nn.Sequential(nn.Linear(256, 512), nn.Linear(512, 8))
    pack_model(full, max_rows=64)
    assert packed_share(full, 64) == 1.0


def test_time_product_times_both_paths_on_this_cpu() -> None:
    mkl, dnn = cpu_gemm.time_product(64, 128, 4, True)
    assert 0 < mkl < 0.1 and 0 < dnn < 0.1
