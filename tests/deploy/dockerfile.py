"""A small Dockerfile reader for the tests: instructions with continuation lines joined."""

from __future__ import annotations

import json
from pathlib import Path

Instr = tuple[str, str]  # (INSTRUCTION, rest of the line)


def instructions(path: Path) -> list[Instr]:
    out: list[Instr] = []
    buf = ""
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if not buf and (not line or line.startswith("#")):
            continue
        if buf and line.startswith("#"):  # comment lines inside a continuation are dropped
            continue
        if line.endswith("\\"):
            buf += line[:-1] + " "
            continue
        line, buf = buf + line, ""
        op, _, rest = line.partition(" ")
        out.append((op.upper(), rest.strip()))
    assert not buf, f"{path}: dangling line continuation"
    return out


def stages(instrs: list[Instr]) -> list[list[Instr]]:
    out: list[list[Instr]] = []
    for ins in instrs:
        if ins[0] == "FROM":
            out.append([])
        if out:
            out[-1].append(ins)
    return out


def exec_form(rest: str) -> list[str]:
    """ENTRYPOINT/CMD in JSON (exec) form."""
    value = json.loads(rest)
    assert isinstance(value, list) and all(isinstance(x, str) for x in value), rest
    return value


def final(instrs: list[Instr], op: str) -> str | None:
    """The last `op` of the final stage (USER, ENTRYPOINT, CMD are per stage)."""
    hits = [rest for o, rest in stages(instrs)[-1] if o == op]
    return hits[-1] if hits else None


def final_user(instrs: list[Instr]) -> int | None:
    """The numeric uid of the final stage's USER (None when the image runs as root by default)."""
    user = final(instrs, "USER")
    if user is None:
        return None
    uid = user.split(":", 1)[0]
    assert uid.isdigit(), f"USER {user}: use a numeric uid so runAsNonRoot can verify it"
    return int(uid)
