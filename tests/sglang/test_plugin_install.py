"""The plugin is found through the `sglang.srt.plugins` entry point, installs every hook, and its
self-test refuses an SGLang it was not written against."""

from __future__ import annotations

import pkgutil

import pytest

from dspark_sglang.sglang_plugin import hooks
from tests.sglang.conftest import ENTRY, declared_entry_point


def test_entry_point_resolves_to_register() -> None:
    from dspark_sglang.sglang_plugin import register

    ep = declared_entry_point() or ENTRY
    assert ep.value == "dspark_sglang.sglang_plugin:register"
    assert ep.load() is register


def test_plugin_installs_every_hook(plugin: object) -> None:
    from sglang.srt.plugins.hook_registry import HookRegistry
    from sglang.srt.speculative.dspark_components import dspark_planner

    ours = {t for t, hs in HookRegistry._hooks.items() if any(s and s.plugin_name == "dspark"
            for _, _, s in hs)}  # fmt: skip
    expected = {
        hooks.PLANNER + "HostConfidenceBudgetPlanner",
        hooks.PLANNER + "build_sps_cost_table",
        hooks.PLANNER + "DSparkVerifyPlanner.prepare_verify_budget",
        hooks.PLANNER + "DSparkVerifyPlanner.compute_budget_sync",
        hooks.OBSERVERS + "observe_verify_step",
        hooks.OBSERVERS + "note_prefill_step",
        hooks.OBSERVERS + "note_idle_decode_step",
        hooks.RESULTS + "_resolve_spec_v2_tokens",
        hooks.RECEIVER + "recv_requests",
        hooks.RECEIVER + "_pull_raw_reqs",
        hooks.SCHEDULER + "process_input_requests",
        hooks.CONTROLLER + "_update_handlers",
        hooks.CONTROLLER + "_add_speculative",
    }
    assert ours == expected
    assert expected <= HookRegistry._patched  # applied, not just registered
    planner_cls = dspark_planner.HostConfidenceBudgetPlanner
    assert planner_cls.__name__ == "DsparkBudgetPlanner"
    # DSparkVerifyPlanner builds whatever the module name holds at call time: ours.
    observe = pkgutil.resolve_name(hooks.OBSERVERS + "observe_verify_step")
    assert observe.__wrapped__ is not observe


def test_self_test_passes_on_the_pinned_version_even_after_patching(plugin: object) -> None:
    hooks.self_test()


def test_self_test_refuses_another_version(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(hooks, "version", lambda name: "0.5.24")
    with pytest.raises(hooks.PluginRefused) as e:
        hooks.self_test()
    msg = str(e.value)
    assert "sglang 0.5.24 is installed; this plugin supports 0.5.23" in msg
    assert "Install sglang==0.5.23" in msg and "SGLANG_PLUGINS" in msg


def test_self_test_names_a_changed_signature_and_a_missing_name(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    sig = dict(hooks.SIGNATURES)
    sig[hooks.OBSERVERS + "note_prefill_step"] = "self step"
    sig[hooks.PLANNER + "compute_budget_v2"] = "self"
    monkeypatch.setattr(hooks, "SIGNATURES", sig)
    with pytest.raises(hooks.PluginRefused) as e:
        hooks.self_test()
    msg = str(e.value)
    assert "note_prefill_step: signature ('self',), expected (self step)" in msg
    assert "compute_budget_v2: missing" in msg


def test_register_exits_with_the_message_or_skips(monkeypatch: pytest.MonkeyPatch) -> None:
    import dspark_sglang.sglang_plugin as plugin_pkg

    monkeypatch.setattr(plugin_pkg, "_installed", False)
    monkeypatch.setattr(hooks, "version", lambda name: "0.6.0")
    monkeypatch.setattr(hooks, "install", lambda cfg: pytest.fail("must not install"))
    with pytest.raises(SystemExit) as e:
        plugin_pkg.register()
    assert "sglang 0.6.0 is installed" in str(e.value.code)
    monkeypatch.setenv("DSPARK_SGLANG_ON_MISMATCH", "skip")
    assert plugin_pkg.register() is False
    monkeypatch.setenv("DSPARK_SGLANG_MIN_USER_TPS", "-1")
    with pytest.raises(SystemExit, match="MIN_USER_TPS"):
        plugin_pkg.register()
