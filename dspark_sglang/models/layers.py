"""Building blocks of Qwen3-family decoders: RMSNorm, rotary embedding, gated MLP.

Plain torch modules; know nothing about batching, caches or serving.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in fp32 and cast back before the weight, as the HF reference does.
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


class RotaryEmbedding(nn.Module):
    """Non-interleaved (rotate-half) RoPE; the cos/sin table grows on demand."""

    def __init__(self, head_dim: int, theta: float) -> None:
        super().__init__()
        # Not a buffer: models are built on the meta device and the table must stay fp32.
        self.head_dim = head_dim
        self.theta = theta
        self._cos = torch.empty(0)
        self._sin = torch.empty(0)

    def _table(self, n: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        if self._cos.shape[0] < n or self._cos.device != device:
            size = max(n, 2 * self._cos.shape[0], 256)
            exps = torch.arange(0, self.head_dim, 2, dtype=torch.float32, device=device)
            inv_freq = 1.0 / (self.theta ** (exps / self.head_dim))
            t = torch.arange(size, dtype=torch.float32, device=device)
            freqs = torch.outer(t, inv_freq)  # [S, d/2]
            emb = torch.cat([freqs, freqs], dim=-1)  # [S, d]
            self._cos, self._sin = emb.cos(), emb.sin()
        return self._cos, self._sin

    def forward(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # q: [T, h, d], k: [T, h_kv, d], positions: [T]
        cos, sin = self._cos_sin(positions)
        return _rotate(q, cos, sin), _rotate(k, cos, sin)

    def apply(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """x [..., T, h, d] at positions [..., T]."""
        cos, sin = self._cos_sin(positions)
        return _rotate(x, cos, sin)

    def _cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        n = int(positions.max()) + 1 if positions.numel() else 1
        cos_t, sin_t = self._table(n, positions.device)
        return cos_t[positions].unsqueeze(-2), sin_t[positions].unsqueeze(-2)  # [..., T, 1, d]


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    xf = x.float()
    x1, x2 = xf.chunk(2, dim=-1)
    rotated = torch.cat([-x2, x1], dim=-1)
    return (xf * cos + rotated * sin).to(x.dtype)


class GatedMLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x))."""

    def __init__(self, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
