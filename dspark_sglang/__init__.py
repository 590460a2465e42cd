"""dspark-sglang: DSpark speculative decoding serving stack."""

from __future__ import annotations

from dspark_sglang.config import Config
from dspark_sglang.types import SamplingParams

__all__ = ["LLM", "Config", "SamplingParams"]


def __getattr__(name: str):  # LLM pulls in torch; import it only when asked for
    if name == "LLM":
        from dspark_sglang.engine.engine import LLM

        return LLM
    raise AttributeError(name)
