"""Column-major fp32 weights: values, shapes, sharing and products unchanged, only the layout."""

from __future__ import annotations

import torch
from torch import nn

from dspark_sglang.config import ArchConfig
from dspark_sglang.models.attention import ForwardContext, forward_context
from dspark_sglang.models.moe import SparseMoeBlock
from dspark_sglang.models.row_buckets import bucket_linears
from dspark_sglang.models.weight_layout import column_major_weights
from tests.conftest import moe_arch


def _column_major(p: torch.Tensor) -> bool:
    return p.transpose(-1, -2).is_contiguous() and not p.is_contiguous()


def _moe_cfg() -> ArchConfig:
    return moe_arch(
        vocab_size=64, hidden_size=32, intermediate_size=64, head_dim=16, moe_intermediate_size=24
    )


def test_linears_router_and_experts_turn_column_major_with_the_same_values_and_products() -> None:
    torch.manual_seed(0)
    lin, moe = nn.Linear(32, 48), SparseMoeBlock(_moe_cfg())
    for p in moe.parameters():
        nn.init.normal_(p, std=0.2)
    bucketed = nn.Linear(32, 40, bias=False)
    bucket_linears(bucketed, torch.bfloat16)  # the drafter's: fp32 weight, bf16 copy
    x = torch.randn(64, 32)
    before = [m(x).clone() for m in (lin, bucketed)]
    weights = [p.detach().clone() for p in (lin.weight, moe.gate.weight, bucketed.weight)]
    experts = [moe.experts.gate_up_proj.detach().clone(), moe.experts.down_proj.detach().clone()]
    params = [lin.weight, moe.experts.gate_up_proj, moe.experts.down_proj]
    with torch.inference_mode():
        with forward_context(ForwardContext(None, None)):
            moe_before = moe(x).clone()
        column_major_weights(lin, moe, bucketed)
        with forward_context(ForwardContext(None, None)):
            moe_after = moe(x)
    for p in (lin.weight, moe.gate.weight, bucketed.weight, *params[1:]):
        assert _column_major(p)
    assert lin.weight is params[0] and moe.experts.gate_up_proj is params[1]  # identity kept
    for p, w in zip((lin.weight, moe.gate.weight, bucketed.weight), weights, strict=True):
        assert torch.equal(p, w)
    assert torch.equal(moe.experts.gate_up_proj, experts[0])
    assert torch.equal(moe.experts.down_proj, experts[1])
    assert lin.bias.is_contiguous()
    for m, want in zip((lin, bucketed), before, strict=True):
        torch.testing.assert_close(m(x), want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(moe_after, moe_before, rtol=1e-5, atol=1e-5)


def test_a_tied_head_gets_one_copy_shared_by_its_aliases_and_the_embedding_keeps_its_rows() -> None:
    emb = nn.Embedding(64, 32)
    head, other = nn.Linear(32, 64, bias=False), nn.Linear(32, 64, bias=False)
    head.weight = emb.weight
    other.weight = emb.weight  # a drafter's head aliasing the target's
    target = nn.ModuleDict({"emb": emb, "head": head})
    column_major_weights(target, other)
    assert emb.weight.is_contiguous()  # lookups read rows
    assert head.weight is not emb.weight and head.weight is other.weight
    assert _column_major(head.weight) and torch.equal(head.weight, emb.weight)
    half = nn.Linear(32, 8).to(torch.bfloat16)
    column_major_weights(half)  # fp32 only: MKL's case
    assert half.weight.is_contiguous()
