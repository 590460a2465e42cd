"""Qwen3 / Qwen3-MoE target decoder with DeepSpec hidden-state taps.

Tap id L is the residual-stream output of decoder layer L before the final norm (id -1 is the
embedding output); taps are returned for the rows the forward context asks for, concatenated
in id order. Module names match HF checkpoint keys. No scheduling, TP or metrics code here.
"""

from __future__ import annotations

import torch
from torch import nn

from dspark_sglang.config import ArchConfig, ConfigError
from dspark_sglang.models.attention import Qwen3Attention, TorchSDPABackend, current_context
from dspark_sglang.models.layers import GatedMLP, RMSNorm
from dspark_sglang.models.moe import ExpertParallel, SparseMoeBlock


class DecoderLayer(nn.Module):
    def __init__(
        self,
        cfg: ArchConfig,
        layer_id: int,
        backend: TorchSDPABackend,
        ep: ExpertParallel | None = None,
    ) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Qwen3Attention(cfg, layer_id, backend)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp: nn.Module = (
            SparseMoeBlock(cfg, ep)
            if cfg.is_moe_layer(layer_id)
            else GatedMLP(cfg.hidden_size, cfg.intermediate_size)
        )

    def forward(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), positions)
        return x + self.mlp(self.post_attention_layernorm(x))


class Qwen3Model(nn.Module):
    def __init__(
        self, cfg: ArchConfig, backend: TorchSDPABackend, ep: ExpertParallel | None = None
    ) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(
            DecoderLayer(cfg, i, backend, ep) for i in range(cfg.num_hidden_layers)
        )
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class Qwen3ForCausalLM(nn.Module):
    """Serves both architectures; `cfg.is_moe_layer` decides each layer's MLP. With `ep` the MoE
    layers hold only this rank's experts and exchange tokens with the other ranks."""

    def __init__(
        self,
        cfg: ArchConfig,
        backend: TorchSDPABackend,
        tap_layer_ids: tuple[int, ...] = (),
        ep: ExpertParallel | None = None,
    ) -> None:
        super().__init__()
        for lid in tap_layer_ids:
            if not -1 <= lid < cfg.num_hidden_layers:
                raise ConfigError(
                    f"tap layer id {lid} out of range [-1, {cfg.num_hidden_layers - 1}]"
                )
        self.cfg = cfg
        self.tap_layer_ids = tap_layer_ids
        self.model = Qwen3Model(cfg, backend, ep)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """-> (final-normed hidden [T, H], taps [len(tap_rows), n_taps*H] or None)."""
        ctx = current_context()
        rows = ctx.tap_rows if self.tap_layer_ids else None
        x = self.model.embed_tokens(input_ids)  # [T, H]
        taps: list[torch.Tensor] = []
        if rows is not None and -1 in self.tap_layer_ids:
            taps.append(x[rows])
        for i, layer in enumerate(self.model.layers):
            x = layer(x, positions)
            if rows is not None and i in self.tap_layer_ids:
                taps.append(x[rows])
        return self.model.norm(x), (torch.cat(taps, dim=-1) if rows is not None else None)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)
