"""SeqHandoff: what a prefill engine gives a decode engine for one request (DESIGN §2).

Prompt ids, sampling params, the first token, the prompt's target K/V, the projected drafter
context C = hidden_norm(fc(taps)) per prompt token (H values, not per-layer K/V), and the
request's RNG state so decoding continues the same random stream. Wire packing is serve's job.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dspark_sglang.types import SamplingParams


@dataclass
class SeqHandoff:
    prompt_ids: list[int]
    first_token: int
    params: SamplingParams
    kv: torch.Tensor  # [layers, 2, n, h_kv, d] target K/V of the n prompt tokens
    draft_ctx: torch.Tensor | None  # [n, H] projected drafter context, None without a drafter
    rng_state: torch.Tensor  # torch.Generator state (uint8)

    def validate(self, layers: int, kv_heads: int, head_dim: int, hidden: int | None) -> None:
        from dspark_sglang.config import ConfigError

        n = len(self.prompt_ids)
        want = (layers, 2, n, kv_heads, head_dim)
        if tuple(self.kv.shape) != want:
            raise ConfigError(f"handoff kv has shape {tuple(self.kv.shape)}, expected {want}")
        if hidden is not None and (
            self.draft_ctx is None or tuple(self.draft_ctx.shape) != (n, hidden)
        ):
            got = None if self.draft_ctx is None else tuple(self.draft_ctx.shape)
            raise ConfigError(f"handoff draft_ctx has shape {got}, expected {(n, hidden)}")
