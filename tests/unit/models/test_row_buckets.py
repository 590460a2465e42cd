"""Row-bucketed linears: the grid, the same outputs as nn.Linear, a bounded set of row counts."""

from __future__ import annotations

import torch
from torch import nn

from dspark_sglang.models.row_buckets import RowBucketedLinear, bucket_linears, bucket_rows


def test_the_grid_pads_by_less_than_half_and_is_small() -> None:
    sizes = {bucket_rows(m) for m in range(1, 8193)}
    assert min(sizes) == 16 and max(sizes) == 8192
    assert len(sizes) == 19  # 16, 24, ..., 8192: two per octave
    for m in range(1, 8193):
        b = bucket_rows(m)
        assert b >= m and bucket_rows(b) == b
        assert m <= 16 or b < 1.5 * m  # under 50 % padding above the floor


def test_bucketed_linear_equals_linear_and_keeps_its_parameters() -> None:
    g = torch.Generator().manual_seed(0)
    net = nn.Sequential(nn.Linear(12, 20), nn.ReLU(), nn.Linear(20, 7, bias=False))
    keys = list(net.state_dict())
    want = {}
    xs = [torch.randn(*shape, 12, generator=g) for shape in ((1,), (3, 5), (2, 9, 4), (37,))]
    with torch.no_grad():
        for i, x in enumerate(xs):
            want[i] = net(x)
        bucket_linears(net)
        assert [type(m) for m in net] == [RowBucketedLinear, nn.ReLU, RowBucketedLinear]
        assert list(net.state_dict()) == keys
        for i, x in enumerate(xs):
            got = net(x)
            assert got.shape == want[i].shape
            torch.testing.assert_close(got, want[i])


def test_bucketed_linear_only_ever_multiplies_grid_row_counts(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    import dspark_sglang.models.row_buckets as rb

    seen: list[int] = []
    real = rb.F.linear

    def spy(x, w, b=None):  # type: ignore[no-untyped-def]
        seen.append(x.shape[0])
        return real(x, w, b)

    monkeypatch.setattr(rb.F, "linear", spy)
    lin = nn.Linear(8, 8)
    bucket_linears(lin)
    with torch.no_grad():
        for m in range(1, 300):
            lin(torch.randn(m, 8))
    assert len(set(seen)) == len({bucket_rows(m) for m in range(1, 300)}) == 10


def test_a_low_precision_copy_serves_only_products_of_min_rows_or_more() -> None:
    g = torch.Generator().manual_seed(1)
    lin = nn.Linear(64, 96)
    ref = nn.Linear(64, 96)
    ref.load_state_dict(lin.state_dict())
    bucket_linears(lin, torch.bfloat16, min_rows=16)
    assert lin.weight.dtype == torch.float32 and lin.low_weight.dtype == torch.bfloat16
    with torch.no_grad():
        small = torch.randn(3, 5, 64, generator=g)  # 15 rows: the fp32 weight, exactly
        assert torch.equal(lin(small), ref(small))
        big = torch.randn(4, 5, 64, generator=g)  # 20 rows: the bf16 copy, output back in fp32
        got = lin(big)
        assert got.dtype == torch.float32 and not torch.equal(got, ref(big))
        torch.testing.assert_close(got, ref(big), atol=5e-2, rtol=5e-2)
