"""Package data: the bundled tiny Qwen3-MoE target (HF model folder) and, later, its drafters.

Imports nothing from the package; `python -m dspark_sglang.assets path` prints the target folder.
"""

from __future__ import annotations

from pathlib import Path

ASSETS_DIR = Path(__file__).resolve().parent
TINY_MOE = "tiny-moe"


def bundled_target_dir() -> Path:
    """The bundled target's HF folder (config.json, model.safetensors, tokenizer.json)."""
    return ASSETS_DIR / TINY_MOE
