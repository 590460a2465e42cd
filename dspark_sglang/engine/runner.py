"""ModelRunner: loads the target (and drafter), owns all KV tensors, runs the forwards.

The only place model weights and KV tensors live. The drafter's context K/V share the target's
block tables: position p of a sequence sits in the same slot in both pools.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
from torch.nn import functional as F

from dspark_sglang.config import ArchConfig, CacheConfig, ConfigError, DraftConfig, ModelConfig
from dspark_sglang.engine.batch import ForwardBatch
from dspark_sglang.engine.kv_cache import allocate_kv, bytes_per_block, num_blocks_for
from dspark_sglang.engine.malloc_tuning import keep_freed_memory
from dspark_sglang.engine.speculative import DraftBatch, Proposal, length_groups
from dspark_sglang.hostinfo import CPUINFO, cpu_fields
from dspark_sglang.models.attention import ForwardContext, forward_context
from dspark_sglang.models.cpu_gemm import (
    fitted_crossover,
    gemm_mode,
    measured_crossover,
    measured_shapes,
    pack_model,
    packed_share,
    row_tiers,
    warm_up,
)
from dspark_sglang.models.drafter import DSparkDrafter
from dspark_sglang.models.loader import load_drafter, load_target, read_draft_arch, torch_dtype
from dspark_sglang.models.moe import ExpertParallel
from dspark_sglang.models.row_buckets import bucket_linears
from dspark_sglang.models.weight_layout import column_major_weights

log = logging.getLogger(__name__)


@dataclass
class RunOutput:
    logits: torch.Tensor  # [S, V] fp32, rows of batch.sample_rows
    taps: torch.Tensor | None  # [T, n_taps * H] for every row, when a drafter is loaded
    expert_counts: torch.Tensor | None  # [E] routed (token, slot) pairs summed over MoE layers


class ModelRunner:
    """`ep`: this process is one expert-parallel rank (engine/ep.py drives the others)."""

    def __init__(
        self,
        model_cfg: ModelConfig,
        cache_cfg: CacheConfig,
        draft_cfg: DraftConfig | None = None,
        ep: ExpertParallel | None = None,
        max_rows: int = 2048,
    ) -> None:
        """`max_rows`: the most tokens one forward carries (--max-num-batched-tokens); the
        packed CPU products (--cpu-gemm) build their kernels up to it at load."""
        if model_cfg.device.startswith("cuda") and not torch.cuda.is_available():
            raise ConfigError(f"--device {model_cfg.device} requested but CUDA is not available")
        self.arch = ArchConfig.from_model_path(model_cfg.path)
        self.device = model_cfg.device
        if self.device.startswith("cpu"):  # process-wide, before the first forward's temporaries
            keep_freed_memory(model_cfg.cpu_malloc_keep_mib << 20)
        self.dtype = torch_dtype(model_cfg.dtype)
        draft_arch = None
        taps = model_cfg.tap_layer_ids
        if draft_cfg is not None and draft_cfg.enabled:
            draft_arch = read_draft_arch(draft_cfg.path)
            draft_arch.check_target(self.arch)
            taps = draft_arch.target_layer_ids
        self.ep = ep
        self.model = load_target(
            model_cfg.path,
            model_cfg.dtype,
            model_cfg.device,
            taps,
            model_cfg.attention_backend,
            ep,
        )
        self.draft_dtype, self.draft_gemm_dtype = (
            draft_precision(draft_cfg.draft_dtype, self.dtype, self.device)
            if draft_arch is not None
            else (self.dtype, None)
        )
        self.drafter: DSparkDrafter | None = (
            load_drafter(draft_cfg.path, self.model, self.draft_dtype)
            if draft_arch is not None
            else None
        )
        if self.drafter is not None and self.device.startswith("cpu"):
            if self.draft_gemm_dtype is not None:
                bucket_linears(self.drafter, self.draft_gemm_dtype)
            elif self.draft_dtype != torch.float32:  # a bounded set of oneDNN kernels
                bucket_linears(self.drafter)
        # the token counts a target forward executes at (the capacity model's buckets); () =
        # exactly the batch's tokens
        self.row_tiers: tuple[int, ...] = ()
        # what multiplies the fp32 weights: "mkl", "onednn", "auto" (timed at load) or "none"
        mode = gemm_mode(model_cfg.cpu_gemm, self.device)
        self.cpu_gemm = "auto" if mode == "measured" else mode
        drafters = [self.drafter] if self.drafter is not None else []
        if mode in ("onednn", "measured"):
            cross = measured_crossover if mode == "measured" else fitted_crossover
            packed = pack_model(self.model, max_rows, cross)
            if packed_share(self.model, max_rows) > 0.5:  # most products pad their rows to the grid
                self.row_tiers = row_tiers(max_rows)
            for d in drafters:
                packed += pack_model(d, max_rows, cross)
            warm_up(packed)
            if mode == "measured":
                chosen = measured_shapes()
                log.info(
                    "--cpu-gemm auto: oneDNN for %s; MKL for the rest",
                    ", ".join(f"{k} rows {v[0]}-{v[1] or 'up'}" for k, v in chosen.items() if v)
                    or "no product",
                )
        if mode in ("mkl", "measured"):  # MKL's products read column-major weights
            column_major_weights(self.model, *drafters)
        limit = model_cfg.max_model_len or self.arch.max_position_embeddings
        if limit > self.arch.max_position_embeddings:
            raise ConfigError(
                f"--max-model-len {limit} exceeds the model's max_position_embeddings "
                f"{self.arch.max_position_embeddings}"
            )
        self.max_model_len = limit
        self.page_size = cache_cfg.page_size
        pool = draft_arch is not None and not draft_cfg.context_only
        draft_geom = _draft_geometry(draft_arch) if pool else None
        extra = bytes_per_block(draft_geom, self.page_size, self.draft_dtype) if draft_geom else 0
        self.num_blocks = num_blocks_for(self.arch, cache_cfg, self.dtype, extra)
        self.kv = allocate_kv(self.arch, self.num_blocks, self.page_size, self.dtype, self.device)
        self.draft_kv = (
            allocate_kv(draft_geom, self.num_blocks, self.page_size, self.draft_dtype, self.device)
            if draft_geom is not None
            else []
        )

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch, tap_rows: torch.Tensor | None = None) -> RunOutput:
        """tap_rows: rows whose taps to return; by default every row when a drafter is loaded."""
        counts = (
            torch.zeros(self.arch.num_experts, dtype=torch.long, device=self.device)
            if self.arch.is_moe
            else None
        )
        rows: torch.Tensor | slice | None = tap_rows
        if rows is None and self.drafter is not None:
            rows = slice(None)  # every row: the taps are views of the layers' outputs, no gather
        ctx = ForwardContext(batch.attn, self.kv, tap_rows=rows, expert_counts=counts)
        with forward_context(ctx):
            hidden, taps = self.model(batch.input_ids, batch.positions)
        if self.ep is not None and counts is not None:  # each rank counted its own token shard
            self.ep.all_reduce(counts)
        logits = self.model.compute_logits(hidden[batch.sample_rows]).float()
        return RunOutput(logits, taps, counts)

    def close(self) -> None:
        """Release what outlives the object (expert-parallel ranks); nothing on one rank."""

    @torch.inference_mode()
    def drafter_context(self, taps: torch.Tensor) -> torch.Tensor:
        """C = hidden_norm(fc(taps)) of verified rows (what a handoff carries)."""
        assert self.drafter is not None
        return self.drafter.project_context(taps.to(self.draft_dtype))

    @torch.inference_mode()
    def write_draft_context(
        self, c: torch.Tensor, positions: torch.Tensor, slot_ids: torch.Tensor
    ) -> None:
        assert self.drafter is not None
        kvs = self.drafter.context_kv(c.to(self.draft_dtype), positions)  # C may be handed off
        for (k_cache, v_cache), (k, v) in zip(self.draft_kv, kvs, strict=True):
            k_cache[slot_ids] = k.to(k_cache.dtype)
            v_cache[slot_ids] = v.to(v_cache.dtype)

    def read_kv(self, slot_ids: torch.Tensor) -> torch.Tensor:
        """Target K/V at the given slots -> [layers, 2, n, h_kv, d] (a copy)."""
        return torch.stack([torch.stack([k[slot_ids], v[slot_ids]]) for k, v in self.kv])

    def write_kv(self, slot_ids: torch.Tensor, kv: torch.Tensor) -> None:
        for (k_cache, v_cache), layer in zip(self.kv, kv.to(self.dtype), strict=True):
            k_cache[slot_ids] = layer[0]
            v_cache[slot_ids] = layer[1]

    @torch.inference_mode()
    def draft(
        self, batch: DraftBatch, temperatures: torch.Tensor, gens: list[torch.Generator | None]
    ) -> Proposal:
        assert self.drafter is not None
        g = self.drafter.cfg.block_size
        lens = batch.anchor_pos.tolist()
        groups = length_groups(lens, g)
        if len(groups) == 1:
            h = self._draft_block(batch.anchors, batch.anchor_pos, batch.ctx_slots, batch.ctx_mask)
        else:  # rows of similar context length per pass: no row pads to the longest prompt
            h = None
            for rows in groups:
                idx = torch.tensor(rows, device=batch.anchors.device)
                width = max(lens[i] for i in rows)
                hg = self._draft_block(
                    batch.anchors[idx],
                    batch.anchor_pos[idx],
                    batch.ctx_slots[idx, :width],
                    batch.ctx_mask[idx, :width],
                )
                if h is None:
                    h = hg.new_empty((len(lens), *hg.shape[1:]))
                h[idx] = hg
            assert h is not None
        tokens, q, conf = self.drafter.propose(h, batch.anchors, temperatures, gens)
        return Proposal(batch.seq_ids, tokens, q, conf)

    def _draft_block(
        self,
        anchors: torch.Tensor,
        anchor_pos: torch.Tensor,
        ctx_slots: torch.Tensor,
        ctx_mask: torch.Tensor,
    ) -> torch.Tensor:
        assert self.drafter is not None
        # g scratch rows per request (slot 0, overwritten) for the block's own K/V
        slots = F.pad(ctx_slots, (0, self.drafter.cfg.block_size))
        flat, shape = slots.reshape(-1), slots.shape
        ctx = [
            (
                k.index_select(0, flat).view(*shape, *k.shape[1:]),
                v.index_select(0, flat).view(*shape, *v.shape[1:]),
            )
            for k, v in self.draft_kv
        ]
        return self.drafter.forward_block(anchors, anchor_pos, ctx, ctx_mask, block_room=True)


def native_bf16(device: str, cpuinfo: str = CPUINFO) -> bool:
    """A CPU whose matrix units take bf16 natively (AVX512-BF16 or AMX): oneDNN runs bf16 GEMMs
    4-5x faster than fp32 there, and emulates them more slowly than fp32 elsewhere."""
    if not device.startswith("cpu"):
        return False
    flags = cpu_fields(cpuinfo).get("flags", "").split()  # none off Linux: keep the dtype
    return "avx512_bf16" in flags or "amx_bf16" in flags


def draft_precision(
    name: str, target: torch.dtype, device: str
) -> tuple[torch.dtype, torch.dtype | None]:
    """--draft-dtype -> (the drafter's dtype, the dtype of its batched products or None).
    auto: an fp32 target on a CPU with native bf16 gets an fp32 drafter whose products of 16 rows
    or more (R >= 3 at g = 7) run on bf16 copies of the weights; bf16 lost to fp32 below that
    (served, R = 1: 3.76 against 3.40 ms a drafting pass) and won above (R = 64: 28.1 against
    44.4 ms). Everywhere else auto is the target's dtype."""
    if name != "auto":
        return torch_dtype(name), None
    if target == torch.float32 and native_bf16(device):
        return torch.float32, torch.bfloat16
    return target, None


def _draft_geometry(d: object) -> ArchConfig:
    """The drafter's KV shape expressed as an ArchConfig, for the shared sizing helpers."""
    return ArchConfig(
        architecture="Qwen3ForCausalLM",
        vocab_size=d.vocab_size,
        hidden_size=d.hidden_size,
        num_hidden_layers=d.num_layers,
        num_attention_heads=d.num_attention_heads,
        num_key_value_heads=d.num_key_value_heads,
        head_dim=d.head_dim,
        intermediate_size=d.intermediate_size,
        rms_norm_eps=d.rms_norm_eps,
        rope_theta=d.rope_theta,
        max_position_embeddings=1,
        tie_word_embeddings=False,
    )
