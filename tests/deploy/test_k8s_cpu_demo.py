"""cpu-demo: every container's command line, as the kubelet expands it, is accepted by our own
launch_server parser and Config checks, and the ZMQ topology, ports, secrets and profile agree."""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path

import pytest

from dspark_sglang.capacity_profile import load_profile
from dspark_sglang.config import Config, is_loopback_addr
from dspark_sglang.launch_server import build_parser, config_from_args
from tests.deploy.dockerfile import exec_form, final, instructions
from tests.deploy.k8s import (
    CLUSTER_DOMAIN,
    DOCKER,
    K8S,
    NAMESPACE,
    Context,
    Obj,
    Pod,
    command_line,
    find,
    mounted_file,
    pods,
)

# Flags whose values every process of a deployment must share: the handshake (model id, geometry,
# dtype, page size, drafter, gamma), the address lists and the peer security.
SHARED = (
    "model_path",
    "draft_model_path",
    "served_model_name",
    "engine",
    "speculative_algorithm",
    "num_speculative_tokens",
    "dtype",
    "page_size",
    "zmq_api_addr",
    "zmq_prefill_addrs",
    "zmq_decode_addrs",
    "zmq_curve_dir",
    "zmq_hmac_key_file",
    "heartbeat_interval",
    "heartbeat_timeout",
)


@dataclass
class Proc:
    """One process of the demo: a concrete pod (StatefulSet ordinal) and its parsed flags."""

    pod: Pod
    name: str  # pod name
    ordinal: int
    container: Obj
    args: argparse.Namespace
    cfg: Config


def _entrypoint_args() -> list[str]:
    entry = exec_form(final(instructions(DOCKER / "cpu.Dockerfile"), "ENTRYPOINT") or "[]")
    assert entry[:3] == ["python", "-m", "dspark_sglang.launch_server"]
    return entry[3:]  # k8s `args` replace CMD and follow these


def _processes(objs: list[Obj], tmp: Path) -> list[Proc]:
    out = []
    for pod in pods(objs):
        (c,) = pod.containers()
        for i in range(pod.replicas):
            base = pod.owner["metadata"]["name"]
            name = f"{base}-{i}" if pod.owner["kind"] == "StatefulSet" else f"{base}-xyz"
            labels = {**pod.labels, "apps.kubernetes.io/pod-index": str(i)}
            argv = _entrypoint_args() + command_line(c, objs, Context(pod_name=name, labels=labels))
            args = build_parser().parse_args(argv)
            if args.capacity_profile is not None:  # parse the mounted ConfigMap file itself
                local = tmp / f"{name}-profile.yaml"
                local.write_text(mounted_file(pod, c, args.capacity_profile, objs))
                args_local = argparse.Namespace(**{**vars(args), "capacity_profile": str(local)})
            else:
                args_local = args
            out.append(Proc(pod, name, i, c, args, config_from_args(args_local)))
    return out


@pytest.fixture(scope="module")
def procs(cpu_demo: list[Obj], tmp_path_factory: pytest.TempPathFactory) -> list[Proc]:
    return _processes(cpu_demo, tmp_path_factory.mktemp("cpu-demo"))


def _by_role(procs: list[Proc]) -> dict[str, list[Proc]]:
    out: dict[str, list[Proc]] = {}
    for p in procs:
        out.setdefault(p.args.role, []).append(p)
    return out


def test_one_role_per_pod(procs: list[Proc]) -> None:
    roles = _by_role(procs)
    assert sorted(roles) == ["decode", "prefill", "router"]
    assert len(roles["router"]) == 1
    for role, ps in roles.items():
        for p in ps:
            assert p.pod.labels["app.kubernetes.io/component"] == role
            assert p.args.engine == "reference"


def test_shared_flags_agree(procs: list[Proc]) -> None:
    ref = procs[0]
    for p in procs[1:]:
        for flag in SHARED:
            assert getattr(p.args, flag) == getattr(ref.args, flag), (
                f"--{flag.replace('_', '-')} differs between {ref.name} and {p.name}"
            )


def test_peers_authenticate(procs: list[Proc]) -> None:
    """Off-pod ZMQ needs CurveZMQ or HMAC (launch_server refuses otherwise): here CurveZMQ, with
    the cluster certificate from the dspark-zmq-curve Secret mounted where --zmq-curve-dir says."""
    for p in procs:
        s = p.cfg.serve
        addrs = (s.api_addr, *s.prefill_addrs, *s.decode_addrs)
        assert not any(is_loopback_addr(a) for a in addrs)
        assert s.curve_dir is not None
        mount = next(m for m in p.container["volumeMounts"] if m["mountPath"] == s.curve_dir)
        vol = p.pod.volume(mount["name"])
        assert vol["secret"]["secretName"] == "dspark-zmq-curve"
        assert "items" not in vol["secret"]  # both cluster.key and cluster.key_secret
        assert vol["secret"]["defaultMode"] & 0o040, "the fsGroup must be able to read the key"
        assert (
            p.pod.spec["securityContext"]["fsGroup"] == p.pod.spec["securityContext"]["runAsGroup"]
        )


def _host_port(addr: str) -> tuple[str, int]:
    assert addr.startswith("tcp://")
    host, _, port = addr[len("tcp://") :].rpartition(":")
    return host, int(port)


def _zmq_port(c: Obj) -> int:
    return next(p["containerPort"] for p in c["ports"] if p["name"] == "zmq")


def _headless(objs: list[Obj], name: str, pod: Pod, port: int) -> None:
    svc = find(objs, "Service", name)
    spec = svc["spec"]
    assert spec.get("clusterIP") == "None", f"Service/{name} must be headless"
    assert spec.get("publishNotReadyAddresses") is True, f"Service/{name}: peers meet before Ready"
    assert spec["selector"].items() <= pod.labels.items()
    assert any(p["port"] == port for p in spec["ports"])


def test_each_process_binds_its_own_dns_name(cpu_demo: list[Obj], procs: list[Proc]) -> None:
    """launch_server binds exactly the address its peers connect to; in Kubernetes that address
    must be a DNS name that resolves to the binding pod itself."""
    roles = _by_role(procs)
    suffix = f"{NAMESPACE}.svc.{CLUSTER_DOMAIN}"
    (router,) = roles["router"]
    spec = router.pod.spec
    host, port = _host_port(router.cfg.serve.api_addr)
    assert host == f"{spec['hostname']}.{spec['subdomain']}.{suffix}"
    assert port == _zmq_port(router.container)
    _headless(cpu_demo, spec["subdomain"], router.pod, port)
    assert router.pod.owner["spec"]["replicas"] == 1  # the address names one pod
    assert router.pod.owner["spec"]["strategy"]["type"] == "Recreate"
    for role in ("prefill", "decode"):
        ps = roles[role]
        addrs = getattr(router.cfg.serve, f"{role}_addrs")
        assert len(addrs) == len(ps) == ps[0].pod.replicas, f"{role}: one address per replica"
        for p in ps:
            sts = p.pod.owner
            assert p.args.worker_index == p.ordinal
            host, port = _host_port(addrs[p.ordinal])
            assert host == f"{p.name}.{sts['spec']['serviceName']}.{suffix}"
            assert port == _zmq_port(p.container)
            _headless(cpu_demo, sts["spec"]["serviceName"], p.pod, port)


def test_router_http(cpu_demo: list[Obj], procs: list[Proc]) -> None:
    (router,) = _by_role(procs)["router"]
    assert router.cfg.serve.host == "0.0.0.0"
    http = next(p for p in router.container["ports"] if p["name"] == "http")
    assert http["containerPort"] == router.cfg.serve.port
    svc = find(cpu_demo, "Service", "dspark-router")
    (port,) = [p for p in svc["spec"]["ports"] if p["name"] == "http"]
    assert port["targetPort"] == "http"
    assert svc["spec"]["selector"].items() <= router.pod.labels.items()
    mon = find(cpu_demo, "ServiceMonitor", "dspark-router")
    assert mon["spec"]["selector"]["matchLabels"].items() <= svc["metadata"]["labels"].items()
    assert [e["port"] for e in mon["spec"]["endpoints"]] == ["http"]
    assert mon["spec"]["endpoints"][0]["path"] == "/metrics"


def test_decode_uses_the_profile_configmap(cpu_demo: list[Obj], procs: list[Proc]) -> None:
    decodes = _by_role(procs)["decode"]
    assert decodes
    for p in decodes:
        assert p.args.schedule_mode == "lagged"
        assert p.args.capacity_profile == "/etc/dspark/profile/engine-profile.yaml"
    text = mounted_file(
        decodes[0].pod, decodes[0].container, decodes[0].args.capacity_profile, cpu_demo
    )
    overlay_copy = K8S / "overlays" / "cpu-demo" / "engine-profile.yaml"
    assert text == overlay_copy.read_text()
    prof = load_profile(overlay_copy)
    assert prof.engine == "reference" and prof.parallelism.ep == 1
    for p in _by_role(procs)["prefill"] + _by_role(procs)["router"]:
        assert p.args.capacity_profile is None  # prefill never drafts; the router has no engine


def test_api_key_component(cpu_demo_api_key: list[Obj], tmp_path: Path) -> None:
    procs = _processes(cpu_demo_api_key, tmp_path)
    (router,) = _by_role(procs)["router"]
    assert router.cfg.serve.api_key == "<secret dspark-api-key/api-key>"
    for p in procs:
        if p.args.role != "router":
            assert p.args.api_key is None
    env = {e["name"]: e for e in router.container["env"]}
    ref = env["DSPARK_API_KEY"]["valueFrom"]["secretKeyRef"]
    probe = " ".join(router.container["readinessProbe"]["exec"]["command"])
    assert "DSPARK_API_KEY" in probe and f":{router.cfg.serve.port}/ready" in probe
    mon = find(cpu_demo_api_key, "ServiceMonitor", "dspark-router")
    cred = mon["spec"]["endpoints"][0]["authorization"]["credentials"]
    assert (cred["name"], cred["key"]) == (ref["name"], ref["key"])


def test_flags_are_spelled_out(cpu_demo: list[Obj], cpu_demo_api_key: list[Obj]) -> None:
    """argparse accepts unique prefixes (`--zmq-curve`); manifests use the full flag names, so a
    later flag sharing the prefix cannot silently change their meaning."""
    known = {s for a in build_parser()._actions for s in a.option_strings}
    for objs in (cpu_demo, cpu_demo_api_key):
        for pod in pods(objs):
            for c in pod.containers():
                for a in _entrypoint_args() + c.get("args", []):
                    if a.startswith("--"):
                        assert a.split("=", 1)[0] in known, f"{pod.where}: {a}"
