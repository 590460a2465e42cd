"""bench.ab: configuration parsing and a side-by-side run on a tiny model pair."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dspark_sglang.bench import ab
from dspark_sglang.config import ConfigError
from tests.conftest import write_model_pair


def test_parse_config_reads_mode_and_typed_options() -> None:
    assert ab.parse_config("lagged") == ("lagged", {})
    mode, opts = ab.parse_config("lagged,overlap=true,startup_profile_seconds=2.5,num_blocks=64")
    assert mode == "lagged"
    assert opts == {"overlap": True, "startup_profile_seconds": 2.5, "num_blocks": 64}
    for bad in ("lagged,overlap", ",x=1", "lagged,=1"):
        with pytest.raises(ConfigError, match="--config"):
            ab.parse_config(bad)


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    return write_model_pair(tmp_path_factory.mktemp("abpair"))


def test_ab_runs_configs_side_by_side(
    pair: tuple[Path, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    target, drafter = pair
    ds = tmp_path / "p.jsonl"
    ds.write_text("".join(json.dumps({"prompt": f"hello {i} world"}) + "\n" for i in range(4)))
    out = tmp_path / "ab.json"
    common = ["--model-path", str(target), "--draft-model-path", str(drafter)]
    common += ["--dataset", str(ds), "--concurrency", "2", "--rounds", "3", "--output-len", "6"]
    configs = ["--config", "no-spec", "--config", "verify-all,num_blocks=256"]
    assert ab.main([*common, *configs, "--out", str(out)]) == 0
    rep = json.loads(out.read_text())
    assert [r["config"] for r in rep["configs"]] == ["no-spec", "verify-all,num_blocks=256"]
    first, second = rep["configs"]
    assert first["ratio_median"] == 1.0 and len(second["tok_s_rounds"]) == 3
    assert all(x > 0 for x in second["tok_s_rounds"])
    assert "per-round ratio to no-spec" in capsys.readouterr().out
    # the step split: no-spec never drafts; verify-all drafts every decode step
    assert first["drafting_steps"] == 0 and first["plain_steps"] > 0
    assert first["drafting_step_ms"] is None and first["plain_step_ms"] > 0
    assert second["drafting_steps"] > 0 and second["drafting_step_ms"] > 0
    assert second["steps"] >= second["drafting_steps"] + second["plain_steps"]
    assert first["outside_step_ms"] >= 0 and rep["prompt_format"] == "chat"
    # raw completion text, as bench.sweep sends it
    text = ["--prompt-format", "text", "--config", "no-spec", "--config", "lagged"]
    assert ab.main([*common, *text, "--out", str(out)]) == 0
    rep = json.loads(out.read_text())
    assert rep["prompt_format"] == "text" and len(rep["configs"]) == 2
    missing = ["--dataset", str(tmp_path / "none.jsonl"), "--prompt-format", "text"]
    assert ab.main([*common, *missing, "--config", "no-spec", "--config", "lagged"]) == 2
    assert "--dataset" in capsys.readouterr().err
    # an option the engine does not take is a clear error, not a traceback
    assert ab.main([*common, "--config", "no-spec", "--config", "verify-all,bogus=1"]) == 2
    assert "bogus" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        ab.main([*common, "--config", "no-spec"])  # one configuration compares nothing
