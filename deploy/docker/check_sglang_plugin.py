"""Build-time check of the GPU image: sglang is the pinned version, our plugin loads, and the PD
router the sglang-pd overlay runs from this image (sglang_router) is installed.

Run by deploy/docker/gpu.Dockerfile; exits non-zero (failing the build) otherwise.
"""

from __future__ import annotations

import importlib.metadata as md
import importlib.util
import sys

SGLANG_VERSION = "0.5.23"
GROUP = "sglang.srt.plugins"


def main() -> int:
    have = md.version("sglang")
    if have != SGLANG_VERSION:
        print(f"error: the base image has sglang {have}, the plugin needs {SGLANG_VERSION}")
        return 1
    eps = [e for e in md.entry_points(group=GROUP) if e.value.startswith("dspark_sglang")]
    if not eps:
        print(f"error: no dspark_sglang entry point in the group {GROUP}")
        return 1
    for e in eps:
        e.load()
        print(f"plugin {e.name} -> {e.value} (enable with SGLANG_PLUGINS={e.name})")
    if importlib.util.find_spec("sglang_router") is None:
        print("error: sglang_router is missing (deploy/k8s/overlays/sglang-pd runs the PD router)")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
