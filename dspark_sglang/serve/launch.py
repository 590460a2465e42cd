"""Spawn and wire the serving processes from one Config: one role here, or `all` on this host.

Children get the Config as JSON on stdin (no pickle, no secrets on argv). Workers import torch;
the router does not, so `--role router` starts in about a second.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.request

import msgspec
import uvicorn

from dspark_sglang.config import Config, format_cpu_list, parse_cpu_list

log = logging.getLogger("dspark_sglang.launch")
MAX_RESTARTS = 5
PARENT_ENV = "DSPARK_PARENT_PID"  # same name as serve.worker.PARENT_ENV (no torch import here)
# The launcher's own CPUs, for a child with none configured: it must not inherit the router's
# (run_all pins the router after its first spawns, and a restarted worker is spawned after that)
CPUS_ENV = "DSPARK_LAUNCHER_CPUS"


def _logging(process: str = "") -> None:
    """`process` (decode0, prefill1, ...) goes on every line: the workers of a deployment share
    one log, and what one of them measured at load (its --cpu-gemm choice) is otherwise not
    attributable to it."""
    who = f"{process} " if process else ""
    logging.basicConfig(
        level=logging.INFO, format=f"%(asctime)s %(levelname)s {who}%(name)s: %(message)s"
    )


def pin(cfg: Config, role: str, index: int = 0) -> tuple[int, ...]:
    """Pin this process to its configured CPUs (else, spawned by run_all, to the launcher's);
    -> the CPUs it was pinned to, () when it was not. Before a worker imports torch, so its
    thread pools size themselves to those CPUs. SystemExit naming the flag when the OS refuses."""
    cpus = cfg.serve.cpus_for(role, index)
    flag = f"--{role}-cpus"
    if not cpus and os.environ.get(CPUS_ENV):
        cpus, flag = parse_cpu_list(os.environ[CPUS_ENV], CPUS_ENV), CPUS_ENV
    if not cpus:
        return ()
    if not hasattr(os, "sched_setaffinity"):
        raise SystemExit(f"error: {flag}: this OS cannot pin a process to CPUs")
    try:
        os.sched_setaffinity(0, cpus)
    except (OSError, ValueError) as e:
        raise SystemExit(f"error: {flag} {format_cpu_list(cpus)}: the OS refused ({e})") from None
    return cpus


def run_role(cfg: Config, role: str, index: int = 0) -> None:
    """Run one process of the deployment in the foreground."""
    _logging("" if role == "router" else f"{role}{index}")
    pinned = pin(cfg, role, index)
    if pinned:
        log.info(
            "%s%s pinned to CPUs %s",
            role,
            "" if role == "router" else index,
            format_cpu_list(pinned),
        )
    # SIGTERM -> SystemExit, so sockets close, finally blocks run and the exit code is 0
    # (uvicorn re-raises the signal it caught once it has shut down).
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    if role == "router":
        server = _server(cfg)
        threading.Thread(target=_announce, args=(cfg, server), daemon=True).start()
        server.run()
        return
    if role == "prefill":
        from dspark_sglang.serve.prefill_worker import run
    else:
        from dspark_sglang.serve.decode_worker import run
    run(cfg, index)


def _server(cfg: Config) -> uvicorn.Server:
    from dspark_sglang.serve.api import create_app

    s = cfg.serve
    return uvicorn.Server(
        uvicorn.Config(
            create_app(cfg),
            host=s.host,
            port=s.port,
            log_level="warning",
            timeout_graceful_shutdown=5,
        )
    )


def _is_ready(cfg: Config) -> bool:
    req = urllib.request.Request(f"http://{cfg.serve.host}:{cfg.serve.port}/ready")
    if cfg.serve.api_key:
        req.add_header("Authorization", f"Bearer {cfg.serve.api_key}")
    try:
        with urllib.request.urlopen(req, timeout=2) as r:
            return r.status == 200
    except OSError:
        return False


def _announce(cfg: Config, server: uvicorn.Server) -> None:
    while not server.should_exit:
        if _is_ready(cfg):
            s = cfg.serve
            print(f"dspark-sglang ready: http://{s.host}:{s.port}/v1 (OpenAI API)", flush=True)
            return
        time.sleep(0.5)


def _own_cpus() -> str:
    try:
        return format_cpu_list(os.sched_getaffinity(0))
    except AttributeError:  # no affinity call on this OS: children pin nothing
        return ""


_LAUNCHER_CPUS = _own_cpus()  # at import, before run_all pins the router


def spawn(cfg: Config, role: str, index: int) -> subprocess.Popen:
    proc = subprocess.Popen(
        [sys.executable, "-m", "dspark_sglang.serve.launch", role, str(index)],
        stdin=subprocess.PIPE,
        env={**os.environ, PARENT_ENV: str(os.getpid()), CPUS_ENV: _LAUNCHER_CPUS},
        start_new_session=True,  # Ctrl-C reaches the launcher, which stops the workers in order
    )
    assert proc.stdin is not None
    proc.stdin.write(msgspec.json.encode(cfg))
    proc.stdin.close()
    return proc


def run_all(cfg: Config) -> int:
    """Router in this process, every configured prefill/decode worker as a child; a worker that
    dies after startup is restarted (it rejoins the router), one that dies before is fatal."""
    _logging()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    roles = [("prefill", i) for i in range(len(cfg.serve.prefill_addrs))]
    roles += [("decode", i) for i in range(len(cfg.serve.decode_addrs))]
    procs = {r: spawn(cfg, *r) for r in roles}
    if cfg.serve.router_cpus:
        log.info("router pinned to CPUs %s", format_cpu_list(pin(cfg, "router")))
    restarts = dict.fromkeys(roles, 0)
    stop = threading.Event()
    ready = threading.Event()
    failed: list[str] = []

    def supervise(server: uvicorn.Server) -> None:
        while not stop.wait(0.5):
            if not ready.is_set() and _is_ready(cfg):
                ready.set()
            for r, p in procs.items():
                if p.poll() is None or stop.is_set():
                    continue
                if not ready.is_set() or restarts[r] >= MAX_RESTARTS:
                    failed.append(f"{r[0]}{r[1]} exited with code {p.returncode}")
                    server.should_exit = True
                    return
                restarts[r] += 1
                log.error("%s%d exited (%s); restarting", *r, p.returncode)
                procs[r] = spawn(cfg, *r)

    server = _server(cfg)
    threading.Thread(target=supervise, args=(server,), daemon=True).start()
    threading.Thread(target=_announce, args=(cfg, server), daemon=True).start()
    try:
        server.run()
    finally:
        stop.set()
        shutdown(list(procs.values()))
    for f in failed:
        print(f"error: {f}; see its log above", file=sys.stderr)
    return 1 if failed else 0


def shutdown(procs: list[subprocess.Popen], grace_s: float = 5.0) -> None:
    """SIGTERM, wait, then SIGKILL whatever is left."""
    for p in procs:
        if p.poll() is None:
            p.terminate()
    deadline = time.monotonic() + grace_s
    for p in procs:
        try:
            p.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


if __name__ == "__main__":  # a child spawned by run_all: `launch ROLE INDEX`, Config on stdin
    config = msgspec.json.decode(sys.stdin.buffer.read(), type=Config)
    run_role(config, sys.argv[1], int(sys.argv[2]))
