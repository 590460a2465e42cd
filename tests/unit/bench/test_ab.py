"""bench.ab: configuration parsing and a side-by-side run on a tiny model pair."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from dspark_sglang.bench import ab
from dspark_sglang.bench.serving import build_prompts, text_prompts
from dspark_sglang.config import ConfigError
from dspark_sglang.types import StepRecord
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


def _rec(r: int, tokens: int, seconds: float, **kw: object) -> StepRecord:
    return StepRecord(
        step=1,
        num_reqs=r,
        num_tokens=tokens,
        num_prefill_tokens=0,
        num_decode_reqs=r,
        kv_tokens=100,
        step_seconds=seconds,
        **kw,
    )


def test_kinds_at_splits_the_steps_of_exactly_c_requests_by_kind() -> None:
    recs = [
        _rec(4, 4, 0.010),  # plain: 4 tokens in 10 ms
        _rec(4, 4, 0.010),
        _rec(4, 32, 0.040, draft_seconds=0.01, num_draft_reqs=4, num_accepted=16),  # full
        _rec(4, 20, 0.040, draft_seconds=0.01, num_draft_reqs=4, num_accepted=8, probe=True),
        _rec(3, 24, 0.030, draft_seconds=0.01, num_draft_reqs=3, num_accepted=9),  # R = 3: out
        StepRecord(1, 4, 40, 36, 4, 100, 0.5),  # a step with prefill: out
    ]
    kinds = ab.kinds_at(recs, 4, per_row=8)
    assert list(kinds) == ["plain", "full", "probe"]
    assert kinds["plain"]["steps"] == 2 and kinds["plain"]["tok_s"] == pytest.approx(400.0)
    assert kinds["full"]["tok_s"] == pytest.approx(500.0)
    assert kinds["probe"]["tok_s"] == pytest.approx(300.0)
    assert sum(k["time_share"] for k in kinds.values()) == pytest.approx(1.0)
    assert kinds["plain"]["time_share"] == pytest.approx(0.2)
    assert ab.kinds_at(recs, 8, per_row=8) == {}


def test_sweep_order_is_the_order_bench_serving_sends(tmp_path: Path) -> None:
    ds = tmp_path / "p.jsonl"
    ds.write_text("".join(json.dumps({"prompt": f"prompt {i}"}) + "\n" for i in range(10)))
    texts = [p.prompt for p in text_prompts(ds, 16)]
    args = argparse.Namespace(
        seed=1,
        random_token_range=(0, 100),
        num_prompts=10,
        dataset_name="custom",
        dataset_path=ds,
        output_len=16,
        disable_shuffle=False,
        output_len_range_ratio=1.0,
        warmup_requests=0,
    )
    sent = [p.prompt for p in build_prompts(args)]
    assert ab.sweep_order(texts, 1) == sent != texts
    assert sorted(ab.sweep_order(texts, 7)) == sorted(texts)


def test_fresh_engines_builds_each_engine_anew_every_round(
    pair: tuple[Path, Path],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    target, drafter = pair
    ds = tmp_path / "p.jsonl"
    ds.write_text("".join(json.dumps({"prompt": f"hello {i} world"}) + "\n" for i in range(6)))
    built: list[str] = []
    make = ab.make_engine

    def counting(model: str, draft: str, mode: str, opts: dict, c: int) -> object:
        built.append(mode)
        return make(model, draft, mode, opts, c)

    monkeypatch.setattr(ab, "make_engine", counting)
    out = tmp_path / "ab.json"
    common = ["--model-path", str(target), "--draft-model-path", str(drafter), "--dataset", str(ds)]
    common += [
        "--concurrency",
        "2",
        "--rounds",
        "3",
        "--output-len",
        "6",
        "--prompt-format",
        "text",
    ]
    configs = ["--config", "no-spec", "--config", "lagged,startup_profile_seconds=0.5"]
    fresh = ["--fresh-engines", "--warmup-prompts", "1", "--shuffle-seed", "1"]
    assert ab.main([*common, *configs, *fresh, "--out", str(out)]) == 0
    # three rounds, two new engines each, in the round's order (flipped every other round)
    assert built == ["no-spec", "lagged", "lagged", "no-spec", "no-spec", "lagged"]
    rep = json.loads(out.read_text())
    assert rep["fresh_engines"] and rep["warmup_prompts"] == 1 and rep["shuffle_seed"] == 1
    nospec, lagged = rep["configs"]
    assert len(lagged["tok_s_rounds"]) == 3 and all(x > 0 for x in lagged["tok_s_rounds"])
    assert list(nospec["kinds_at_concurrency"]) == ["plain"]  # no-spec decodes plainly
    assert "per-round ratio to no-spec" in capsys.readouterr().out
    built.clear()
    assert ab.main([*common, *configs, "--out", str(out)]) == 0
    assert built == ["no-spec", "lagged"]  # warm engines: built once
    warm = json.loads(out.read_text())
    assert not warm["fresh_engines"] and warm["shuffle_seed"] is None
    # the same cells (4 requests of 6 tokens at c = 2, three rounds) take no-spec as many
    # steps either way: the fresh engines' warm-ups are not recorded
    assert warm["configs"][0]["steps"] == nospec["steps"]
    for bad in (["--warmup-prompts", "0"], ["--shuffle-seed", "1", "--prompt-format", "chat"]):
        with pytest.raises(SystemExit):
            ab.main([*common, *configs, *bad])
