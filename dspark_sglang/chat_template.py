"""Chat prompts: render a model folder's `chat_template` (tokenizer_config.json) with jinja2.

Shared by the offline evaluator and the HTTP API; no torch, no engine.
"""

from __future__ import annotations

import json
from functools import lru_cache
from pathlib import Path

from dspark_sglang.config import ConfigError


@lru_cache(maxsize=8)
def _template(model_path: str) -> tuple[object, dict[str, str]]:
    import jinja2
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    f = Path(model_path) / "tokenizer_config.json"
    if not f.is_file():
        raise ConfigError(f"{model_path} has no tokenizer_config.json with a chat_template")
    cfg = json.loads(f.read_text())
    text = cfg.get("chat_template")
    if not text:
        raise ConfigError(f"{f} has no chat_template")
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    try:
        tmpl = env.from_string(text)
    except jinja2.TemplateSyntaxError as e:
        raise ConfigError(f"chat_template in {f} does not parse: {e}") from None
    specials = {k: cfg[k] for k in ("bos_token", "eos_token") if isinstance(cfg.get(k), str)}
    return tmpl, specials


def render_chat(
    model_path: str, messages: list[dict[str, str]], add_generation_prompt: bool = True
) -> str:
    tmpl, specials = _template(model_path)
    return tmpl.render(  # type: ignore[attr-defined]
        messages=messages, add_generation_prompt=add_generation_prompt, **specials
    )
