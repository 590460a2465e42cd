"""Imports flow one way (STYLE.md §4); this test reads every module's imports with `ast`."""

from __future__ import annotations

import ast
from pathlib import Path

PKG = Path(__file__).resolve().parents[2] / "dspark_sglang"
TOP = {
    "config",
    "hostinfo",
    "types",
    "telemetry",
    "algo",
    "models",
    "engine",
    "serve",
    "sglang_plugin",
}
ALLOWED = {
    "config": set(),
    "hostinfo": set(),
    "types": {"config"},
    "telemetry": {"config", "types"},
    "algo": {"config", "types"},
    "models": {"config", "hostinfo"},
    "engine": {"config", "hostinfo", "types", "algo", "models", "telemetry"},
    "serve": {"config", "hostinfo", "types", "algo", "models", "engine", "telemetry"},
    "sglang_plugin": {"config", "types", "algo", "telemetry"},
}
THIRD_PARTY_OWNERS = {"zmq": {"serve/transport.py"}, "sglang": {"sglang_plugin"}}


def imports(path: Path) -> set[str]:
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.add(node.module)
    return out


def layer_of(path: Path) -> str:
    rel = path.relative_to(PKG)
    return rel.parts[0].removesuffix(".py")


def test_every_module_respects_the_import_table() -> None:
    bad = []
    for path in sorted(PKG.rglob("*.py")):
        layer = layer_of(path)
        rel = path.relative_to(PKG).as_posix()
        for mod in imports(path):
            parts = mod.split(".")
            if parts[0] == "dspark_sglang" and len(parts) > 1:
                target = parts[1]
                if layer in ALLOWED and target in TOP - {layer} - ALLOWED[layer]:
                    bad.append(f"{rel} imports {mod}")
                if target == "launch_server" or (layer in TOP and target in {"bench", "train"}):
                    bad.append(f"{rel} imports the CLI/tool module {mod}")
            for lib, owners in THIRD_PARTY_OWNERS.items():
                if parts[0] == lib and not any(rel.startswith(o) for o in owners):
                    bad.append(f"{rel} imports {lib} (only {sorted(owners)} may)")
    assert not bad, "\n".join(bad)


def test_the_checker_catches_a_violation(tmp_path: Path) -> None:
    f = tmp_path / "x.py"
    f.write_text("import zmq\nfrom dspark_sglang.engine import engine\n")
    assert imports(f) == {"zmq", "dspark_sglang.engine"}
