"""Qwen3-MoE sparse block: softmax top-k router over fused expert weights.

Routing follows the HF reference (fp32 softmax, top-k, optional renormalisation). Expert weights
use the transformers>=5 fused names; the loader converts per-expert hub checkpoints. Expert
parallel dispatch plugs in around `experts_forward`; this file holds no TP/EP code yet.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from dspark_sglang.config import ArchConfig
from dspark_sglang.models.attention import current_context


class Router(nn.Module):
    def __init__(self, cfg: ArchConfig) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(cfg.num_experts, cfg.hidden_size))
        self.top_k = cfg.num_experts_per_tok
        self.norm_topk_prob = cfg.norm_topk_prob

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = F.linear(x, self.weight)  # [T, E]
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
        weights, experts = torch.topk(probs, self.top_k, dim=-1)  # [T, k]
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights.to(logits.dtype), experts


class Experts(nn.Module):
    def __init__(self, cfg: ArchConfig) -> None:
        super().__init__()
        e, h, i = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size
        self.num_experts = e
        self.gate_up_proj = nn.Parameter(torch.empty(e, 2 * i, h))
        self.down_proj = nn.Parameter(torch.empty(e, h, i))

    def forward(
        self, x: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor
    ) -> torch.Tensor:
        # Sort the (token, slot) pairs by expert so each expert runs one contiguous matmul.
        flat = experts.reshape(-1)  # [T*k]
        order = torch.argsort(flat, stable=True)
        # One host read per MoE layer to size the per-expert matmuls; a grouped-GEMM backend on
        # GPU removes it (the engine's single-sync rule covers the attention/sampling path).
        counts = torch.bincount(flat, minlength=self.num_experts).tolist()
        token_of = order // experts.shape[1]
        out = torch.zeros_like(x)
        start = 0
        for e, n in enumerate(counts):
            if n == 0:
                continue
            idx = order[start : start + n]
            tok = token_of[start : start + n]
            start += n
            gate, up = F.linear(x[tok], self.gate_up_proj[e]).chunk(2, dim=-1)
            y = F.linear(F.silu(gate) * up, self.down_proj[e])  # [n, H]
            out.index_add_(0, tok, (y * weights.reshape(-1)[idx, None]).to(out.dtype))
        return out


class SparseMoeBlock(nn.Module):
    def __init__(self, cfg: ArchConfig) -> None:
        super().__init__()
        self.gate = Router(cfg)
        self.experts = Experts(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, experts = self.gate(x)
        ctx = current_context()
        if ctx.expert_counts is not None:
            ctx.expert_counts += torch.bincount(
                experts.reshape(-1), minlength=self.experts.num_experts
            )
        return self.experts(x, experts, weights)
