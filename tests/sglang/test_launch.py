"""`launch_server --engine sglang` and the launch/ recipes: every generated command parses with
SGLang's own ServerArgs parser or sglang_router's parser, with the values we meant."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path
from types import SimpleNamespace as NS

import pytest

from dspark_sglang.config import ConfigError
from dspark_sglang.launch_server import build_parser, main
from dspark_sglang.sglang_launch import (
    Command,
    commands,
    convert_files,
    deployment_from_args,
    load_deployment,
)
from dspark_sglang.sglang_plugin.control import PluginConfig

ROOT = Path(__file__).resolve().parents[2]
RECIPES = sorted((ROOT / "launch").glob("sglang_*.yaml"))


def parse_server(cmd: Command) -> object:
    from sglang.srt.server_args import prepare_server_args

    assert cmd.argv[1:3] == ("-m", "sglang.launch_server")
    return prepare_server_args(list(cmd.argv[3:]))


def parse_router(cmd: Command) -> object:
    from sglang_router.launch_router import parse_router_args

    assert cmd.argv[1:3] == ("-m", "sglang_router.launch_router")
    return parse_router_args(list(cmd.argv[3:]))


def check(cmds: list[Command]) -> None:
    """Each server command parses to what it says; the router knows every server."""
    servers = [c for c in cmds if c.role != "router"]
    for c in servers:
        sa = parse_server(c)
        env = dict(c.env)
        assert sa.speculative_algorithm == "DSPARK"
        assert sa.disaggregation_mode == c.role
        assert sa.disaggregation_transfer_backend in ("mooncake", "nixl")
        if c.role == "decode":
            assert env["SGLANG_PLUGINS"] == "dspark"
            assert env["SGLANG_RAGGED_VERIFY_MODE"] in ("compact", "static")
            cfg = PluginConfig.from_env(env)
            assert cfg.profile is None or Path(cfg.profile).is_file()
            if sa.speculative_dspark_sps_table_path:
                assert Path(sa.speculative_dspark_sps_table_path).is_file()
        if sa.nnodes > 1:
            assert sa.node_rank == c.node_rank and sa.dist_init_addr
    (router,) = [c for c in cmds if c.role == "router"]
    ra = parse_router(router)
    assert ra.pd_disaggregation
    assert len(ra.prefill_urls) == sum(c.role == "prefill" and c.node_rank == 0 for c in cmds)
    assert len(ra.decode_urls) == sum(c.role == "decode" and c.node_rank == 0 for c in cmds)


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda p: p.name)
def test_recipes_generate_commands_sglang_accepts(
    recipe: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(ROOT)  # recipes name repository-relative profiles
    dep = load_deployment(recipe)
    dep = type(dep)(**{**{k: getattr(dep, k) for k in dep.__slots__}, "output_dir": str(tmp_path)})
    cmds = commands(dep, *convert_files(dep))
    check(cmds)
    if "multi_node" in recipe.name:
        decode = [parse_server(c) for c in cmds if c.role == "decode"]
        assert [d.node_rank for d in decode] == [0, 1, 2, 3]
        assert {(d.tp_size, d.ep_size, d.attn_dp_size, d.nnodes) for d in decode} == {
            (32, 32, 4, 4)
        }
        assert decode[0].enable_dp_lm_head and decode[0].dist_init_addr == "10.0.1.1:5000"


def test_launch_server_engine_sglang_from_flags(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    profile = ROOT / "engine_profiles" / "dsv4-like-h200-ep8.yaml"
    argv = ["--engine", "sglang", "--model-path", "/models/m", "--capacity-profile", str(profile)]
    argv += ["--schedule-mode", "lagged:3", "--num-decode-workers", "2", "--port", "9000"]
    assert main([*argv, "--dry-run"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len([x for x in lines if x.startswith("# ")]) == 4  # prefill, 2 decode, router
    dep = deployment_from_args(build_parser().parse_args(argv))  # the same, as objects
    cmds = commands(dep, *convert_files(dep))
    check(cmds)
    dec = [c for c in cmds if c.role == "decode"]
    assert dict(dec[0].env)["SGLANG_DSPARK_CONFIDENCE_RELAY_LAG_STEPS"] == "3"
    assert [parse_server(c).base_gpu_id for c in dec] == [1, 2]
    # One role at a time (what each node runs), here printed instead of exec'd.
    assert main([*argv, "--role", "decode", "--worker-index", "1", "--dry-run"]) == 0
    assert "--port 9003" in capsys.readouterr().out


def test_verify_all_maps_to_static_and_other_modes_are_refused(
    capsys: pytest.CaptureFixture[str],
) -> None:
    args = NS(
        model_path="/m",
        draft_model_path=None,
        ep_size=1,
        num_prefill_workers=1,
        num_decode_workers=1,
        port=8000,
        host="0.0.0.0",
        capacity_profile=None,
        schedule_mode="verify-all",
        min_user_tps=0.0,
    )
    cmds = commands(deployment_from_args(args), None, None)
    assert dict(cmds[1].env)["SGLANG_RAGGED_VERIFY_MODE"] == "static"
    assert main(["--engine", "sglang", "--model-path", "/m", "--schedule-mode", "sync"]) == 2
    assert "not supported with --engine sglang" in capsys.readouterr().err


def test_deployment_errors_name_the_field(tmp_path: Path) -> None:
    bad = tmp_path / "d.yaml"
    bad.write_text("model_path: /m\nprefill: [{port: 1, tpp: 2}]\ndecode: [{}]\n")
    with pytest.raises(ConfigError, match=r"prefill\[0\]\.tpp: unknown field"):
        load_deployment(bad)
    bad.write_text("model_path: /m\nprefill: [{}]\ndecode: [{ep: 4}]\n")
    with pytest.raises(ConfigError, match=r"decode\[0\]: need dp dividing tp and ep <= tp"):
        load_deployment(bad)


def test_shell_recipes_are_valid_bash() -> None:
    for sh in sorted((ROOT / "launch").glob("*sglang*.sh")):
        subprocess.run(["bash", "-n", str(sh)], check=True)
        assert os.access(sh, os.X_OK), f"{sh.name} is not executable"


def test_role_all_stops_every_process_when_one_exits() -> None:
    import sys
    import time

    from dspark_sglang.sglang_launch import _run_all

    quit3 = Command("prefill", 0, 0, (sys.executable, "-c", "raise SystemExit(3)"))
    sleeper = Command("decode", 0, 0, (sys.executable, "-c", "import time; time.sleep(60)"))
    t = time.monotonic()
    assert _run_all([sleeper, quit3]) == 3
    assert time.monotonic() - t < 30
