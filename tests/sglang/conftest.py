"""Tests against the real sglang==0.5.23 package on CPU (docs/sglang.md §7 has the install).

The plugin is loaded once per session the way SGLang loads it, `load_plugins()` over the entry
point group; its patches stay applied for the rest of the session (only sglang modules change).
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable, Iterator
from importlib.metadata import EntryPoint, entry_points
from pathlib import Path
from types import SimpleNamespace as NS
from typing import Any

import pytest
import torch

pytest.importorskip(
    "sglang", reason="sglang==0.5.23 is not installed (pip install --no-deps sglang==0.5.23)"
)

from dspark_sglang.algo.capacity import CapacityModel, TableModel
from dspark_sglang.capacity_profile import (
    EngineProfile,
    Parallelism,
    Provenance,
    save_profile,
)

GROUP = "sglang.srt.plugins"
ENTRY = EntryPoint(name="dspark", value="dspark_sglang.sglang_plugin:register", group=GROUP)
GAMMA = 4
# Graph tiers with a cliff after 16: the floor lookup prices B = 17..24 at the 16-token speed.
TIERS = (4, 8, 16, 24, 32)
SECONDS = (0.010, 0.011, 0.012, 0.020, 0.021)


def declared_entry_point() -> EntryPoint | None:
    """Our entry point if the installed dspark-sglang metadata declares it (pyproject lines)."""
    return next((ep for ep in entry_points(group=GROUP) if ep.name == "dspark"), None)


def make_profile(seconds: tuple[float, ...] = SECONDS, name: str = "test-tiers") -> EngineProfile:
    model = CapacityModel(TableModel(TIERS, seconds))
    return EngineProfile(
        name=name,
        engine="sglang",
        hardware="test",
        target="test",
        drafter=None,
        parallelism=Parallelism(),
        gamma=GAMMA,
        buckets=TIERS,
        model=model,
        provenance=Provenance("analytic", "tests/sglang", "2026-12-01", "test"),
    )


@pytest.fixture(scope="session")
def profile_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("profiles") / "tiers.yaml"
    save_profile(make_profile(), path)
    return path


@pytest.fixture(scope="session")
def plugin(profile_path: Path) -> Iterator[object]:
    """SGLang's own plugin loader runs our entry point (constructed when pyproject does not
    declare it yet) with SGLANG_PLUGINS=dspark."""
    import sglang.srt.plugins as plugins

    from dspark_sglang.sglang_plugin import hooks

    ep = declared_entry_point() or ENTRY
    real = plugins.entry_points
    plugins.entry_points = lambda group: [ep] if group == GROUP else real(group=group)
    saved = {k: os.environ.get(k) for k in ("SGLANG_PLUGINS", "DSPARK_SGLANG_PROFILE")}
    os.environ["SGLANG_PLUGINS"] = "dspark"
    os.environ["DSPARK_SGLANG_PROFILE"] = str(profile_path)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            plugins._plugins_loaded = False
            plugins.load_plugins()
    finally:
        plugins.entry_points = real
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    assert hooks.STATE.config is not None, "register() did not run"
    yield hooks.STATE


R = 6
POOL = 16


def fake_runner(generation: list[int], tiers: tuple[int, ...] = ()) -> NS:
    gen = torch.zeros(POOL, dtype=torch.int64)
    gen[: len(generation)] = torch.tensor(generation)
    graphs = NS(ragged_verify_mode=True, capture_num_tokens=list(tiers)) if tiers else None
    return NS(
        req_to_token_pool=NS(req_to_token=torch.zeros(POOL, 8), req_generation=gen),
        decode_cuda_graph_runner=graphs,
    )


@pytest.fixture
def sglang_planner(plugin: object, monkeypatch: pytest.MonkeyPatch) -> Callable[..., Any]:
    """Build SGLang's DSparkVerifyPlanner through its real __init__ (compact mode, overlap on)."""
    from sglang.srt.speculative.dspark_components import dspark_planner as dp

    def build(runner: NS, overlap: bool = True) -> object:
        spec = NS(
            speculative_dspark_align_verify_tokens_to_graph_tier=False,
            speculative_dspark_confidence_sts_path=None,
            speculative_dspark_sps_table_path=None,
        )
        monkeypatch.setattr(dp, "get_spec", lambda: spec)
        monkeypatch.setattr(dp, "get_schedule", lambda: NS(disable_overlap_schedule=not overlap))
        monkeypatch.setattr(dp, "is_dp_attention_enabled", lambda: False)
        monkeypatch.setenv("SGLANG_RAGGED_VERIFY_MODE", "compact")
        return dp.DSparkVerifyPlanner(
            draft_model=NS(confidence_head=object()),
            gamma=GAMMA,
            model_runner=runner,
            device="cpu",
            tp_rank=0,
            verify_num_draft_tokens=GAMMA + 1,
            tp_sync=NS(sync=lambda site, t: None),
        )

    return build


def batch_for(conf: torch.Tensor, gen: list[int], seq_lens: list[int]) -> tuple[NS, NS]:
    from sglang.srt.managers.overlap_utils import ResolvedConfidence

    n = conf.shape[0]
    batch = NS(
        spec_info=NS(verify_token_budget=None),
        forward_mode=NS(is_extend=lambda: False),
        is_extend_in_batch=False,
        req_pool_indices_cpu=torch.arange(n),
        batch_size=lambda: n,
        seq_lens_cpu=torch.tensor(seq_lens),
        spec_verify_tier_num_tokens=None,
    )
    resolved = ResolvedConfidence(confidence=conf, generation=torch.tensor(gen))
    return batch, NS(resolve_confidence_cpu=lambda b: resolved)
