"""HF checkpoint folder -> Qwen3ForCausalLM: safetensors shards, key mapping, tied embeddings.

Every mismatch between config and weights is reported by key name; nothing is silently skipped.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch
from safetensors import safe_open

from dspark_sglang.config import ArchConfig, ConfigError, DraftArch
from dspark_sglang.models.attention import create_backend
from dspark_sglang.models.drafter import DSparkDrafter
from dspark_sglang.models.moe import ExpertParallel
from dspark_sglang.models.target import Qwen3ForCausalLM

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_FUSED = (".mlp.experts.gate_up_proj", ".mlp.experts.down_proj")
_PER_EXPERT = re.compile(r"^(.*\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")


def torch_dtype(name: str) -> torch.dtype:
    return _DTYPES[name]


def build_target(
    cfg: ArchConfig,
    dtype: str,
    device: str,
    tap_layer_ids: tuple[int, ...],
    backend: str,
    ep: ExpertParallel | None = None,
) -> Qwen3ForCausalLM:
    with torch.device("meta"):
        model = Qwen3ForCausalLM(cfg, create_backend(backend), tap_layer_ids, ep)
    model = model.to_empty(device=device).to(torch_dtype(dtype))
    if cfg.tie_word_embeddings:  # to_empty breaks the parameter sharing; restore it
        model.lm_head.weight = model.model.embed_tokens.weight
    return model.eval()


def safetensors_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.is_file():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        files = [path / n for n in names]
    else:
        files = sorted(path.glob("*.safetensors"))
    missing = [str(f) for f in files if not f.is_file()]
    if missing:
        raise ConfigError(f"checkpoint shards listed in the index are missing: {missing}")
    if not files:
        raise ConfigError(f"model path {str(path)!r} has no *.safetensors weights")
    return files


def read_state_dict(path: Path) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for f in safetensors_files(path):
        with safe_open(str(f), framework="pt") as fh:
            for k in fh.keys():  # noqa: SIM118 (safe_open is not a mapping)
                out[k] = fh.get_tensor(k)
    return out


def fuse_experts(sd: dict[str, torch.Tensor], num_experts: int) -> dict[str, torch.Tensor]:
    """Hub layout (experts.N.{gate,up,down}_proj.weight) -> fused gate_up_proj / down_proj."""
    grouped: dict[str, dict[int, dict[str, torch.Tensor]]] = {}
    out: dict[str, torch.Tensor] = {}
    for k, v in sd.items():
        m = _PER_EXPERT.match(k)
        if m:
            grouped.setdefault(m[1], {}).setdefault(int(m[2]), {})[m[3]] = v
        else:
            out[k] = v
    for prefix, experts in grouped.items():
        ids = sorted(experts)
        if ids != list(range(num_experts)) or any(len(experts[i]) != 3 for i in ids):
            raise ConfigError(
                f"{prefix}: checkpoint has experts {ids[:4]}...{ids[-2:]} with incomplete "
                f"projections; config says num_experts={num_experts}"
            )
        out[f"{prefix}.gate_up_proj"] = torch.stack(
            [torch.cat([experts[i]["gate_proj"], experts[i]["up_proj"]], 0) for i in ids]
        )
        out[f"{prefix}.down_proj"] = torch.stack([experts[i]["down_proj"] for i in ids])
    return out


def load_weights(
    model: Qwen3ForCausalLM, sd: dict[str, torch.Tensor], ep: ExpertParallel | None = None
) -> None:
    cfg = model.cfg
    if cfg.is_moe:
        sd = fuse_experts(sd, cfg.num_experts)
    if ep is not None:  # keep this rank's contiguous block of every layer's experts
        lo, hi = ep.expert_range(cfg.num_experts)
        sd = {k: v[lo:hi] if k.endswith(_FUSED) else v for k, v in sd.items()}
    params = dict(model.named_parameters(remove_duplicate=False))
    if cfg.tie_word_embeddings:
        sd.pop("lm_head.weight", None)  # tied: the embedding is the head
        params.pop("lm_head.weight")
    _copy_checked(params, sd)


def _copy_checked(params: dict[str, torch.nn.Parameter], sd: dict[str, torch.Tensor]) -> None:
    unexpected = sorted(set(sd) - set(params))
    missing = sorted(set(params) - set(sd))
    if unexpected or missing:
        raise ConfigError(
            "checkpoint does not match config.json: "
            f"missing {missing[:5]}{'...' if len(missing) > 5 else ''}, "
            f"unexpected {unexpected[:5]}{'...' if len(unexpected) > 5 else ''}"
        )
    with torch.no_grad():
        for name, p in params.items():
            t = sd[name]
            if tuple(t.shape) != tuple(p.shape):
                raise ConfigError(
                    f"weight {name} has shape {tuple(t.shape)} but config.json implies "
                    f"{tuple(p.shape)}"
                )
            p.copy_(t.to(p.dtype))


def load_target(
    path: str | Path,
    dtype: str = "float32",
    device: str = "cpu",
    tap_layer_ids: tuple[int, ...] = (),
    backend: str = "torch_sdpa",
    ep: ExpertParallel | None = None,
) -> Qwen3ForCausalLM:
    p = Path(path)
    cfg = ArchConfig.from_model_path(p)
    model = build_target(cfg, dtype, device, tap_layer_ids, backend, ep)
    load_weights(model, read_state_dict(p), ep)
    return model


def read_draft_arch(path: str | Path) -> DraftArch:
    p = Path(path)
    cfg = p / "config.json"
    if not cfg.is_file():
        raise ConfigError(f"drafter path {str(p)!r} has no config.json")
    try:
        return DraftArch.from_hf_dict(json.loads(cfg.read_text()))
    except json.JSONDecodeError as e:
        raise ConfigError(f"{cfg} is not valid JSON: {e}") from None


def load_drafter(
    path: str | Path, target: Qwen3ForCausalLM, dtype: torch.dtype | None = None
) -> DSparkDrafter:
    """A DeepSpec-layout drafter folder; embedding and LM head alias the target's when absent.

    Released DeepSpec checkpoints store frozen copies of both (deepspec_spec.md §2.3); they are
    loaded as stored. Weights take `dtype` (default: the target's) and the target's device; a
    drafter in another dtype than the target gets its own converted copy of what it aliases.
    """
    cfg = read_draft_arch(path)
    cfg.check_target(target.cfg)
    p = target.lm_head.weight
    dtype = p.dtype if dtype is None else dtype
    with torch.device("meta"):
        model = DSparkDrafter(cfg)
    model = model.to_empty(device=p.device).to(dtype)
    sd = read_state_dict(Path(path))
    params = dict(model.named_parameters())
    for name, src in (
        ("embed_tokens.weight", target.model.embed_tokens),
        ("lm_head.weight", target.lm_head),
    ):
        if name not in sd:
            module = model.embed_tokens if name.startswith("embed") else model.lm_head
            if src.weight.dtype == dtype:
                module.weight = src.weight
            else:
                module.weight = torch.nn.Parameter(src.weight.detach().to(dtype), False)
            params.pop(name)
    _copy_checked(params, sd)
    return model.eval()
