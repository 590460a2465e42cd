"""HF hub format for a trained target: `config.json`, per-expert safetensors, tokenizer files.

The inverse of `models.loader.fuse_experts`; what it writes loads in transformers and our loader.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import save_file

from dspark_sglang.models.target import Qwen3ForCausalLM
from dspark_sglang.train.tokenizer import ENDOFTEXT, IM_END


def hf_config(arch: dict[str, object], vocab_size: int, ids: dict[str, int]) -> dict[str, object]:
    """`config.json` for a Qwen3-MoE geometry; loads in transformers and `ArchConfig`."""
    eos = [ids[IM_END], ids[ENDOFTEXT]]
    return {
        "architectures": ["Qwen3MoeForCausalLM"],
        "model_type": "qwen3_moe",
        "vocab_size": vocab_size,
        **arch,
        # transformers<5 and the hub read `num_experts`, transformers>=5 `num_local_experts`.
        "num_local_experts": arch["num_experts"],
        "rope_parameters": {"rope_type": "default", "rope_theta": arch["rope_theta"]},
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "hidden_act": "silu",
        "attention_bias": False,
        "attention_dropout": 0.0,
        "use_sliding_window": False,
        "sliding_window": None,
        "initializer_range": 0.02,
        "output_router_logits": False,
        "router_aux_loss_coef": 0.01,
        "bos_token_id": ids[ENDOFTEXT],
        "eos_token_id": eos,
        "pad_token_id": ids[ENDOFTEXT],
        "use_cache": True,
        "torch_dtype": "bfloat16",
        "dtype": "bfloat16",
    }


def hf_state_dict(model: Qwen3ForCausalLM, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Our fused experts -> hub per-expert keys; no lm_head when tied (transformers re-ties)."""
    out: dict[str, torch.Tensor] = {}
    for name, t in model.state_dict().items():
        if name == "lm_head.weight" and model.cfg.tie_word_embeddings:
            continue
        t = t.detach().to(dtype)
        if name.endswith("mlp.experts.gate_up_proj"):  # [E, 2I, H], gate rows first
            prefix, inter = name.removesuffix("gate_up_proj"), t.shape[1] // 2
            for e in range(t.shape[0]):
                out[f"{prefix}{e}.gate_proj.weight"] = t[e, :inter].contiguous()
                out[f"{prefix}{e}.up_proj.weight"] = t[e, inter:].contiguous()
        elif name.endswith("mlp.experts.down_proj"):  # [E, H, I]
            prefix = name.removesuffix("down_proj")
            for e in range(t.shape[0]):
                out[f"{prefix}{e}.down_proj.weight"] = t[e].contiguous()
        else:
            out[name] = t.contiguous()
    return out


def export_target(
    model: Qwen3ForCausalLM,
    cfg: dict[str, object],
    tokenizer_dir: Path,
    out: Path,
    dtype: str = "bfloat16",
) -> None:
    out.mkdir(parents=True, exist_ok=True)
    torch_dtype = {"bfloat16": torch.bfloat16, "float32": torch.float32}[dtype]
    weights = out / "model.safetensors"
    save_file(hf_state_dict(model, torch_dtype), str(weights), {"format": "pt"})
    weights.chmod(0o644)  # save_file creates it owner-only; package data must be readable by all
    cfg = {**cfg, "torch_dtype": dtype, "dtype": dtype}
    (out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    gen = {
        "bos_token_id": cfg["bos_token_id"],
        "eos_token_id": cfg["eos_token_id"],
        "pad_token_id": cfg["pad_token_id"],
        "do_sample": True,
        "temperature": 0.8,
    }
    (out / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copyfile(tokenizer_dir / name, out / name)
