"""oneDNN-packed fp32 products: the row grid, the crossover, the same outputs as nn.Linear and the
MoE experts, what pack_model converts, and which CPUs `auto` packs on."""

from __future__ import annotations

from pathlib import Path

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
    grid_rows,
    grid_sizes,
    pack_model,
    row_tiers,
    use_onednn,
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


def test_auto_packs_on_amd_cpus_only(tmp_path: Path) -> None:
    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nvendor_id\t: AuthenticAMD\n")
    assert use_onednn("auto", "cpu", str(info))
    assert not use_onednn("auto", "cuda:0", str(info))
    assert not use_onednn("mkl", "cpu", str(info))
    info.write_text("processor\t: 0\nvendor_id\t: GenuineIntel\n")
    assert not use_onednn("auto", "cpu", str(info))
    assert use_onednn("onednn", "cpu", str(info))
    assert not use_onednn("auto", "cpu", str(tmp_path / "absent"))
    with pytest.raises(ConfigError, match="--cpu-gemm"):
        ModelConfig("m", cpu_gemm="blas")
