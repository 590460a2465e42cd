"""The offline evaluator on a small random pair: protocol plumbing and metric consistency."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dspark_sglang.eval import main
from tests.conftest import write_model_pair


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    return write_model_pair(tmp_path_factory.mktemp("evalpair"), chat=True)


def test_eval_json_on_chat_dataset(
    pair: tuple[Path, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    target, drafter = pair
    ds = tmp_path / "mt.jsonl"
    ds.write_text("\n".join(json.dumps({"turns": [f"hello {i}", "second turn"]}) for i in range(5)))
    rc = main(
        [
            "--model-path",
            str(target),
            "--draft-model-path",
            str(drafter),
            "--dataset",
            str(ds),
            "--max-new-tokens",
            "20",
            "--json",
            "--plot",
            str(tmp_path / "fig2.png"),
        ]
    )
    assert rc == 0
    assert (tmp_path / "fig2.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    out = json.loads(capsys.readouterr().out)
    r = out["results"]["dspark"]
    assert out["num_prompts"] == 5 and r["rounds"] > 0
    assert 1.0 <= out["tau"]["dspark"] <= 5.0  # block 4: at most 4 drafts + bonus per round
    assert len(r["accept_rate_at_k"]) == 4 and len(r["confidence_raw"]) == 4
    assert r["confidence_raw"][0]["count"] == r["rounds"]  # verify-all scores every position 0


def test_eval_bad_input(
    pair: tuple[Path, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    target, drafter = pair
    assert (
        main(
            [
                "--model-path",
                str(target),
                "--draft-model-path",
                str(drafter),
                "--dataset",
                str(tmp_path / "missing.jsonl"),
            ]
        )
        == 2
    )
    assert "--dataset" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["--num-prompts", "0"])
