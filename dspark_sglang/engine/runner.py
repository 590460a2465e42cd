"""ModelRunner: loads the target, owns the KV tensors, runs forward(ForwardBatch).

The only place model weights and KV tensors live. Returns fp32 logits for the sampling rows.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dspark_sglang.config import ArchConfig, CacheConfig, ConfigError, ModelConfig
from dspark_sglang.engine.batch import ForwardBatch
from dspark_sglang.engine.kv_cache import allocate_kv, num_blocks_for
from dspark_sglang.models.attention import ForwardContext, forward_context
from dspark_sglang.models.loader import load_target, torch_dtype


@dataclass
class RunOutput:
    logits: torch.Tensor  # [S, V] fp32, rows of batch.sample_rows
    taps: torch.Tensor | None  # [len(tap_rows), n_taps * H]
    expert_counts: torch.Tensor | None  # [E] routed (token, slot) pairs summed over MoE layers


class ModelRunner:
    def __init__(self, model_cfg: ModelConfig, cache_cfg: CacheConfig) -> None:
        if model_cfg.device.startswith("cuda") and not torch.cuda.is_available():
            raise ConfigError(f"--device {model_cfg.device} requested but CUDA is not available")
        self.arch = ArchConfig.from_model_path(model_cfg.path)
        self.device = model_cfg.device
        self.dtype = torch_dtype(model_cfg.dtype)
        self.model = load_target(
            model_cfg.path,
            model_cfg.dtype,
            model_cfg.device,
            model_cfg.tap_layer_ids,
            model_cfg.attention_backend,
        )
        limit = model_cfg.max_model_len or self.arch.max_position_embeddings
        if limit > self.arch.max_position_embeddings:
            raise ConfigError(
                f"--max-model-len {limit} exceeds the model's max_position_embeddings "
                f"{self.arch.max_position_embeddings}"
            )
        self.max_model_len = limit
        self.page_size = cache_cfg.page_size
        self.num_blocks = num_blocks_for(self.arch, cache_cfg, self.dtype)
        self.kv = allocate_kv(self.arch, self.num_blocks, self.page_size, self.dtype, self.device)

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch, tap_rows: torch.Tensor | None = None) -> RunOutput:
        counts = (
            torch.zeros(self.arch.num_experts, dtype=torch.long, device=self.device)
            if self.arch.is_moe
            else None
        )
        ctx = ForwardContext(batch.attn, self.kv, tap_rows=tap_rows, expert_counts=counts)
        with forward_context(ctx):
            hidden, taps = self.model(batch.input_ids, batch.positions)
        logits = self.model.compute_logits(hidden[batch.sample_rows]).float()
        return RunOutput(logits, taps, counts)
