"""sglang-pd: LeaderWorkerSet wiring (LWS env -> --nnodes/--node-rank/--dist-init-addr), the
parallel layout against the engine profile, the plugin switches, the PD router's discovery, and
(where sglang is installed) SGLang's own argument parser on the rendered command lines."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest
import yaml

from dspark_sglang.capacity_profile import load_profile
from tests.deploy.k8s import (
    K8S,
    NAMESPACE,
    ROOT,
    Context,
    Obj,
    Pod,
    command_line,
    container_env,
    find,
    pods,
)
from tests.deploy.k8s import mounted_file as mounted

OVERLAY = K8S / "overlays" / "sglang-pd"
PROFILES = ROOT / "engine_profiles"
# What both sides of a PD pair must agree on (SGLang checks some of it at the KV handshake).
SHARED = (
    "--model-path",
    "--served-model-name",
    "--trust-remote-code",
    "--port",
    "--speculative-algorithm",
    "--speculative-draft-model-path",
    "--disaggregation-transfer-backend",
    "--enable-dp-lm-head",
    "--enable-metrics",
)


def _flags(argv: list[str]) -> dict[str, str]:
    """--flag=value and bare --flag (value "") pairs; every item must be a --flag=value form."""
    out = {}
    for a in argv:
        assert a.startswith("--"), f"use --flag=value items, got {a!r}"
        k, _, v = a.partition("=")
        assert k not in out, f"{k} given twice"
        out[k] = v
    return out


def _lws(objs: list[Obj], role: str) -> tuple[Pod, Pod]:
    leader, worker = (p for p in pods(objs) if p.owner["metadata"]["name"] == f"dspark-{role}")
    assert leader.leader and not worker.leader
    return leader, worker


def _ctx(pod: Pod, index: int) -> Context:
    name = pod.owner["metadata"]["name"]
    return Context(
        pod_name=f"{name}-0" if index == 0 else f"{name}-0-{index}",
        labels=pod.labels,
        lws={
            # As the LWS controller injects them (group 0 of a Shared-subdomain LWS).
            "LWS_LEADER_ADDRESS": f"{name}-0.{name}.{NAMESPACE}",
            "LWS_GROUP_SIZE": str(pod.lws_size),
            "LWS_WORKER_INDEX": str(index),
        },
    )


def _server_argv(objs: list[Obj], pod: Pod, index: int) -> list[str]:
    (c,) = pod.containers()
    assert c["command"] == ["python3", "-m", "sglang.launch_server"]
    return command_line(c, objs, _ctx(pod, index))


@pytest.fixture(scope="module")
def servers(sglang_pd: list[Obj]) -> dict[str, dict[str, str]]:
    """Leader (node rank 0) flags of each role."""
    return {
        r: _flags(_server_argv(sglang_pd, _lws(sglang_pd, r)[0], 0)) for r in ("prefill", "decode")
    }


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_group_wiring_from_lws_env(sglang_pd: list[Obj], role: str) -> None:
    leader, worker = _lws(sglang_pd, role)
    lwt = leader.owner["spec"]["leaderWorkerTemplate"]
    assert lwt["restartPolicy"] == "RecreateGroupOnPodRestart"  # a lost rank kills the group
    assert leader.owner["spec"].get("startupPolicy", "LeaderCreated") == "LeaderCreated"
    (lc,), (wc,) = leader.containers(), worker.containers()
    for key in ("image", "command", "args", "env", "envFrom", "resources", "volumeMounts"):
        assert lc[key] == wc[key], f"{role}: leader and worker {key} differ"
    raw = _flags(lc["args"])
    assert raw["--nnodes"] == "$(LWS_GROUP_SIZE)"
    assert raw["--node-rank"] == "$(LWS_WORKER_INDEX)"
    assert raw["--dist-init-addr"].startswith("$(LWS_LEADER_ADDRESS):")
    dist_port = int(raw["--dist-init-addr"].rsplit(":", 1)[1])
    assert dist_port in {p["containerPort"] for p in lc["ports"]}
    size = leader.lws_size
    assert size is not None and size >= 2, "multi-node groups"
    for index, pod in [(0, leader)] + [(i, worker) for i in range(1, size)]:
        f = _flags(_server_argv(sglang_pd, pod, index))
        assert (f["--nnodes"], f["--node-rank"]) == (str(size), str(index))
        name = leader.owner["metadata"]["name"]
        assert f["--dist-init-addr"] == f"{name}-0.{name}.{NAMESPACE}:{dist_port}"
    gpus = int(lc["resources"]["limits"]["nvidia.com/gpu"])
    assert int(raw["--tp-size"]) == size * gpus, f"{role}: --tp-size = size x GPUs per node"


def test_parallel_layout_matches_the_profile(servers: dict[str, dict[str, str]]) -> None:
    p, d = servers["prefill"], servers["decode"]
    # Attention TP (tp / attention DP) must be the same on both sides of the KV transfer.
    att = {r: int(f["--tp-size"]) // int(f.get("--attn-dp-size", "1")) for r, f in servers.items()}
    assert att["prefill"] == att["decode"]
    prof = load_profile(OVERLAY / "engine-profile.yaml")
    assert prof.engine == "sglang"
    assert int(d["--ep-size"]) == prof.parallelism.ep
    assert int(d["--attn-dp-size"]) == prof.parallelism.dp
    assert att["decode"] == prof.parallelism.tp
    assert int(p["--ep-size"]) <= int(p["--tp-size"])


def test_pd_roles_and_plugin(sglang_pd: list[Obj], servers: dict[str, dict[str, str]]) -> None:
    p, d = servers["prefill"], servers["decode"]
    assert p["--disaggregation-mode"] == "prefill" and d["--disaggregation-mode"] == "decode"
    for flag in SHARED:
        assert p.get(flag) == d.get(flag), f"{flag} differs between prefill and decode"
    assert d["--speculative-algorithm"] == "DSPARK"  # keep the name: 31 built-in gates use it
    assert "--speculative-dspark-sps-table-path" not in d  # the plugin prices verify steps
    envs = {}
    for role in ("prefill", "decode"):
        leader, _ = _lws(sglang_pd, role)
        (c,) = leader.containers()
        envs[role] = {e["name"]: e.get("value") for e in c["env"]}
        assert envs[role]["SGLANG_PLUGINS"] == "dspark"
        hf = next(e for e in c["env"] if e["name"] == "HF_TOKEN")["valueFrom"]["secretKeyRef"]
        assert hf["name"] == "hf-token" and hf["optional"] is True
        shm = next(m for m in c["volumeMounts"] if m["mountPath"] == "/dev/shm")
        assert leader.volume(shm["name"])["emptyDir"]["medium"] == "Memory"
        assert "IPC_LOCK" in c["securityContext"]["capabilities"]["add"]
        net = {s["configMapRef"]["name"].rsplit("-", 1)[0] for s in c["envFrom"]}
        assert net == {"dspark-sglang-model", "dspark-sglang-net"}
    assert envs["decode"]["SGLANG_RAGGED_VERIFY_MODE"] == "compact"
    assert "SGLANG_RAGGED_VERIFY_MODE" not in envs["prefill"]
    assert envs["decode"]["DSPARK_SGLANG_PROFILE"]


def test_plugin_accepts_its_settings(sglang_pd: list[Obj]) -> None:
    """The DSPARK_SGLANG_* variables parse with the plugin's own reader (no sglang import)."""
    control = pytest.importorskip("dspark_sglang.sglang_plugin.control")
    for role in ("prefill", "decode"):
        leader, _ = _lws(sglang_pd, role)
        (c,) = leader.containers()
        env = container_env(c, sglang_pd, _ctx(leader, 0))
        cfg = control.PluginConfig.from_env(env)
        if role == "decode":
            assert cfg.profile == "/etc/dspark/profile/engine-profile.yaml" and cfg.live


def test_profile_and_sts_from_configmaps(sglang_pd: list[Obj]) -> None:
    leader, _ = _lws(sglang_pd, "decode")
    (c,) = leader.containers()
    env = {e["name"]: e.get("value") for e in c["env"]}
    profile_text = mounted(leader, c, env["DSPARK_SGLANG_PROFILE"], sglang_pd)
    assert profile_text == (OVERLAY / "engine-profile.yaml").read_text()
    sources = [p.name for p in sorted(PROFILES.glob("*.yaml")) if p.read_text() == profile_text]
    assert sources, "overlays/sglang-pd/engine-profile.yaml must be a copy of engine_profiles/*"
    prof = load_profile(OVERLAY / "engine-profile.yaml")
    argv = _flags(_server_argv(sglang_pd, leader, 0))
    sts = json.loads(
        mounted(leader, c, argv["--speculative-dspark-confidence-sts-path"], sglang_pd)
    )
    assert len(sts["temperatures"]) == prof.gamma and all(t > 0 for t in sts["temperatures"])


def test_router_discovers_the_leaders(sglang_pd: list[Obj]) -> None:
    (router,) = (p for p in pods(sglang_pd) if p.owner["kind"] == "Deployment")
    (c,) = router.containers()
    assert c["command"] == ["python3", "-m", "sglang_router.launch_router"]
    argv = command_line(c, sglang_pd, Context(labels=router.labels))
    args = _router_args(argv)
    assert args.pd_disaggregation and args.service_discovery
    assert args.service_discovery_namespace == NAMESPACE
    http = next(p["containerPort"] for p in c["ports"] if p["name"] == "http")
    assert args.port == http and args.host == "0.0.0.0"
    assert args.prometheus_port == next(
        p["containerPort"] for p in c["ports"] if p["name"] == "metrics"
    )
    for role in ("prefill", "decode"):
        leader, _ = _lws(sglang_pd, role)
        selector = dict(kv.split("=", 1) for kv in getattr(args, f"{role}_selector"))
        # LWS labels each pod with its index in the group; only the leader (0) serves requests.
        lws_labels = {"leaderworkerset.sigs.k8s.io/worker-index": "0"}
        assert selector.items() <= {**leader.labels, **lws_labels}.items(), role
        assert selector["leaderworkerset.sigs.k8s.io/worker-index"] == "0"
        assert selector["app.kubernetes.io/component"] == role
        (lc,) = leader.containers()
        assert args.service_discovery_port == int(_flags(lc["args"])["--port"])
    leader, _ = _lws(sglang_pd, "prefill")
    boot = leader.meta["annotations"]["sglang.ai/bootstrap-port"]
    (lc,) = leader.containers()
    assert boot == _flags(lc["args"])["--disaggregation-bootstrap-port"]
    assert int(boot) in {p["containerPort"] for p in lc["ports"]}
    # RBAC: the router's ServiceAccount may watch pods in the namespace.
    sa = router.spec["serviceAccountName"]
    rb = find(sglang_pd, "RoleBinding", "dspark-router-discovery")
    assert rb["subjects"] == [{"kind": "ServiceAccount", "name": sa, "namespace": NAMESPACE}]
    role = find(sglang_pd, "Role", rb["roleRef"]["name"])
    (rule,) = role["rules"]
    assert rule["resources"] == ["pods"] and {"list", "watch"} <= set(rule["verbs"])


def _router_args(argv: list[str]) -> argparse.Namespace:
    """The subset of sglang_router's flags these manifests use, with its nargs conventions."""
    p = argparse.ArgumentParser(exit_on_error=False, allow_abbrev=False)
    p.add_argument("--pd-disaggregation", action="store_true")
    p.add_argument("--service-discovery", action="store_true")
    p.add_argument("--service-discovery-namespace")
    p.add_argument("--service-discovery-port", type=int)
    p.add_argument("--prefill-selector", nargs="+", default=[])
    p.add_argument("--decode-selector", nargs="+", default=[])
    p.add_argument("--host")
    p.add_argument("--port", type=int)
    p.add_argument("--prometheus-host")
    p.add_argument("--prometheus-port", type=int)
    return p.parse_args(argv)


def test_monitors(sglang_pd: list[Obj]) -> None:
    mon = find(sglang_pd, "PodMonitor", "dspark-sglang-servers")
    (ep,) = mon["spec"]["podMetricsEndpoints"]
    sel = mon["spec"]["selector"]
    for role in ("prefill", "decode"):
        leader, _ = _lws(sglang_pd, role)
        (c,) = leader.containers()
        assert "--enable-metrics" in c["args"]
        assert ep["port"] in {p["name"] for p in c["ports"]}
        labels = {**leader.labels, "leaderworkerset.sigs.k8s.io/worker-index": "0"}
        assert sel["matchLabels"].items() <= labels.items()
        (expr,) = sel["matchExpressions"]
        assert labels[expr["key"]] in expr["values"]
    sm = find(sglang_pd, "ServiceMonitor", "dspark-router")
    svc = find(sglang_pd, "Service", "dspark-router")
    assert [e["port"] for e in sm["spec"]["endpoints"]] == ["metrics"]
    assert "metrics" in {p["name"] for p in svc["spec"]["ports"]}


def test_sglang_accepts_the_server_command_lines(sglang_pd: list[Obj]) -> None:
    """SGLang's own parser (issue [sglang] pins 0.5.23; CI installs it with --no-deps)."""
    server_args = pytest.importorskip("sglang.srt.server_args")
    parser = argparse.ArgumentParser(exit_on_error=False, allow_abbrev=False)
    server_args.ServerArgs.add_cli_args(parser)
    for role in ("prefill", "decode"):
        leader, worker = _lws(sglang_pd, role)
        for index, pod in ((0, leader), (1, worker)):
            ns, unknown = parser.parse_known_args(_server_argv(sglang_pd, pod, index))
            assert not unknown, f"{role}: SGLang does not know {unknown}"
            assert ns.disaggregation_mode == role
            assert ns.speculative_algorithm == "DSPARK"
            assert ns.nnodes == pod.lws_size and ns.node_rank == index
    _, unknown = parser.parse_known_args(["--model-path=m", "--disaggregation-mod=prefill"])
    assert unknown == ["--disaggregation-mod=prefill"]  # no abbreviations, no typos


def test_sglang_router_accepts_its_command_line(sglang_pd: list[Obj]) -> None:
    """sglang_router's own parser, where the package is installed (it ships in the SGLang image)."""
    router_args = pytest.importorskip("sglang_router.router_args")
    (router,) = (p for p in pods(sglang_pd) if p.owner["kind"] == "Deployment")
    (c,) = router.containers()
    parser = argparse.ArgumentParser(exit_on_error=False, allow_abbrev=False)
    router_args.RouterArgs.add_cli_args(parser, use_router_prefix=False)
    ns, unknown = parser.parse_known_args(command_line(c, sglang_pd, Context()))
    assert not unknown, f"sglang_router does not know {unknown}"
    ra = router_args.RouterArgs.from_cli_args(ns, use_router_prefix=False)
    assert ra.pd_disaggregation and ra.service_discovery
    assert ra.prefill_selector["app.kubernetes.io/component"] == "prefill"
    assert ra.decode_selector["app.kubernetes.io/component"] == "decode"


def test_configmaps_are_what_the_overlay_says(sglang_pd: list[Obj]) -> None:
    kust = yaml.safe_load((OVERLAY / "kustomization.yaml").read_text())
    generated = {g["name"] for g in kust["configMapGenerator"]}
    rendered = {
        o["metadata"]["name"].rsplit("-", 1)[0] for o in sglang_pd if o["kind"] == "ConfigMap"
    }
    assert generated == rendered
    for name in ("engine-profile.yaml", "sts.json", "net.env"):
        assert Path(OVERLAY / name).is_file()
