"""serve.launch: CPU lists, and pinning a process to its configured CPUs."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import msgspec
import pytest

from dspark_sglang.config import (
    Config,
    ConfigError,
    ModelConfig,
    ServeConfig,
    format_cpu_list,
    parse_cpu_list,
)
from dspark_sglang.serve.launch import CPUS_ENV


@pytest.mark.parametrize(
    ("text", "cpus", "canon"),
    [
        ("0", (0,), "0"),
        ("0-3,8", (0, 1, 2, 3, 8), "0-3,8"),
        (" 5, 1-2 ,2", (1, 2, 5), "1-2,5"),
        ("7-7", (7,), "7"),
    ],
)
def test_cpu_lists_round_trip(text: str, cpus: tuple[int, ...], canon: str) -> None:
    assert parse_cpu_list(text, "--x") == cpus
    assert format_cpu_list(cpus) == canon
    assert parse_cpu_list(canon, "--x") == cpus


@pytest.mark.parametrize("text", ["", "a", "1-", "3-1", "-2", "1,,2", "0-1;2"])
def test_bad_cpu_lists_name_the_flag(text: str) -> None:
    with pytest.raises(ConfigError, match="--decode-cpus"):
        parse_cpu_list(text, "--decode-cpus")


def test_cpus_per_role_and_worker() -> None:
    two = ("tcp://127.0.0.1:1", "tcp://127.0.0.1:2")
    s = ServeConfig(
        decode_addrs=two, router_cpus=(0,), prefill_cpus=((1,),), decode_cpus=((2,), (3, 4))
    )
    assert s.cpus_for("router") == (0,)
    assert s.cpus_for("prefill", 0) == (1,)  # one list: every prefill worker
    assert s.cpus_for("decode", 0) == (2,) and s.cpus_for("decode", 1) == (3, 4)
    assert ServeConfig().cpus_for("decode", 0) == ()
    with pytest.raises(ConfigError, match="--decode-cpus: give one CPU list"):
        ServeConfig(decode_cpus=((0,), (1,)))  # two lists, one decode worker
    with pytest.raises(ConfigError, match="--prefill-cpus: each CPU list"):
        ServeConfig(prefill_cpus=((),))


_PIN = (
    "import json, os, sys, msgspec\n"
    "from dspark_sglang.config import Config\n"
    "from dspark_sglang.serve.launch import pin\n"
    "cfg = msgspec.json.decode(sys.stdin.buffer.read(), type=Config)\n"
    "got = pin(cfg, sys.argv[1], int(sys.argv[2]))\n"
    "print(json.dumps([sorted(got), sorted(os.sched_getaffinity(0))]))\n"
)


def _pin_in_child(serve: ServeConfig, role: str, index: int = 0, env_cpus: str | None = None):
    """pin() in a fresh interpreter (it changes the affinity of the process that calls it)."""
    env = {k: v for k, v in os.environ.items() if k != CPUS_ENV}
    if env_cpus is not None:
        env[CPUS_ENV] = env_cpus
    cfg = Config(model=ModelConfig(path="unused"), serve=serve)
    return subprocess.run(
        [sys.executable, "-c", _PIN, role, str(index)],
        input=msgspec.json.encode(cfg),
        capture_output=True,
        env=env,
        timeout=60,
    )


needs_affinity = pytest.mark.skipif(
    not hasattr(os, "sched_setaffinity"), reason="CPU affinity is a Linux call"
)


@needs_affinity
def test_pin_sets_the_configured_cpus() -> None:
    cpu = min(os.sched_getaffinity(0))
    out = _pin_in_child(ServeConfig(decode_cpus=((cpu,),)), "decode")
    assert out.returncode == 0, out.stderr.decode()
    assert json.loads(out.stdout) == [[cpu], [cpu]]


@needs_affinity
def test_unconfigured_child_takes_the_launchers_cpus_not_the_routers() -> None:
    cpu = min(os.sched_getaffinity(0))
    # run_all's children read the launcher's CPUs from CPUS_ENV: a worker restarted after the
    # router pinned itself would otherwise inherit the router's
    out = _pin_in_child(ServeConfig(router_cpus=(cpu,)), "prefill", env_cpus=str(cpu))
    assert out.returncode == 0, out.stderr.decode()
    assert json.loads(out.stdout) == [[cpu], [cpu]]
    out = _pin_in_child(ServeConfig(), "prefill")  # nothing configured, no launcher: untouched
    assert out.returncode == 0, out.stderr.decode()
    assert json.loads(out.stdout) == [[], sorted(os.sched_getaffinity(0))]


@needs_affinity
def test_a_refused_pin_is_a_clear_error() -> None:
    out = _pin_in_child(ServeConfig(decode_cpus=((4095,),)), "decode")
    assert out.returncode != 0
    err = out.stderr.decode()
    assert "--decode-cpus 4095" in err and "refused" in err and "Traceback" not in err


def test_a_workers_log_lines_name_the_worker() -> None:
    """Every worker of a deployment logs into one stream: a line carries its process's name
    (decode0, prefill1), so what one worker measured at load can be told from another's."""
    code = (
        "import logging; from dspark_sglang.serve import launch; launch._logging('decode0'); "
        "logging.getLogger('dspark_sglang.engine.runner').info('--cpu-gemm auto: x')"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, timeout=60)
    assert out.returncode == 0, out.stderr.decode()
    assert "INFO decode0 dspark_sglang.engine.runner: --cpu-gemm auto: x" in out.stderr.decode()
