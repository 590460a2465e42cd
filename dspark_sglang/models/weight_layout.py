"""fp32 weights laid out column-major on the CPU: every product reads W^T as a plain row-major
matrix.

F.linear(x, W) with W [out, in] row-major is MKL's x·Bᵀ case; with W stored column-major (the
same logical tensor, strides (1, out)) it is the x·B case, which MKL runs faster for a few to a
few hundred rows. On the 2-core VM, one thread, fp32, weights cycled so they come from L3 (scratch
benchmark, medians): [4096, 256] (the LM head) at 8 rows 459 -> 201 us, 64 rows 986 -> 700;
[256, 256] at 8 rows 13.1 -> 9.8, 64 rows 51 -> 41; [1024, 256] at 8 rows 69 -> 48; at 1 row and
at 448+ rows within 3 % either way. The experts' fused [E, 2I, H] weights get the same layout:
an MoE layer of the bundled target (8 experts, top-2, one product per busy expert) at 32 tokens
757 -> 643 us, 64 1,023 -> 841, 448 3,499 -> 2,886, 2,048 13.3 -> 12.6 ms; 3-4 % slower at
4-12 tokens, within 1 % at 1-2.

Only the layout changes: shapes, names and values stay, so checkpoints and state dicts do not
see it. A tied LM head gets its own copy (the embedding keeps row-major rows for its lookups).
"""

from __future__ import annotations

import torch
from torch import nn

from dspark_sglang.models.moe import Experts, Router


def _eligible(p: torch.Tensor | None) -> bool:
    return (
        p is not None
        and p.dtype == torch.float32
        and p.device.type == "cpu"
        and p.dim() >= 2
        and not p.transpose(-1, -2).is_contiguous()  # not column-major already
    )


def _column_major(p: torch.Tensor) -> torch.Tensor:
    """The same values, the last two dims stored transposed."""
    return p.detach().transpose(-1, -2).contiguous().transpose(-1, -2)


def column_major_weights(*modules: nn.Module) -> None:
    """Re-lay out, in place, the fp32 CPU weights under `modules` that products read as Wᵀ: every
    nn.Linear's (subclasses included), the MoE router's and the experts'. A parameter keeps its
    identity (its data is replaced), so weights shared between the modules stay shared. An
    embedding's weight keeps its layout; a linear that shares it gets one column-major copy,
    shared in turn by every linear that shared the embedding (a drafter's LM head aliasing the
    target's)."""
    mods = [m for root in modules for m in root.modules()]
    embedded = {id(m.weight) for m in mods if isinstance(m, nn.Embedding)}
    untied: dict[int, nn.Parameter] = {}
    for m in mods:
        if not isinstance(m, nn.Linear | Router | Experts):
            continue
        for name in ("gate_up_proj", "down_proj") if isinstance(m, Experts) else ("weight",):
            p = getattr(m, name)
            if not _eligible(p) and id(p) not in untied:
                continue
            if id(p) in embedded or id(p) in untied:
                if id(p) not in untied:
                    untied[id(p)] = nn.Parameter(_column_major(p), requires_grad=False)
                setattr(m, name, untied[id(p)])
            else:
                p.data = _column_major(p)
