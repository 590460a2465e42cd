"""Render every kustomization once per session (kubectl kustomize, offline)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from tests.deploy.k8s import K8S, OVERLAYS, Obj, kustomize


@pytest.fixture(scope="session")
def rendered() -> dict[str, list[Obj]]:
    return {name: kustomize(K8S / "overlays" / name) for name in OVERLAYS}


@pytest.fixture(scope="session")
def cpu_demo(rendered: dict[str, list[Obj]]) -> list[Obj]:
    return rendered["cpu-demo"]


@pytest.fixture(scope="session")
def sglang_pd(rendered: dict[str, list[Obj]]) -> list[Obj]:
    return rendered["sglang-pd"]


@pytest.fixture(scope="session")
def cpu_demo_api_key(tmp_path_factory: pytest.TempPathFactory) -> list[Obj]:
    """cpu-demo with the api-key component, as docs/deploy.md tells operators to add it.

    kustomize refuses absolute paths to other kustomizations, so the tree is copied next to a
    throwaway overlay instead of writing into the repository."""
    root = tmp_path_factory.mktemp("k8s") / "k8s"
    shutil.copytree(K8S, root)
    variant = Path(root / "variants" / "cpu-demo-api-key")
    variant.mkdir(parents=True)
    (variant / "kustomization.yaml").write_text(
        "apiVersion: kustomize.config.k8s.io/v1beta1\nkind: Kustomization\n"
        "resources:\n  - ../../overlays/cpu-demo\n"
        "components:\n  - ../../components/api-key\n"
    )
    return kustomize(variant)
