"""Linear layers for reduced-precision products on the CPU: rows padded to a fixed grid.

oneDNN compiles a bf16/fp16 GEMM kernel for every row count it meets and keeps it for the life of
the process: about 0.5 MB each on the project's CPU, with or without its primitive cache
(580 distinct row counts through one bf16 linear grew the RSS by 395 MB; fp32 products, which
take another path, by 4 MB). A drafter meets a new row count with every batch size and every
context flush, so these linears pad the rows up to a grid of at most two sizes per octave
(padding below 50 %, about 20 % on average) and the kernels stay a bounded set.

Two uses (engine/runner.py): a drafter whose weights are bf16/fp16 (every product bucketed),
and an fp32 drafter that multiplies by a bf16 copy of each weight only where the batch is large
enough for bf16 to pay (`min_rows`), keeping fp32 for the few-row products of low load.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn
from torch.nn import functional as F

if TYPE_CHECKING:
    from dspark_sglang.models.cpu_gemm import PackedWeight

MIN_ROWS = 16


def bucket_rows(m: int) -> int:
    """The grid: 16, 24, 32, 48, 64, 96, 128, 192, ... (2^k and 1.5 * 2^k, at least 16)."""
    if m <= MIN_ROWS:
        return MIN_ROWS
    p = 1 << (m - 1).bit_length()  # the power of two at or above m
    return p * 3 // 4 if m <= p * 3 // 4 else p


class RowBucketedLinear(nn.Linear):
    """nn.Linear whose input rows (all leading dims flattened) are zero-padded to bucket_rows;
    the padded rows' outputs are dropped. Same parameters and state-dict keys as nn.Linear.

    With `low_weight` set (a copy of the weight in a lower precision, not a parameter), products
    of fewer than `min_rows` rows use the module's own weight unpadded, the others the copy, the
    input cast to it and the output cast back."""

    low_weight: torch.Tensor | None = None
    low_bias: torch.Tensor | None = None
    min_rows: int = 0
    # fp32 few-row products through oneDNN (models/cpu_gemm.py: pack_model), when packed
    gemm: PackedWeight | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead, k = x.shape[:-1], x.shape[-1]
        flat = x.reshape(-1, k)
        m = flat.shape[0]
        weight, bias = self.weight, self.bias
        if self.low_weight is not None:
            if m < self.min_rows:
                if self.gemm is not None and self.gemm.takes(x):
                    return self.gemm(x)
                return F.linear(x, weight, bias)
            weight, bias = self.low_weight, self.low_bias
            flat = flat.to(weight.dtype)
        pad = bucket_rows(m) - m
        if pad:
            flat = F.pad(flat, (0, 0, 0, pad))
        return F.linear(flat, weight, bias)[:m].to(x.dtype).view(*lead, -1)


def bucket_linears(
    module: nn.Module, low_dtype: torch.dtype | None = None, min_rows: int = MIN_ROWS
) -> None:
    """Make every nn.Linear under `module` a RowBucketedLinear, in place (parameters kept).
    `low_dtype`: keep the weights, and multiply products of `min_rows` rows or more by a copy
    in this dtype instead."""
    for m in module.modules():
        if type(m) is nn.Linear:
            m.__class__ = RowBucketedLinear
            if low_dtype is not None:
                m.low_weight = m.weight.detach().to(low_dtype)
                m.low_bias = None if m.bias is None else m.bias.detach().to(low_dtype)
                m.min_rows = min_rows
