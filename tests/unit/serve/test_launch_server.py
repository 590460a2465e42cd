"""launch_server: flags -> Config, and CLI errors that name the flag."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dspark_sglang.algo.capacity_fit import DRAFT_PRIOR_WEIGHT
from dspark_sglang.algo.step_bias import DEFAULT_PRIOR
from dspark_sglang.config import ConfigError
from dspark_sglang.launch_server import build_parser, config_from_args, main


@pytest.fixture
def model(tmp_path: Path) -> Path:
    (tmp_path / "config.json").write_text(json.dumps({}))
    return tmp_path


@pytest.mark.parametrize(
    ("flags", "needle"),
    [
        (["--engine", "sglang", "--schedule-mode", "sync"], "not supported with --engine sglang"),
        (["--capacity-profile", "x.yaml"], "--capacity-profile x.yaml does not exist"),
        (["--ep-size", "2"], "--ep-size"),
        (["--model-path", "/nonexistent"], "--model-path /nonexistent"),
        (["--draft-model-path", "/nonexistent"], "--draft-model-path /nonexistent"),
        (["--num-decode-workers", "0"], "--num-decode-workers"),
        (["--zmq-decode-addrs", "tcp://10.1.2.3:9"], "--zmq-curve-dir"),
        (["--zmq-hmac-key-file", "/nonexistent"], "--zmq-hmac-key-file /nonexistent"),
        (["--port", "0"], "--port"),
        (["--schedule-mode", "lagd"], "--schedule-mode 'lagd': unknown mode"),
        (["--decode-cpus", "0-x"], "--decode-cpus '0-x'"),
        (["--prefill-cpus", "100000"], "--prefill-cpus '100000': CPU ids [100000] do not exist"),
        (["--router-cpus", "0;0"], "--router-cpus '0;0': one CPU list"),
        (["--decode-cpus", "0;0"], "--decode-cpus: give one CPU list for every decode worker"),
        (["--startup-profile-rounds", "0"], "--startup-profile-rounds must be >= 1"),
        (["--plan-tie-margin", "1"], "--plan-tie-margin must be in [0, 1)"),
    ],
)
def test_cli_errors_name_the_flag(
    model: Path, flags: list[str], needle: str, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = flags if "--model-path" in flags else ["--model-path", str(model), *flags]
    assert main(argv) == 2
    assert needle in capsys.readouterr().err


def test_derived_addresses_for_several_workers(model: Path) -> None:
    args = build_parser().parse_args(
        [
            "--model-path",
            str(model),
            "--num-prefill-workers",
            "2",
            "--num-decode-workers",
            "3",
            "--zmq-port",
            "40000",
            "--speculative-algorithm",
            "none",
            "--page-size",
            "8",
        ]
    )
    cfg = config_from_args(args)
    assert cfg.serve.api_addr == "tcp://127.0.0.1:40000"
    assert cfg.serve.prefill_addrs == ("tcp://127.0.0.1:40001", "tcp://127.0.0.1:40002")
    assert cfg.serve.decode_addrs[-1] == "tcp://127.0.0.1:40005"
    assert cfg.cache.page_size == 8 and not cfg.draft.enabled
    assert cfg.draft.overlap is None  # the engine decides: on for CUDA, off on the CPU
    for flag, want in (("--disable-overlap-schedule", False), ("--enable-overlap-schedule", True)):
        got = build_parser().parse_args(["--model-path", str(model), flag])
        assert config_from_args(got).draft.overlap is want
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--enable-overlap-schedule", "--disable-overlap-schedule"])
    assert cfg.draft.selective_draft  # lagged drafts only the rows K admits unless told not to
    whole = build_parser().parse_args(["--model-path", str(model), "--disable-selective-draft"])
    assert not config_from_args(whole).draft.selective_draft
    assert cfg.draft.tie_margin == 0.0  # lagged takes the argmax K unless given a margin
    tied = build_parser().parse_args(["--model-path", str(model), "--plan-tie-margin", "0.05"])
    assert config_from_args(tied).draft.tie_margin == 0.05
    assert not cfg.draft.lag_shrink  # lagged reads its lagged confidences at face value
    shrunk = build_parser().parse_args(["--model-path", str(model), "--enable-lag-shrink"])
    assert config_from_args(shrunk).draft.lag_shrink
    assert cfg.draft.step_bias  # lagged corrects the model's drafting-over-plain error
    plain = build_parser().parse_args(["--model-path", str(model), "--disable-step-bias"])
    assert not config_from_args(plain).draft.step_bias
    assert cfg.draft.resume_charge  # leaving a plain run pays for the context it queued
    free = build_parser().parse_args(["--model-path", str(model), "--disable-resume-charge"])
    assert not config_from_args(free).draft.resume_charge
    assert cfg.model.cpu_malloc_keep_mib == 256  # a CPU engine keeps freed heap for reuse
    kept = build_parser().parse_args(["--model-path", str(model), "--cpu-malloc-keep-mib", "0"])
    assert config_from_args(kept).model.cpu_malloc_keep_mib == 0
    wild = build_parser().parse_args(["--model-path", str(model), "--cpu-malloc-keep-mib", "-1"])
    with pytest.raises(ConfigError, match="--cpu-malloc-keep-mib"):
        config_from_args(wild)
    assert cfg.draft.step_bias_prior == DEFAULT_PRIOR == 0.04  # drafting 4 % dear until measured
    none = build_parser().parse_args(["--model-path", str(model), "--step-bias-prior", "0"])
    assert config_from_args(none).draft.step_bias_prior == 0.0
    for bad in ("1", "-0.5", "nan"):
        wild = build_parser().parse_args(["--model-path", str(model), "--step-bias-prior", bad])
        with pytest.raises(ConfigError, match="--step-bias-prior"):
            config_from_args(wild)
    assert cfg.draft.draft_price_prior_weight == DRAFT_PRIOR_WEIGHT == 8.0
    light = ["--model-path", str(model), "--draft-price-prior-weight", "2"]
    assert config_from_args(build_parser().parse_args(light)).draft.draft_price_prior_weight == 2
    for bad in ("-1", "nan", "inf"):
        wild = build_parser().parse_args(
            ["--model-path", str(model), "--draft-price-prior-weight", bad]
        )
        with pytest.raises(ConfigError, match="--draft-price-prior-weight"):
            config_from_args(wild)
    assert cfg.draft.replan_every == 8  # a pinned lagged K is searched again every 8 steps
    every = build_parser().parse_args(["--model-path", str(model), "--lagged-replan-every", "1"])
    assert config_from_args(every).draft.replan_every == 1
    never = build_parser().parse_args(["--model-path", str(model), "--lagged-replan-every", "0"])
    with pytest.raises(ConfigError, match="--lagged-replan-every"):
        config_from_args(never)


def test_generate_curve_keys(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--gen-curve-keys", str(tmp_path / "k")]) == 0
    assert (tmp_path / "k" / "cluster.key_secret").is_file()


def test_kv_block_order_flag_reaches_the_cache_config(
    model: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    base = ["--model-path", str(model)]
    assert config_from_args(build_parser().parse_args(base)).cache.block_order == "lowest"
    fifo = build_parser().parse_args([*base, "--kv-block-order", "fifo"])
    assert config_from_args(fifo).cache.block_order == "fifo"
    with pytest.raises(SystemExit) as bad:
        main([*base, "--kv-block-order", "random"])
    assert bad.value.code == 2
    assert "--kv-block-order" in capsys.readouterr().err


def test_cpu_flags_reach_the_config(model: Path) -> None:
    args = build_parser().parse_args(
        [
            "--model-path",
            str(model),
            "--speculative-algorithm",
            "none",
            "--num-decode-workers",
            "2",
            "--router-cpus",
            "0",
            "--prefill-cpus",
            "0",
            "--decode-cpus",
            "0;0",
        ]
    )
    s = config_from_args(args).serve
    assert (s.router_cpus, s.prefill_cpus, s.decode_cpus) == ((0,), ((0,),), ((0,), (0,)))
