"""bench.gemm: the shapes it parses, the rows it times, one JSON line per measurement."""

from __future__ import annotations

import json

import pytest

from dspark_sglang.bench import gemm


def test_shapes_parse_and_bad_ones_name_the_flag() -> None:
    assert gemm.parse_shapes("256x512,64x4096") == [(256, 512), (64, 4096)]
    assert len(gemm.parse_shapes(gemm.BUNDLED_SHAPES)) == 7
    for bad in ("256", "256x", "0x4", "ax4", "4x-1"):
        with pytest.raises(SystemExit, match="--shapes"):
            gemm.parse_shapes(bad)


def test_json_lines_time_both_paths_per_row_count(capsys: pytest.CaptureFixture[str]) -> None:
    assert gemm.main(["--shapes", "32x16,8x64", "--rows", "1,5", "--repeats", "3", "--json"]) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [(r["k"], r["n"], r["rows"]) for r in rows] == [
        (32, 16, 1),
        (32, 16, 5),
        (8, 64, 1),
        (8, 64, 5),
    ]
    for r in rows:
        assert r["mkl_us"] > 0 and r["mkl_col_us"] > 0 and r["onednn_us"] > 0
        assert r["speedup"] == pytest.approx(r["mkl_us"] / r["onednn_us"])
        assert r["col_speedup"] == pytest.approx(r["mkl_us"] / r["mkl_col_us"])
        assert r["onednn_over_col"] == pytest.approx(r["mkl_col_us"] / r["onednn_us"])


def test_bad_rows_are_a_clear_error() -> None:
    with pytest.raises(SystemExit, match="--rows"):
        gemm.main(["--rows", "1,x"])
    with pytest.raises(SystemExit, match="positive"):
        gemm.main(["--rows", "0"])


def test_text_lines_name_both_rules(capsys: pytest.CaptureFixture[str]) -> None:
    assert gemm.main(["--shapes", "32x16", "--rows", "2,4", "--repeats", "3"]) == 0
    (line,) = capsys.readouterr().out.splitlines()
    assert line.startswith("[M, 32] x [32, 16] (onednn: from 16 rows; auto: ")
    assert "M=2: " in line and "M=4: " in line
