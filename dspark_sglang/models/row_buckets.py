"""Linear layers that pad their row count to a fixed grid (CPU, reduced precision).

oneDNN compiles a bf16/fp16 GEMM kernel for every row count it meets and keeps it for the life of
the process: about 0.5 MB each on the project's CPU, with or without its primitive cache
(580 distinct row counts through one bf16 linear grew the RSS by 395 MB; fp32 products, which
take another path, by 4 MB). A drafter sees a new row count with every batch size and every
context flush, so its linears pad the rows up to a grid of at most two sizes per octave
(padding below 50 %, about 20 % on average) and the kernels stay a bounded set.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

MIN_ROWS = 16


def bucket_rows(m: int) -> int:
    """The grid: 16, 24, 32, 48, 64, 96, 128, 192, ... (2^k and 1.5 * 2^k, at least 16)."""
    if m <= MIN_ROWS:
        return MIN_ROWS
    p = 1 << (m - 1).bit_length()  # the power of two at or above m
    return p * 3 // 4 if m <= p * 3 // 4 else p


class RowBucketedLinear(nn.Linear):
    """nn.Linear whose input rows (all leading dims flattened) are zero-padded to bucket_rows;
    the padded rows' outputs are dropped. Same parameters and state-dict keys as nn.Linear."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead, k = x.shape[:-1], x.shape[-1]
        flat = x.reshape(-1, k)
        m = flat.shape[0]
        pad = bucket_rows(m) - m
        if pad:
            flat = F.pad(flat, (0, 0, 0, pad))
        return F.linear(flat, self.weight, self.bias)[:m].view(*lead, -1)


def bucket_linears(module: nn.Module) -> None:
    """Make every nn.Linear under `module` a RowBucketedLinear, in place (parameters kept)."""
    for m in module.modules():
        if type(m) is nn.Linear:
            m.__class__ = RowBucketedLinear
