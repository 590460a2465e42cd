"""Policies every serving container follows, in every overlay (and with the api-key component)."""

from __future__ import annotations

import re

import pytest

from tests.deploy.dockerfile import final_user, instructions
from tests.deploy.k8s import DOCKER, Obj, Pod, pods

PROBES = ("startupProbe", "readinessProbe", "livenessProbe")
CPU_IMAGE = "dspark-sglang-cpu"


@pytest.fixture(scope="module")
def variants(rendered: dict[str, list[Obj]], cpu_demo_api_key: list[Obj]) -> dict[str, list[Obj]]:
    return {**rendered, "cpu-demo+api-key": cpu_demo_api_key}


def _containers(variants: dict[str, list[Obj]]) -> list[tuple[str, Pod, Obj]]:
    out = [(n, p, c) for n, objs in variants.items() for p in pods(objs) for c in p.containers()]
    assert len(out) >= 7
    return out


def _serves_clients(pod: Pod) -> bool:
    """Containers that take client or router traffic: the router and the SGLang group leaders."""
    return pod.labels.get("app.kubernetes.io/component") == "router" or (
        pod.lws_size is not None and pod.leader
    )


def _port_names(c: Obj) -> set[str]:
    return {p["name"] for p in c.get("ports", [])}


def test_probes_everywhere(variants: dict[str, list[Obj]]) -> None:
    for name, pod, c in _containers(variants):
        where = f"{name} {pod.where}/{c['name']}"
        for kind in PROBES:
            probe = c.get(kind)
            assert probe, f"{where}: no {kind}"
            handler = next(k for k in ("httpGet", "tcpSocket", "exec", "grpc") if k in probe)
            if handler in ("httpGet", "tcpSocket"):
                port = probe[handler]["port"]
                assert port in _port_names(c), f"{where}: {kind} port {port} is not a named port"
            if handler == "exec":  # a `python -c` probe must at least be valid Python
                cmd = probe["exec"]["command"]
                if cmd[:2] == ["python", "-c"]:
                    compile(cmd[2], f"{where}:{kind}", "exec")
        # Start-up (model load, capacity profiling) is covered by a generous startup probe.
        s = c["startupProbe"]
        budget = s.get("periodSeconds", 10) * s.get("failureThreshold", 3)
        assert budget >= 120, f"{where}: startupProbe allows only {budget}s"
        assert c["livenessProbe"].get("failureThreshold", 3) >= 3, where


def test_http_probe_paths(variants: dict[str, list[Obj]]) -> None:
    """Readiness on /ready, liveness on /health wherever the server has them: our router, SGLang
    leaders. SGLang ranks >= 1 serve only /health; sglang_router calls them /readiness and
    /liveness; the reference workers have no HTTP server (tcpSocket on their ZMQ inbox)."""
    for name, pod, c in _containers(variants):
        where = f"{name} {pod.where}"
        image = c["image"]
        ready, live = c["readinessProbe"], c["livenessProbe"]
        if "sglang_router" in " ".join(c.get("command", [])):
            assert ready["httpGet"]["path"] == "/readiness", where
            assert live["httpGet"]["path"] == "/liveness", where
        elif pod.lws_size is not None:
            want = "/ready" if pod.leader else "/health"
            assert ready["httpGet"]["path"] == want, where
            assert live["httpGet"]["path"] == "/health", where
        elif image.startswith(CPU_IMAGE) and pod.labels["app.kubernetes.io/component"] == "router":
            if "httpGet" in ready:
                assert ready["httpGet"]["path"] == "/ready", where
            else:  # api-key component: /ready needs the key, which an httpGet probe cannot send
                assert "/ready" in " ".join(ready["exec"]["command"]), where
            assert live["httpGet"]["path"] == "/health", where
        else:
            for kind in PROBES:
                assert c[kind]["tcpSocket"]["port"] == "zmq", f"{where} {kind}"


def test_prestop_drain(variants: dict[str, list[Obj]]) -> None:
    for name, pod, c in _containers(variants):
        if not _serves_clients(pod):
            continue
        pre = c.get("lifecycle", {}).get("preStop")
        assert pre, f"{name} {pod.where}: no preStop drain"
        secs = int(pre["exec"]["command"][-1]) if "exec" in pre else pre["sleep"]["seconds"]
        grace = pod.spec.get("terminationGracePeriodSeconds", 30)
        assert 0 < secs < grace, f"{name} {pod.where}: preStop {secs}s vs grace {grace}s"


def test_images_pinned(variants: dict[str, list[Obj]]) -> None:
    for name, pod, c in _containers(variants):
        image = c["image"]
        ref = image.split("@", 1)[0]
        tag = ref.rsplit(":", 1)[1] if ":" in ref.rsplit("/", 1)[-1] else None
        assert "@sha256:" in image or tag, f"{name} {pod.where}: {image} has no tag"
        assert tag != "latest", f"{name} {pod.where}: {image}"
        assert c.get("imagePullPolicy") != "Always", f"{name} {pod.where}"


def test_resources(variants: dict[str, list[Obj]]) -> None:
    for name, pod, c in _containers(variants):
        where = f"{name} {pod.where}"
        req, lim = c["resources"].get("requests", {}), c["resources"].get("limits", {})
        assert {"cpu", "memory"} <= req.keys(), where
        assert "memory" in lim, where
        gpus = lim.get("nvidia.com/gpu")
        assert req.get("nvidia.com/gpu") == gpus, f"{where}: GPU requests must equal limits"
        if pod.lws_size is not None:
            assert gpus and int(gpus) >= 1, f"{where}: SGLang servers need GPUs"
        else:
            assert gpus is None, f"{where}: only SGLang servers get GPUs"


def test_cpu_image_runs_non_root(variants: dict[str, list[Obj]]) -> None:
    uid = final_user(instructions(DOCKER / "cpu.Dockerfile"))
    assert uid is not None and uid != 0
    seen = 0
    for name, pod, c in _containers(variants):
        if pod.labels.get("app.kubernetes.io/component") != "router" and pod.lws_size:
            continue  # SGLang GPU servers run as the SGLang image's root (IPC_LOCK for RDMA)
        where = f"{name} {pod.where}"
        psc, csc = pod.spec.get("securityContext", {}), c.get("securityContext", {})
        assert psc.get("runAsNonRoot") is True, where
        assert psc.get("runAsUser") == uid, f"{where}: runAsUser is not the image's USER {uid}"
        assert csc.get("allowPrivilegeEscalation") is False, where
        assert csc.get("capabilities", {}).get("drop") == ["ALL"], where
        assert csc.get("readOnlyRootFilesystem") is True, where
        mounts = {m["mountPath"] for m in c.get("volumeMounts", [])}
        assert "/tmp" in mounts, f"{where}: HOME=/tmp must be writable"
        seen += c["image"].startswith(CPU_IMAGE)
    assert seen >= 3


def test_named_ports_are_valid(variants: dict[str, list[Obj]]) -> None:
    for name, pod, c in _containers(variants):
        for p in c.get("ports", []):
            assert isinstance(p["containerPort"], int), f"{name} {pod.where}: {p}"
            assert re.fullmatch(r"[a-z0-9]([a-z0-9-]*[a-z0-9])?", p["name"]), p
            assert len(p["name"]) <= 15, p
