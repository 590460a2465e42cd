"""Sampling parameters and config values are validated where they are built."""

from __future__ import annotations

import pytest

from dspark_sglang.config import CacheConfig, ConfigError, DraftConfig, ModelConfig, SchedConfig
from dspark_sglang.types import SamplingParams, ScheduledSeq, StepPlan


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"temperature": -1.0}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": -2}, "top_k"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"seed": -1}, "seed"),
        ({"stop": ("",)}, "stop"),
        ({"stop": tuple("abcdefghijklmnopq")}, "stop"),
    ],
)
def test_bad_sampling_params(kwargs: dict, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        SamplingParams(**kwargs)


@pytest.mark.parametrize(
    ("build", "match"),
    [
        (lambda: ModelConfig("m", dtype="int8"), "--dtype"),
        (lambda: ModelConfig("m", max_model_len=0), "--max-model-len"),
        (lambda: ModelConfig("m", tap_layer_ids=(3, 1)), "strictly increasing"),
        (lambda: CacheConfig(page_size=0), "--page-size"),
        (lambda: CacheConfig(num_blocks=0), "--num-blocks"),
        (lambda: SchedConfig(max_running_requests=0), "--max-running-requests"),
        (lambda: SchedConfig(max_num_batched_tokens=4), "--max-num-batched-tokens"),
        (lambda: SchedConfig(chunked_prefill_size=0), "--chunked-prefill-size"),
        (lambda: DraftConfig(user_rate_floor=1.5), "--user-rate-floor"),
        (lambda: DraftConfig(user_rate_floor=-0.1), "--user-rate-floor"),
    ],
)
def test_bad_config_values_name_the_flag(build: object, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        build()  # type: ignore[operator]


def test_step_plan_counts() -> None:
    plan = StepPlan((ScheduledSeq(0, 0, 5, True), ScheduledSeq(1, 9, 1, True)))
    assert plan.num_tokens == 6 and not plan.is_empty and StepPlan(()).is_empty
    assert SamplingParams(temperature=0).greedy and not SamplingParams().greedy
