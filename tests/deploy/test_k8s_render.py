"""Every overlay renders with `kubectl kustomize`, and every rendered object is valid against the
Kubernetes (and CRD) schemas, offline and strictly (unknown fields fail)."""

from __future__ import annotations

import pytest

from tests.deploy.k8s import (
    EXTERNAL_SECRETS,
    K8S,
    NAMESPACE,
    OVERLAYS,
    Obj,
    kn,
    kustomize,
    pods,
    validate,
)

EXPECTED = {
    "cpu-demo": {
        "Namespace/dspark",
        "Deployment/dspark-router",
        "Service/dspark-router",
        "ServiceMonitor/dspark-router",
        "Service/dspark-router-zmq",
        "StatefulSet/dspark-prefill",
        "Service/dspark-prefill",
        "StatefulSet/dspark-decode",
        "Service/dspark-decode",
    },
    "sglang-pd": {
        "Namespace/dspark",
        "Deployment/dspark-router",
        "Service/dspark-router",
        "ServiceMonitor/dspark-router",
        "ServiceAccount/dspark-router",
        "Role/dspark-router-discovery",
        "RoleBinding/dspark-router-discovery",
        "LeaderWorkerSet/dspark-prefill",
        "LeaderWorkerSet/dspark-decode",
        "PodMonitor/dspark-sglang-servers",
    },
}


def _all(rendered: dict[str, list[Obj]], api_key: list[Obj]) -> list[tuple[str, Obj]]:
    out = [(name, o) for name, objs in rendered.items() for o in objs]
    return out + [("cpu-demo+api-key", o) for o in api_key]


def test_base_renders() -> None:
    names = {kn(o) for o in kustomize(K8S / "base")}
    assert names == {"Deployment/dspark-router", "Service/dspark-router",
                     "ServiceMonitor/dspark-router"}  # fmt: skip


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_overlay_objects(rendered: dict[str, list[Obj]], overlay: str) -> None:
    objs = rendered[overlay]
    names = {kn(o) for o in objs if o["kind"] != "ConfigMap"}
    assert names == EXPECTED[overlay]
    keys = [(o["kind"], o["metadata"]["name"]) for o in objs]
    assert len(keys) == len(set(keys)), "duplicate objects"
    for o in objs:
        if o["kind"] != "Namespace":
            assert o["metadata"].get("namespace") == NAMESPACE, kn(o)
        labels = o["metadata"].get("labels", {})
        assert labels.get("app.kubernetes.io/part-of") == "dspark-sglang", kn(o)


def test_every_object_validates(
    rendered: dict[str, list[Obj]], cpu_demo_api_key: list[Obj]
) -> None:
    errors = []
    for overlay, o in _all(rendered, cpu_demo_api_key):
        try:
            validate(o)
        except AssertionError as e:
            errors.append(f"{overlay}: {e}")
    assert not errors, "\n".join(errors)


def test_validation_is_strict(cpu_demo: list[Obj], sglang_pd: list[Obj]) -> None:
    """The validators catch typos, in built-in kinds and in the CRDs (and their pod templates)."""
    import copy

    bad = copy.deepcopy(next(o for o in cpu_demo if o["kind"] == "StatefulSet"))
    bad["spec"]["template"]["spec"]["containers"][0]["livenesProbe"] = {}
    with pytest.raises(AssertionError, match="livenesProbe"):
        validate(bad)
    lws = copy.deepcopy(next(o for o in sglang_pd if o["kind"] == "LeaderWorkerSet"))
    lws["spec"]["leaderWorkerTemplate"]["restartPolicy"] = "Always"
    with pytest.raises(AssertionError, match="restartPolicy"):
        validate(lws)
    lws = copy.deepcopy(next(o for o in sglang_pd if o["kind"] == "LeaderWorkerSet"))
    lws["spec"]["leaderWorkerTemplate"]["workerTemplate"]["spec"]["containers"][0]["cmd"] = []
    with pytest.raises(AssertionError, match="cmd"):
        validate(lws)
    mon = copy.deepcopy(next(o for o in sglang_pd if o["kind"] == "PodMonitor"))
    mon["spec"]["podMetricsEndpoints"][0]["interval"] = "15 seconds"
    with pytest.raises(AssertionError, match="interval"):
        validate(mon)


def test_references_resolve(rendered: dict[str, list[Obj]], cpu_demo_api_key: list[Obj]) -> None:
    """Every ConfigMap a pod uses is rendered (with kustomize's hash suffix, also inside the
    LeaderWorkerSet templates); Secrets are only the documented out-of-band ones."""
    variants = {**rendered, "cpu-demo+api-key": cpu_demo_api_key}
    for name, objs in variants.items():
        cms = {o["metadata"]["name"] for o in objs if o["kind"] == "ConfigMap"}
        for pod in pods(objs):
            refs: list[tuple[str, str]] = []
            for v in pod.spec.get("volumes", []):
                if "configMap" in v:
                    refs.append(("ConfigMap", v["configMap"]["name"]))
                if "secret" in v:
                    refs.append(("Secret", v["secret"]["secretName"]))
            for c in pod.containers():
                for src in c.get("envFrom", []):
                    refs.append(("ConfigMap", src["configMapRef"]["name"]))
                for e in c.get("env", []):
                    vf = e.get("valueFrom", {})
                    if "configMapKeyRef" in vf:
                        refs.append(("ConfigMap", vf["configMapKeyRef"]["name"]))
                    if "secretKeyRef" in vf:
                        refs.append(("Secret", vf["secretKeyRef"]["name"]))
            for kind, ref in refs:
                if kind == "ConfigMap":
                    assert ref in cms, f"{name} {pod.where}: ConfigMap {ref} is not rendered"
                    assert ref.rsplit("-", 1)[-1] != ref, f"{ref}: not a generated name"
                else:
                    assert ref in EXTERNAL_SECRETS, f"{name} {pod.where}: Secret {ref}"
        # Monitors scrape in-namespace and name their credentials' Secret.
        for o in objs:
            if o["kind"] in ("ServiceMonitor", "PodMonitor"):
                for ep in o["spec"].get("endpoints", []) + o["spec"].get("podMetricsEndpoints", []):
                    cred = ep.get("authorization", {}).get("credentials")
                    if cred:
                        assert cred["name"] in EXTERNAL_SECRETS
