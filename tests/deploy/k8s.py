"""Helpers for the deploy tests: render kustomizations, validate offline, walk pod templates and
expand container arguments the way the kubelet does."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass, field
from functools import cache
from importlib.resources import files
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import referencing
import yaml

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "deploy" / "k8s"
DOCKER = ROOT / "deploy" / "docker"
SCHEMAS = Path(__file__).resolve().parent / "schemas"
OVERLAYS = ("cpu-demo", "sglang-pd")
K8S_VERSION = "1.32.0"  # the release the manifests target (LWS, pod-index label: >= 1.28)
NAMESPACE = "dspark"
CLUSTER_DOMAIN = "cluster.local"
# Secrets the operator creates out of band (docs/deploy.md); nothing else may be referenced.
EXTERNAL_SECRETS = {"dspark-zmq-curve", "dspark-api-key", "hf-token"}
WORKLOADS = ("Deployment", "StatefulSet", "LeaderWorkerSet")
Obj = dict[str, Any]


def kubectl() -> str:
    exe = shutil.which("kubectl")
    if exe is None:  # the issue states kubectl is present on these machines: never skip
        raise AssertionError("kubectl is not on PATH; the deploy tests need `kubectl kustomize`")
    return exe


def kustomize(path: Path) -> list[Obj]:
    r = subprocess.run(
        [kubectl(), "kustomize", str(path)], capture_output=True, text=True, timeout=60
    )
    assert r.returncode == 0, f"kubectl kustomize {path} failed:\n{r.stderr}"
    return [d for d in yaml.safe_load_all(r.stdout) if d]


# -- schemas ---------------------------------------------------------------------------------
@cache
def _definitions() -> referencing.Resource:
    d = files("kubernetes_validate") / "kubernetes-json-schema" / f"v{K8S_VERSION}-local-strict"
    return referencing.Resource.from_contents(json.loads((d / "_definitions.json").read_text()))


@cache
def _crd_validator(api_version: str, kind: str) -> jsonschema.Draft202012Validator | None:
    group, _, version = api_version.rpartition("/")
    f = SCHEMAS / f"{group}_{version}_{kind}.json"
    if not f.is_file():
        return None
    schema = json.loads(f.read_text())
    registry = referencing.Registry().with_resource(
        "https://kubernetes.io/api/_definitions.json", _definitions()
    )
    return jsonschema.Draft202012Validator(schema, registry=registry)


def validate(obj: Obj) -> None:
    """Strict schema validation (unknown fields fail); raises on any problem."""
    crd = _crd_validator(obj["apiVersion"], obj["kind"])
    if crd is not None:
        errors = sorted(crd.iter_errors(obj), key=lambda e: list(e.absolute_path))
        if errors:
            e = errors[0]
            where = ".".join(str(p) for p in e.absolute_path)
            raise AssertionError(f"{kn(obj)}: {where}: {e.message}")
        return
    try:
        kubernetes_validate.validate(obj, K8S_VERSION, strict=True)
    except kubernetes_validate.ValidationError as e:
        where = ".".join(str(p) for p in e.path)
        raise AssertionError(f"{kn(obj)}: {where}: {e.message}") from None
    except kubernetes_validate.SchemaNotFoundError as e:
        raise AssertionError(f"{kn(obj)}: no schema: {e.message}") from None


def kn(obj: Obj) -> str:
    return f"{obj['kind']}/{obj['metadata']['name']}"


# -- pod templates --------------------------------------------------------------------------
@dataclass
class Pod:
    """One pod template of a workload (an LWS has two: leader and worker)."""

    owner: Obj
    where: str  # e.g. "StatefulSet/dspark-decode" or "LeaderWorkerSet/dspark-prefill:leader"
    meta: Obj
    spec: Obj
    replicas: int
    lws_size: int | None = None  # pods per LWS group
    leader: bool = True  # the LWS leader, or any pod of another workload

    @property
    def labels(self) -> dict[str, str]:
        return self.meta.get("labels", {})

    def containers(self) -> list[Obj]:
        return self.spec["containers"]

    def volume(self, name: str) -> Obj:
        return next(v for v in self.spec.get("volumes", []) if v["name"] == name)


def pods(objs: list[Obj]) -> Iterator[Pod]:
    for o in objs:
        if o["kind"] in ("Deployment", "StatefulSet"):
            t = o["spec"]["template"]
            yield Pod(o, kn(o), t["metadata"], t["spec"], o["spec"].get("replicas", 1))
        elif o["kind"] == "LeaderWorkerSet":
            lwt = o["spec"]["leaderWorkerTemplate"]
            size = lwt.get("size", 1)
            reps = o["spec"].get("replicas", 1)
            lt = lwt.get("leaderTemplate") or lwt["workerTemplate"]
            yield Pod(o, f"{kn(o)}:leader", lt["metadata"], lt["spec"], reps, size, True)
            wt = lwt["workerTemplate"]
            yield Pod(o, f"{kn(o)}:worker", wt["metadata"], wt["spec"], reps, size, False)


def find(objs: list[Obj], kind: str, name: str) -> Obj:
    hits = [o for o in objs if o["kind"] == kind and o["metadata"]["name"] == name]
    assert len(hits) == 1, f"expected one {kind}/{name}, found {len(hits)}"
    return hits[0]


def configmap(objs: list[Obj], name: str) -> Obj:
    """A rendered ConfigMap by the name its referrers use (kustomize appends a content hash)."""
    return find(objs, "ConfigMap", name)


# -- the kubelet's view of a container ------------------------------------------------------
_REF = re.compile(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_.-]*)\)")


def expand(s: str, env: dict[str, str]) -> str:
    """Kubernetes $(VAR) expansion: defined names are replaced, $$ is a literal $, undefined
    references stay as written (which is why the tests require none)."""

    def sub(m: re.Match[str]) -> str:
        if m.group(0) == "$$":
            return "$"
        return env.get(m.group(1), m.group(0))

    return _REF.sub(sub, s)


@dataclass
class Context:
    """What the kubelet/LWS controller would provide to one concrete pod."""

    namespace: str = NAMESPACE
    pod_name: str = "pod"
    labels: dict[str, str] = field(default_factory=dict)
    lws: dict[str, str] = field(default_factory=dict)  # LWS_* variables injected by LWS


def container_env(c: Obj, objs: list[Obj], ctx: Context) -> dict[str, str]:
    env: dict[str, str] = dict(ctx.lws)
    for src in c.get("envFrom", []):
        ref = src.get("configMapRef")
        assert ref is not None, f"{c['name']}: only configMapRef envFrom is expected, got {src}"
        prefix = src.get("prefix", "")
        for k, v in configmap(objs, ref["name"]).get("data", {}).items():
            env[prefix + k] = v
    for e in c.get("env", []):
        if "value" in e:
            env[e["name"]] = expand(e["value"], env)
            continue
        vf = e["valueFrom"]
        if "fieldRef" in vf:
            path = vf["fieldRef"]["fieldPath"]
            if path == "metadata.namespace":
                env[e["name"]] = ctx.namespace
            elif path == "metadata.name":
                env[e["name"]] = ctx.pod_name
            else:
                m = re.fullmatch(r"metadata\.labels\['([^']+)'\]", path)
                assert m and m.group(1) in ctx.labels, f"{c['name']}: unresolvable fieldRef {path}"
                env[e["name"]] = ctx.labels[m.group(1)]
        elif "configMapKeyRef" in vf:
            ref = vf["configMapKeyRef"]
            data = configmap(objs, ref["name"]).get("data", {})
            assert ref["key"] in data or ref.get("optional"), f"{ref} not in the ConfigMap"
            if ref["key"] in data:
                env[e["name"]] = data[ref["key"]]
        elif "secretKeyRef" in vf:
            ref = vf["secretKeyRef"]
            assert ref["name"] in EXTERNAL_SECRETS, f"unknown Secret {ref['name']}"
            if not ref.get("optional"):
                env[e["name"]] = f"<secret {ref['name']}/{ref['key']}>"
        elif "resourceFieldRef" in vf:
            env[e["name"]] = "1"
        else:
            raise AssertionError(f"{c['name']}: unsupported valueFrom {vf}")
    return env


def command_line(c: Obj, objs: list[Obj], ctx: Context) -> list[str]:
    """The container's args (image ENTRYPOINT/CMD not included) as the process receives them."""
    env = container_env(c, objs, ctx)
    out = [expand(a, env) for a in c.get("args", [])]
    left = [a for a in out if _REF.search(a)]
    assert not left, f"{c['name']}: unresolved $(VAR) references in {left}"
    return out


def mounted_file(pod: Pod, c: Obj, path: str, objs: list[Obj]) -> str:
    """The content a ConfigMap-backed file at `path` has inside container `c`."""
    for m in c.get("volumeMounts", []):
        mp = m["mountPath"].rstrip("/") + "/"
        if path.startswith(mp):
            vol = pod.volume(m["name"])
            assert "configMap" in vol, f"{path} is not backed by a ConfigMap ({vol})"
            key = path[len(mp) :]
            data = configmap(objs, vol["configMap"]["name"]).get("data", {})
            assert key in data, f"{path}: ConfigMap {vol['configMap']['name']} has no key {key}"
            return data[key]
    raise AssertionError(f"{c['name']}: nothing is mounted at {path}")
