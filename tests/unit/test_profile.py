"""The step-timing CLI: JSON schema on the synthetic and an HF-written model, flag errors exit 2."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from dspark_sglang.hostinfo import cpu_model
from dspark_sglang.models.cpu_gemm import row_tiers
from dspark_sglang.profile import SYNTHETIC_NAME, main

TINY_GRID = [
    "--quick",
    "--json",
    "--batch-sizes",
    "1,3",
    "--verify-lens",
    "0,2",
    "--num-reqs",
    "2",
    "--context-len",
    "20",
    "--repeats",
    "3",
    "--warmup",
    "1",
]
POINT_KEYS = {"kind", "R", "B", "tokens_per_req", "ctx", "median_s", "p10_s", "p90_s", "repeats"}


def _run_json(argv: list[str], capsys: pytest.CaptureFixture[str]) -> dict[str, Any]:
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert out.count("\n") == 1, "--json prints exactly one line"
    return json.loads(out)


def _check_report(report: dict[str, Any], model: str) -> None:
    assert report["tool"] == "dspark_sglang.profile"
    assert report["model"] == model
    assert (report["dtype"], report["device"]) == ("float32", "cpu")
    assert isinstance(report["torch"], str) and report["date"]
    hw = report["hardware"]
    assert hw["num_threads"] >= 1
    assert hw["cpu"] == cpu_model()  # the model name, not just "x86_64"
    assert hw["cpu_gemm"] in ("onednn", "mkl", "auto")
    if hw["cpu_gemm"] == "auto":  # what it measured: per weight shape, oneDNN's rows or null
        assert set(hw) == {"cpu", "num_threads", "cpu_gemm", "cpu_gemm_crossovers"}
        for span in hw["cpu_gemm_crossovers"].values():
            assert span is None or (len(span) == 2 and span[0] >= 2)
    else:
        assert set(hw) == {"cpu", "num_threads", "cpu_gemm"}
    # the token counts the profiled forward executes at: the packed products' tiers, or none
    assert report["row_tiers"] in ([], list(row_tiers(2048)))
    if hw["cpu_gemm"] != "auto":
        assert report["row_tiers"] == (list(row_tiers(2048)) if hw["cpu_gemm"] == "onednn" else [])
    assert report["command"].startswith("python -m dspark_sglang.profile --quick --json")
    grid = [(p["kind"], p["R"], p["tokens_per_req"], p["B"]) for p in report["points"]]
    assert grid == [
        ("decode", 1, 1, 1),
        ("decode", 3, 1, 3),
        ("verify", 2, 1, 2),
        ("verify", 2, 3, 6),
    ]
    for p in report["points"]:
        assert set(p) == POINT_KEYS
        assert p["ctx"] == 20 and p["repeats"] == 3
        assert p["median_s"] > 0
        assert p["p10_s"] <= p["median_s"] <= p["p90_s"]


def test_synthetic_model_json_and_output_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out_file = tmp_path / "profile.json"
    report = _run_json([*TINY_GRID, "--output", str(out_file)], capsys)
    _check_report(report, SYNTHETIC_NAME)
    assert json.loads(out_file.read_text()) == report


def test_several_context_lengths_cross_the_grid(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from dspark_sglang.capacity_profile import load_profile

    argv = [*TINY_GRID, "--write-profile", str(tmp_path / "p.yaml")]
    argv[argv.index("--context-len") + 1] = "24,8"
    report = _run_json(argv, capsys)
    grid = sorted((p["kind"], p["R"], p["tokens_per_req"], p["ctx"]) for p in report["points"])
    shapes = [("decode", 1, 1), ("decode", 3, 1), ("verify", 2, 1), ("verify", 2, 3)]
    assert grid == sorted((*s, c) for s in shapes for c in (8, 24))
    assert load_profile(tmp_path / "p.yaml").model.form.kappa_s >= 0.0  # fitted, never negative


def test_hf_written_dense_model(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    transformers = pytest.importorskip("transformers")
    import torch

    torch.manual_seed(0)
    cfg = transformers.Qwen3Config(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=128,
    )
    transformers.Qwen3ForCausalLM(cfg).save_pretrained(tmp_path)
    report = _run_json([*TINY_GRID, "--model-path", str(tmp_path)], capsys)
    _check_report(report, str(tmp_path))


def test_table_output(capsys: pytest.CaptureFixture[str]) -> None:
    argv = [a for a in TINY_GRID if a != "--json"]
    assert main([*argv, "--batch-sizes", "2"]) == 0
    out = capsys.readouterr().out
    assert SYNTHETIC_NAME in out and "median ms" in out
    assert len(out.strip().splitlines()) == 2 + 3  # header, column names, one row per point


@pytest.mark.parametrize(
    ("argv", "flag"),
    [
        (["--batch-sizes", "0,2"], "--batch-sizes"),
        (["--batch-sizes", "1,x"], "--batch-sizes"),
        (["--batch-sizes", "1,,2"], "--batch-sizes"),
        (["--batch-sizes", ""], "--batch-sizes"),
        (["--num-reqs", "-1"], "--num-reqs"),
        (["--verify-lens", "-1"], "--verify-lens"),
        (["--context-len", "-5"], "--context-len"),
        (["--repeats", "0"], "--repeats"),
        (["--warmup", "two"], "--warmup"),
        (["--dtype", "int8"], "--dtype"),
        (["--model-path", "/nonexistent/model"], "--model-path"),
        (["--model-path"], "--model-path"),
        (["--output", "/nonexistent/dir/p.json"], "--output"),
        (["--draft-model-path", "/tmp"], "--draft-model-path"),  # no --model-path
    ],
)
def test_bad_flags_exit_2_naming_the_flag(
    argv: list[str], flag: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["--quick", *argv])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert flag in err and "Traceback" not in err


def test_config_error_exits_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
    assert main(["--quick", "--model-path", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "LlamaForCausalLM" in err


def test_context_beyond_model_limit_exits_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--quick", "--json", "--context-len", "40000", "--batch-sizes", "1"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "--context-len" in err


def test_write_profile_round_trips_through_the_engine_loader(tmp_path: Path) -> None:
    from dspark_sglang.capacity_profile import load_profile

    out = tmp_path / "cpu.yaml"
    rc = main(
        [
            "--quick",
            "--json",
            "--batch-sizes",
            "1,2",
            "--verify-lens",
            "0,2",
            "--num-reqs",
            "1,2",
            "--repeats",
            "2",
            "--warmup",
            "0",
            "--cpu-gemm",
            "onednn",
            "--write-profile",
            str(out),
        ]
    )
    assert rc == 0
    prof = load_profile(out)
    assert prof.provenance.kind == "measured" and "dspark_sglang.profile" in prof.provenance.command
    assert prof.model.predict(2, 6) > prof.model.predict(1, 1) > 0
    # the profile carries the tiers the profiled engine executes at (its report's row_tiers)
    assert prof.buckets == prof.model.form.buckets == tuple(row_tiers(2048))
    mkl = tmp_path / "mkl.yaml"
    argv = ["--quick", "--json", "--cpu-gemm", "mkl", "--batch-sizes", "1,2", "--verify-lens", "0"]
    assert main([*argv, "--repeats", "2", "--warmup", "0", "--write-profile", str(mkl)]) == 0
    assert load_profile(mkl).buckets == ()


def test_drafter_points_become_the_profile_draft_term(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from dspark_sglang.capacity_profile import load_profile
    from tests.conftest import write_drafter, write_hf_model

    target = write_hf_model(tmp_path / "t", moe=True)
    drafter = write_drafter(tmp_path / "d", target, block_size=4)
    out = tmp_path / "cpu.yaml"
    argv = ["--quick", "--json", "--model-path", str(target), "--draft-model-path", str(drafter)]
    argv += ["--batch-sizes", "1,2", "--verify-lens", "0,2", "--num-reqs", "1,4"]
    argv += ["--context-len", "16", "--repeats", "2", "--warmup", "0", "--write-profile", str(out)]
    assert main(argv) == 0
    report = json.loads(capsys.readouterr().out)
    assert [p["R"] for p in report["draft_points"]] == [1, 2, 4]
    assert all(p["median_s"] > 0 for p in report["draft_points"])
    prof = load_profile(out)
    assert prof.drafter == str(drafter)
    model = prof.model
    assert model.draft is not None and model.draft.knots == (1.0, 2.0, 4.0)
    assert model.draft_seconds(4) >= model.draft_seconds(1) > 0  # never falling in R
    assert model.predict(1, 3, 32, drafted=True) > model.predict(1, 3, 32)


def test_the_draft_term_is_timed_greedy_unless_asked_to_sample(tmp_path: Path) -> None:
    """time_draft drafts greedily (temperature 0, no generators) by default: the start-up price
    is the cheaper one, which the live estimator corrects from drafting steps if traffic samples;
    `sampled=True` times T = 1 with a generator per request."""
    import torch

    from dspark_sglang.engine.engine import LLM
    from dspark_sglang.engine.profiler import time_draft
    from tests.conftest import write_drafter, write_hf_model

    target = write_hf_model(tmp_path / "t", moe=True)
    drafter = write_drafter(tmp_path / "d", target, block_size=4)
    llm = LLM(str(target), draft_model=str(drafter), schedule_mode="verify-all")
    seen = []
    inner = llm.runner.draft

    def spy(batch: Any, temps: torch.Tensor, gens: list) -> Any:
        seen.append((temps.tolist(), [g is not None for g in gens]))
        return inner(batch, temps, gens)

    llm.runner.draft = spy  # type: ignore[method-assign]
    gen = torch.Generator().manual_seed(0)
    assert time_draft(llm.runner, llm.pool, 3, 16, repeats=1, warmup=0, gen=gen) > 0
    assert seen[-1] == ([0.0] * 3, [False] * 3)
    time_draft(llm.runner, llm.pool, 3, 16, repeats=1, warmup=0, gen=gen, sampled=True)
    assert seen[-1] == ([1.0] * 3, [True] * 3)
    llm.close()
