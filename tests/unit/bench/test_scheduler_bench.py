"""The scheduler benchmark CLI runs and prints the documented JSON schema."""

from __future__ import annotations

import json
import subprocess
import sys

from dspark_sglang.bench import scheduler


def test_json_schema(capsys: object) -> None:
    assert scheduler.main(["--json", "--repeat", "1"]) == 0
    out = capsys.readouterr().out.strip().splitlines()  # type: ignore[attr-defined]
    assert len(out) == 1
    results = json.loads(out[0])["results"]
    cells = {(r["policy"], r["R"], r["gamma"]) for r in results}
    for policy in ("sync", "lagged", "verify-all", "mtp1"):
        for num_reqs in (1, 8, 64, 512):
            for gamma in (5, 7, 15):
                assert (policy, num_reqs, gamma) in cells
    for r in results:
        assert isinstance(r["policy"], str) and isinstance(r["R"], int)
        assert isinstance(r["gamma"], int) and isinstance(r["median_us"], float)
        assert r["median_us"] > 0 and 0 <= r["mean_verify_len"] <= r["gamma"]


def test_table_and_help_through_the_module_entry_point() -> None:
    cmd = [sys.executable, "-m", "dspark_sglang.bench.scheduler"]
    help_text = subprocess.run([*cmd, "--help"], capture_output=True, text=True, check=True)
    assert "--json" in help_text.stdout
    table = subprocess.run([*cmd, "--repeat", "1"], capture_output=True, text=True, check=True)
    assert table.stdout.splitlines()[0].split()[:4] == ["policy", "R", "gamma", "median_us"]
