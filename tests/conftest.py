"""Shared fixtures: small random Qwen3 / Qwen3-MoE checkpoints written by transformers."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from dspark_sglang.config import ArchConfig

VOCAB = 128


def _randomize(model: torch.nn.Module, seed: int) -> None:
    # HF's init (std 0.02) makes tiny models emit one token forever; larger weights give
    # varied argmaxes so parity and generation tests actually discriminate.
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(0.15 * torch.randn(p.shape, generator=g))


def write_hf_model(path: Path, moe: bool, seed: int = 0, **overrides: object) -> Path:
    from transformers import Qwen3Config, Qwen3ForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

    common = dict(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=512,
        rope_theta=10000.0,
        eos_token_id=None,
    )
    if moe:
        common.update(
            num_experts=6,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            norm_topk_prob=True,
            mlp_only_layers=[1],
            tie_word_embeddings=True,
        )
    else:
        common.update(tie_word_embeddings=False)
    common.update(overrides)
    torch.manual_seed(seed)
    model = (
        Qwen3MoeForCausalLM(Qwen3MoeConfig(**common))
        if moe
        else Qwen3ForCausalLM(Qwen3Config(**common))
    )
    _randomize(model, seed)
    model.eval().save_pretrained(path)
    return path


@pytest.fixture(scope="session", params=["dense", "moe"])
def hf_model_dir(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    moe = request.param == "moe"
    return write_hf_model(tmp_path_factory.mktemp(request.param), moe=moe)


def hf_reference(path: Path) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def write_char_tokenizer(path: Path) -> None:
    """A character-level tokenizer.json covering the 128-token test vocabulary."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = {(chr(32 + i) if i < 95 else f"<x{i}>"): i for i in range(VOCAB - 1)}
    vocab["<|endoftext|>"] = VOCAB - 1
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<|endoftext|>"))
    tok.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    tok.decoder = decoders.Fuse()
    tok.save(str(path / "tokenizer.json"))


def drafter_config(target_dir: Path, kind: str = "dspark", **overrides: object) -> dict:
    """A DeepSpec-style drafter config.json derived from a target folder (deepspec_spec.md §1.8)."""
    import json

    t = json.loads((target_dir / "config.json").read_text())
    cfg = {
        "architectures": ["Qwen3DSparkModel"],
        "vocab_size": t["vocab_size"],
        "hidden_size": t["hidden_size"],
        "num_hidden_layers": 2,
        "num_attention_heads": t["num_attention_heads"],
        "num_key_value_heads": t["num_key_value_heads"],
        "head_dim": t["head_dim"],
        "intermediate_size": t["intermediate_size"],
        "rms_norm_eps": t.get("rms_norm_eps", 1e-6),
        "rope_parameters": t.get("rope_parameters", {"rope_theta": 10000.0}),
        "num_target_layers": t["num_hidden_layers"],
        "block_size": 4,
        "mask_token_id": t["vocab_size"] - 2,
        "target_layer_ids": [0, 1],
        "tie_word_embeddings": False,
    }
    if kind != "dflash":
        cfg.update(
            markov_rank=8,
            markov_head_type={"dspark": "vanilla"}.get(kind, kind),
            enable_confidence_head=True,
            confidence_head_with_markov=True,
        )
    cfg.update(overrides)
    return cfg


def write_drafter(
    path: Path,
    target_dir: Path,
    kind: str = "dspark",
    seed: int = 0,
    with_embeddings: bool = False,
    **overrides: object,
) -> Path:
    import json

    from safetensors.torch import save_file

    from dspark_sglang.config import DraftArch
    from dspark_sglang.models.drafter import DSparkDrafter

    cfg = drafter_config(target_dir, kind, **overrides)
    model = DSparkDrafter(DraftArch.from_hf_dict(cfg))
    _randomize(model, seed)
    sd = {k: v.contiguous() for k, v in model.state_dict().items()}
    if not with_embeddings:
        sd = {k: v for k, v in sd.items() if k not in ("embed_tokens.weight", "lm_head.weight")}
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(cfg))
    save_file(sd, str(path / "model.safetensors"))
    return path


CHATML = (
    "{% for m in messages %}<x95>{{ m['role'] }}\n{{ m['content'] }}<x96>\n{% endfor %}"
    "{% if add_generation_prompt %}<x95>assistant\n{% endif %}"
)


def write_model_pair(root: Path, chat: bool = False, **target: object) -> tuple[Path, Path]:
    """A small MoE target with the character tokenizer (and the ChatML template when `chat`),
    and a block-4 DSpark drafter for it: (target dir, drafter dir) under `root`."""
    import json

    path = write_hf_model(root / "t", moe=True, **target)
    write_char_tokenizer(path)
    if chat:
        (path / "tokenizer_config.json").write_text(json.dumps({"chat_template": CHATML}))
    return path, write_drafter(root / "d", path, block_size=4)


# The test models are tiny: one thread is faster than two and immune to a busy machine.
torch.set_num_threads(1)


def moe_arch(**overrides: object) -> ArchConfig:
    """A one-layer Qwen3-MoE geometry for module-level tests (4 experts, top-2)."""
    fields: dict[str, object] = dict(
        architecture="Qwen3MoeForCausalLM",
        vocab_size=32,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=32,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        max_position_embeddings=64,
        tie_word_embeddings=False,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=96,
    )
    fields.update(overrides)
    return ArchConfig(**fields)
