"""`python -m dspark_sglang.launch_server --engine sglang`: an SGLang PD deployment -> the exact
commands that run it (docs/sglang.md §4). Prefill servers (`--disaggregation-mode prefill`),
decode servers (DSPARK, SGLANG_RAGGED_VERIFY_MODE=compact, our plugin), `sglang_router
--pd-disaggregation`; one node or many (`--nnodes --node-rank --dist-init-addr`). The deployment is
a YAML an operator edits (launch/sglang_*.yaml) or, for one node, the launch_server flags. Our
profile and STS files are converted to SGLang's formats next to the commands. No sglang import:
the commands are strings; tests/sglang checks they parse with SGLang's own parsers."""

from __future__ import annotations

import argparse
import json
import os
import shlex
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from dspark_sglang.algo.verify_budget import parse_schedule_mode
from dspark_sglang.config import ConfigError

BACKENDS = ("mooncake", "nixl")
PLUGIN_NAME = "dspark"  # our entry point under sglang.srt.plugins


@dataclass(frozen=True, slots=True)
class Server:
    """One SGLang server (prefill or decode); `nodes` lists its hosts when it spans several."""

    host: str = "127.0.0.1"
    port: int = 30000
    tp: int = 1
    ep: int = 1
    dp: int = 1  # attention data parallelism (--attn-dp-size)
    base_gpu_id: int = 0
    nodes: tuple[str, ...] = ()
    dist_init_port: int = 5000
    bootstrap_port: int = 8998  # prefill only: where decode servers fetch KV handles
    extra_args: tuple[str, ...] = ()

    @property
    def url(self) -> str:
        host = self.nodes[0] if self.nodes else self.host
        return f"http://{'127.0.0.1' if host == '0.0.0.0' else host}:{self.port}"


@dataclass(frozen=True, slots=True)
class Deployment:
    model_path: str
    prefill: tuple[Server, ...]
    decode: tuple[Server, ...]
    name: str = "dspark-pd"
    draft_model_path: str | None = None
    profile: str | None = None  # our engine_profiles YAML (or SGLang SPS JSON)
    sts: str | None = None  # our sts.json (or SGLang's STS JSON)
    schedule_mode: str = "lagged"  # lagged[:L] -> compact + our plugin; verify-all -> static
    min_user_tps: float = 0.0
    live_capacity: bool = True
    transfer_backend: str = "mooncake"
    ib_device: str | None = None
    output_dir: str = "build/sglang"
    python: str = "python3"
    router: dict[str, Any] = field(default_factory=dict)  # host, port, policy, extra_args
    env: dict[str, str] = field(default_factory=dict)  # for every server


@dataclass(frozen=True, slots=True)
class Command:
    role: str  # prefill | decode | router
    index: int
    node_rank: int
    argv: tuple[str, ...]
    env: tuple[tuple[str, str], ...] = ()

    def shell(self) -> str:
        env = " ".join(f"{k}={shlex.quote(v)}" for k, v in self.env)
        return (env + " " if env else "") + shlex.join(self.argv)


def _server(d: Any, where: str) -> Server:
    if not isinstance(d, dict):
        raise ConfigError(f"{where}: expected a mapping")
    known = set(Server.__slots__)  # type: ignore[attr-defined]
    if extra := sorted(set(d) - known):
        raise ConfigError(f"{where}.{extra[0]}: unknown field (expected {', '.join(known)})")
    kw = dict(d)
    for k in ("nodes", "extra_args"):
        if k in kw:
            kw[k] = tuple(str(x) for x in kw[k] or ())
    s = Server(**kw)
    for k in ("port", "tp", "ep", "dp", "dist_init_port", "bootstrap_port"):
        if not isinstance(getattr(s, k), int) or getattr(s, k) < 1:
            raise ConfigError(f"{where}.{k}: expected a positive integer, got {getattr(s, k)!r}")
    if s.tp % s.dp or s.ep > s.tp:
        raise ConfigError(f"{where}: need dp dividing tp and ep <= tp (tp={s.tp}, ep={s.ep})")
    return s


def deployment_from_dict(d: Any) -> Deployment:
    """Validate the YAML mapping; errors name the field, like engine profiles do."""
    if not isinstance(d, dict):
        raise ConfigError("deployment: expected a mapping")
    known = set(Deployment.__slots__)  # type: ignore[attr-defined]
    if extra := sorted(set(d) - known):
        raise ConfigError(f"{extra[0]}: unknown field (expected {', '.join(sorted(known))})")
    if "model_path" not in d:
        raise ConfigError("model_path: missing")
    kw = dict(d)
    for role in ("prefill", "decode"):
        items = kw.get(role) or []
        if not isinstance(items, list) or not items:
            raise ConfigError(f"{role}: expected a non-empty list of servers")
        kw[role] = tuple(_server(s, f"{role}[{i}]") for i, s in enumerate(items))
    dep = Deployment(**kw)
    if dep.transfer_backend not in BACKENDS:
        raise ConfigError(f"transfer_backend: expected one of {list(BACKENDS)}")
    _verify_mode(dep.schedule_mode)
    return dep


def load_deployment(path: str | Path) -> Deployment:
    try:
        data = yaml.safe_load(Path(path).read_text())
    except (OSError, yaml.YAMLError) as e:
        raise ConfigError(f"{path}: cannot read deployment: {e}") from None
    try:
        return deployment_from_dict(data)
    except (ConfigError, TypeError) as e:
        raise ConfigError(f"{path}: {e}") from None


def deployment_from_args(args: argparse.Namespace) -> Deployment:
    """One node from the launch_server flags: each server gets --ep-size GPUs (TP = EP), prefill
    servers first; the router serves --host/--port, servers take the next ports."""
    if not args.model_path:
        raise ConfigError("--engine sglang: pass --model-path (the checkpoint SGLang serves)")
    n = max(1, args.ep_size)
    pre = tuple(
        Server(port=args.port + 1 + i, tp=n, ep=n, base_gpu_id=i * n, bootstrap_port=8998 + i)
        for i in range(args.num_prefill_workers)
    )
    first = len(pre)
    dec = tuple(
        Server(port=args.port + 1 + first + j, tp=n, ep=n, base_gpu_id=(first + j) * n)
        for j in range(args.num_decode_workers)
    )
    return Deployment(
        model_path=args.model_path,
        draft_model_path=args.draft_model_path,
        prefill=pre,
        decode=dec,
        profile=args.capacity_profile,
        schedule_mode=args.schedule_mode,
        min_user_tps=args.min_user_tps,
        router={"host": args.host, "port": args.port},
        python=sys.executable,
    )


def _verify_mode(text: str) -> tuple[str, int]:
    mode = parse_schedule_mode(text)
    if mode.name == "lagged":
        return "compact", mode.lag
    if mode.name == "verify-all":
        return "static", 0
    raise ConfigError(
        f"--schedule-mode {text} is not supported with --engine sglang (SGLang's DSPARK runs the "
        "lagged top-K or verify-all); use lagged[:L] or verify-all"
    )


def convert_files(dep: Deployment) -> tuple[str | None, str | None]:
    """Our profile -> SGLang SPS JSON and our sts.json -> SGLang STS JSON in output_dir (SGLang's
    own files pass through). Stock SGLang (plugin off) then plans with the same profile."""
    from dspark_sglang.capacity_profile import load_profile
    from dspark_sglang.sglang_convert import profile_to_sps, sts_to_sglang

    out = Path(dep.output_dir)
    sps = sts = None
    if dep.profile and not dep.profile.endswith(".json"):
        out.mkdir(parents=True, exist_ok=True)
        sps = str((out / "sps_table.json").resolve())
        Path(sps).write_text(json.dumps(profile_to_sps(load_profile(dep.profile)), indent=1))
    elif dep.profile:
        sps = str(Path(dep.profile).resolve())
    if dep.sts:
        data = json.loads(Path(dep.sts).read_text())
        if "num_samples" in data:  # already SGLang's
            sts = str(Path(dep.sts).resolve())
        else:
            out.mkdir(parents=True, exist_ok=True)
            sts = str((out / "sts_sglang.json").resolve())
            Path(sts).write_text(json.dumps(sts_to_sglang(data), indent=1))
    return sps, sts


def _server_argv(dep: Deployment, s: Server, role: str, rank: int) -> list[str]:
    argv = [dep.python, "-m", "sglang.launch_server", "--model-path", dep.model_path]
    argv += ["--host", s.host, "--port", str(s.port), "--tp-size", str(s.tp)]
    argv += ["--base-gpu-id", str(s.base_gpu_id), "--trust-remote-code"]
    if s.ep > 1:
        argv += ["--ep-size", str(s.ep)]
    if s.dp > 1:
        argv += ["--attn-dp-size", str(s.dp), "--enable-dp-lm-head"]
    argv += ["--speculative-algorithm", "DSPARK"]
    if dep.draft_model_path:
        argv += ["--speculative-draft-model-path", dep.draft_model_path]
    argv += ["--disaggregation-mode", role, "--disaggregation-transfer-backend"]
    argv.append(dep.transfer_backend)
    if dep.ib_device:
        argv += ["--disaggregation-ib-device", dep.ib_device]
    if role == "prefill":
        argv += ["--disaggregation-bootstrap-port", str(s.bootstrap_port)]
    if len(s.nodes) > 1:
        argv += ["--nnodes", str(len(s.nodes)), "--node-rank", str(rank)]
        argv += ["--dist-init-addr", f"{s.nodes[0]}:{s.dist_init_port}"]
    return argv


def commands(dep: Deployment, sps: str | None, sts: str | None) -> list[Command]:
    """Every process of the deployment, one Command per (server, node rank), router last."""
    from dspark_sglang.sglang_plugin.control import ENV_PREFIX as P

    mode, lag = _verify_mode(dep.schedule_mode)
    dec_env = {"SGLANG_RAGGED_VERIFY_MODE": mode, "SGLANG_PLUGINS": PLUGIN_NAME}
    dec_env[P + "LIVE"] = "1" if dep.live_capacity else "0"
    dec_env[P + "MIN_USER_TPS"] = repr(float(dep.min_user_tps))
    if dep.profile:
        dec_env[P + "PROFILE"] = str(Path(dep.profile).resolve())
    if lag:
        dec_env["SGLANG_DSPARK_CONFIDENCE_RELAY_LAG_STEPS"] = str(lag)
    out: list[Command] = []
    for role, servers in (("prefill", dep.prefill), ("decode", dep.decode)):
        for i, s in enumerate(servers):
            env = {**dep.env, **(dec_env if role == "decode" else {})}
            for rank in range(max(1, len(s.nodes))):
                argv = _server_argv(dep, s, role, rank)
                if role == "decode" and sps:
                    argv += ["--speculative-dspark-sps-table-path", sps]
                if role == "decode" and sts:
                    argv += ["--speculative-dspark-confidence-sts-path", sts]
                argv += list(s.extra_args)
                out.append(Command(role, i, rank, tuple(argv), tuple(env.items())))
    r = dep.router
    argv = [dep.python, "-m", "sglang_router.launch_router", "--pd-disaggregation"]
    for s in dep.prefill:
        argv += ["--prefill", s.url, str(s.bootstrap_port)]
    for s in dep.decode:
        argv += ["--decode", s.url]
    argv += ["--host", str(r.get("host", "0.0.0.0")), "--port", str(r.get("port", 8000))]
    if r.get("policy"):
        argv += ["--policy", str(r["policy"])]
    argv += [str(a) for a in r.get("extra_args", ())]
    out.append(Command("router", 0, 0, tuple(argv)))
    return out


def _run_all(cmds: list[Command]) -> int:
    """Start every process on this host; stop them all when one exits or on Ctrl-C/SIGTERM."""

    def stop(*_: object) -> None:
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, stop)
    procs = [subprocess.Popen(c.argv, env={**os.environ, **dict(c.env)}) for c in cmds]
    rc = 0
    try:
        while all(p.poll() is None for p in procs):
            time.sleep(0.5)
        rc = next(p.returncode for p in procs if p.returncode is not None)
    except KeyboardInterrupt:
        pass
    finally:
        for p in procs:
            if p.poll() is None:
                p.terminate()
        for p in procs:
            p.wait()
        signal.signal(signal.SIGTERM, previous)
    return rc


def main(args: argparse.Namespace) -> int:
    """launch_server's --engine sglang branch: print (--dry-run), run one role, or run all."""
    try:
        dep = load_deployment(args.sglang_config) if args.sglang_config else None
        dep = dep or deployment_from_args(args)
        cmds = commands(dep, *convert_files(dep))
        if args.role != "all":
            mine = [
                c
                for c in cmds
                if c.role == args.role
                and c.index == args.worker_index
                and c.node_rank == args.node_rank
            ]
            if not mine:
                raise ConfigError(
                    f"no {args.role} server {args.worker_index} node rank {args.node_rank}"
                )
            cmds = mine
        elif any(c.node_rank for c in cmds) and not args.dry_run:
            raise ConfigError("a server spans several nodes: start each --role on its node")
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.dry_run:
        print("\n".join(f"# {c.role} {c.index} node {c.node_rank}\n{c.shell()}" for c in cmds))
        return 0
    if len(cmds) == 1:
        os.execvpe(cmds[0].argv[0], list(cmds[0].argv), {**os.environ, **dict(cmds[0].env)})
    return _run_all(cmds)
