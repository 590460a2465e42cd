"""Qwen3-MoE sparse block: softmax top-k router over fused expert weights, and its expert-parallel
dispatch/combine over torch.distributed (a group object handed in at build time, never a global).

Routing follows the HF reference (fp32 softmax, top-k, optional renormalisation). Expert weights
use the transformers>=5 fused names; the loader converts per-expert hub checkpoints.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F

from dspark_sglang.config import ArchConfig
from dspark_sglang.models.attention import current_context
from dspark_sglang.models.cpu_gemm import Crossover, PackedWeight, packed_weight


class ExpertParallel:
    """This process's place among `size` EP ranks and the collectives its MoE layers run.

    Rank r owns experts [r·E/size, (r+1)·E/size) of every MoE layer (contiguous blocks, as
    algo/capacity.rank_shares assumes). The engine builds it around a process group whose members
    all run the same forward (attention replicated); the model only calls the three methods here.
    """

    def __init__(self, group: dist.ProcessGroup, rank: int, size: int) -> None:
        self.group, self.rank, self.size = group, rank, size

    def expert_range(self, num_experts: int) -> tuple[int, int]:
        n = num_experts // self.size
        return self.rank * n, (self.rank + 1) * n

    def all_to_all(
        self, out: torch.Tensor, inp: torch.Tensor, out_splits: list[int], in_splits: list[int]
    ) -> None:
        dist.all_to_all_single(out, inp, out_splits, in_splits, group=self.group)

    def all_gather(self, outs: list[torch.Tensor], inp: torch.Tensor) -> None:
        dist.all_gather(outs, inp, group=self.group)

    def all_reduce(self, t: torch.Tensor) -> None:
        dist.all_reduce(t, group=self.group)


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
    """The experts this process holds: all of them, or its EP rank's contiguous block."""

    def __init__(self, cfg: ArchConfig, num_local: int | None = None) -> None:
        super().__init__()
        e, h, i = num_local or cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size
        self.num_experts = e
        self.gate_up_proj = nn.Parameter(torch.empty(e, 2 * i, h))
        self.down_proj = nn.Parameter(torch.empty(e, h, i))
        # per expert (gate_up, down) packed for oneDNN (models/cpu_gemm.py), when packed
        self.gemm: list[tuple[PackedWeight | None, PackedWeight | None]] | None = None

    def pack_gemm(self, max_rows: int, crossover: Crossover) -> list[PackedWeight]:
        if self.gate_up_proj.dtype != torch.float32:
            return []
        gemm = [
            (
                packed_weight(gu, None, max_rows, crossover),
                packed_weight(dn, None, max_rows, crossover),
            )
            for gu, dn in zip(self.gate_up_proj, self.down_proj, strict=True)
        ]
        out = [w for pair in gemm for w in pair if w is not None]
        self.gemm = gemm if out else None
        return out

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
            xe = x[tok]
            gu, dn = (None, None) if self.gemm is None else self.gemm[e]
            if gu is not None and gu.takes(xe):
                gate, up = gu(xe).chunk(2, dim=-1)
            else:
                gate, up = F.linear(xe, self.gate_up_proj[e]).chunk(2, dim=-1)
            h = F.silu(gate) * up
            y = dn(h) if dn is not None and dn.takes(h) else F.linear(h, self.down_proj[e])
            out.index_add_(0, tok, (y * weights.reshape(-1)[idx, None]).to(out.dtype))
        return out


class SparseMoeBlock(nn.Module):
    def __init__(self, cfg: ArchConfig, ep: ExpertParallel | None = None) -> None:
        super().__init__()
        self.num_experts = cfg.num_experts
        self.ep = ep
        self.gate = Router(cfg)
        self.experts = Experts(cfg, None if ep is None else cfg.num_experts // ep.size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.ep is not None:
            return self._forward_ep(x, self.ep)
        weights, experts = self.gate(x)
        ctx = current_context()
        if ctx.expert_counts is not None:
            ctx.expert_counts += torch.bincount(
                experts.reshape(-1), minlength=self.experts.num_experts
            )
        return self.experts(x, experts, weights)

    def _forward_ep(self, x: torch.Tensor, ep: ExpertParallel) -> torch.Tensor:
        """Every rank holds all T rows (attention is replicated). Rank r routes its contiguous
        shard of rows, sends each (token, expert) pair to the expert's owner (all-to-all), the
        owners run their experts, results come back (all-to-all) and are weighted and summed on
        the shard's rank, and an all-gather makes the output whole again on every rank.

        Region map: the pairs a rank sends are sorted by expert, hence grouped by owner rank; a
        rank receives from source s, for each of its n local experts j, recv_counts[s·n + j]
        rows, in that (s, j) order. Each expert therefore sees its rows in token order, as with
        one rank, which keeps the matmuls (and so the logits) the same.
        """
        t, size = x.shape[0], ep.size
        chunk = -(-t // size)
        lo, hi = min(ep.rank * chunk, t), min((ep.rank + 1) * chunk, t)
        xs = x[lo:hi]
        weights, experts = self.gate(xs)  # [t_r, k]
        flat = experts.reshape(-1)  # [t_r*k]
        send_counts = torch.bincount(flat, minlength=self.num_experts)  # [E]
        ctx = current_context()
        if ctx.expert_counts is not None:  # this shard's pairs; the runner sums over ranks
            ctx.expert_counts += send_counts
        order = torch.argsort(flat, stable=True)
        token_of = order // experts.shape[1]
        n_local = self.experts.num_experts
        recv_counts = torch.empty_like(send_counts)
        ep.all_to_all(recv_counts, send_counts, [n_local] * size, [n_local] * size)
        send_split, recv_split = (
            torch.stack([send_counts, recv_counts]).view(2, size, n_local).sum(-1).tolist()
        )
        recv_x = x.new_empty(sum(recv_split), x.shape[1])
        ep.all_to_all(recv_x, xs[token_of], recv_split, send_split)  # dispatch
        local = torch.arange(n_local, device=x.device).repeat(size)
        recv_expert = torch.repeat_interleave(local, recv_counts)  # [M] local expert per row
        ones = recv_x.new_ones(recv_x.shape[0], 1)
        y = self.experts(recv_x, recv_expert[:, None], ones)  # [M, H] unweighted
        back = x.new_empty(order.shape[0], x.shape[1])
        ep.all_to_all(back, y, send_split, recv_split)  # combine
        out = x.new_zeros(chunk, x.shape[1])
        out.index_add_(0, token_of, (back * weights.reshape(-1)[order, None]).to(out.dtype))
        parts = [torch.empty_like(out) for _ in range(size)]
        ep.all_gather(parts, out)
        return torch.cat(parts)[:t]
