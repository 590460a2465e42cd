"""SGLang plugin: our lagged verify budget and live EP-aware capacity model inside SGLang 0.5.23's
DSPARK (docs/sglang.md). Entry point group `sglang.srt.plugins`, name `dspark`; SGLang calls
`register()` in every engine, scheduler, DP-controller and detokenizer process. Importing this
package does not import sglang; register() does, after checking it is the version we hook."""

from __future__ import annotations

import logging

log = logging.getLogger("dspark_sglang.sglang_plugin")
_installed = False


def register() -> bool:
    """Self-test the hooked names, then register the hooks (SGLang applies them right after).
    On another SGLang: exit the process with the self-test's message (DSPARK_SGLANG_ON_MISMATCH=
    exit, the default; SGLang would only log an exception), or return False and leave SGLang's
    own planner running (=skip). Idempotent within a process."""
    global _installed
    from dspark_sglang.config import ConfigError
    from dspark_sglang.sglang_plugin.control import PluginConfig

    if _installed:
        return True
    try:
        cfg = PluginConfig.from_env()
    except ConfigError as e:
        raise SystemExit(f"dspark_sglang plugin: {e}") from None
    from dspark_sglang.sglang_plugin import hooks

    try:
        hooks.self_test()
    except hooks.PluginRefused as e:
        log.error("%s", e)
        if cfg.on_mismatch == "skip":
            return False
        raise SystemExit(str(e)) from None
    hooks.install(cfg)
    _installed = True
    log.info("dspark_sglang plugin registered (sglang %s)", hooks.SGLANG_VERSION)
    return True
