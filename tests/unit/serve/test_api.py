"""The HTTP front without workers: no torch in the process, auth, refusals, OpenAI error shape."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml
from fastapi.testclient import TestClient

from dspark_sglang.config import Config, ModelConfig, ServeConfig
from dspark_sglang.serve.api import MAX_BODY_BYTES, create_app
from tests.conftest import write_char_tokenizer

API = Path(__file__).resolve().parents[3] / "dspark_sglang" / "serve" / "api.py"
ALLOWED = {
    "config",
    "types",
    "serve.messages",
    "serve.transport",
    "chat_template",
    "engine.detokenizer",
}


def test_api_imports_no_torch() -> None:
    code = "import sys, dspark_sglang.serve.api; assert 'torch' not in sys.modules, 'torch'"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_api_imports_only_the_allowed_package_modules() -> None:
    mods = set()
    for node in ast.walk(ast.parse(API.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module.startswith("dspark_sglang."):
            base = node.module.removeprefix("dspark_sglang.")
            mods |= {f"{base}.{a.name}" if base == "serve" else base for a in node.names}
        elif isinstance(node, ast.Import):
            mods |= {a.name for a in node.names if a.name.startswith("dspark_sglang")}
    assert mods <= ALLOWED, mods - ALLOWED


@pytest.fixture
def client(tmp_path: Path) -> Iterator[TestClient]:
    model = tmp_path / "m"
    model.mkdir()
    (model / "config.json").write_text(
        json.dumps(
            {
                "architectures": ["Qwen3ForCausalLM"],
                "vocab_size": 128,
                "hidden_size": 64,
                "intermediate_size": 96,
                "num_hidden_layers": 2,
                "num_attention_heads": 4,
                "num_key_value_heads": 2,
                "head_dim": 16,
                "max_position_embeddings": 256,
            }
        )
    )
    write_char_tokenizer(model)
    ipc = lambda n: f"ipc://{tmp_path}/{n}"
    serve = ServeConfig(
        api_key="k", api_addr=ipc("a"), prefill_addrs=(ipc("p"),), decode_addrs=(ipc("d"),)
    )
    with TestClient(create_app(Config(ModelConfig(str(model)), serve=serve))) as c:
        yield c


AUTH = {"Authorization": "Bearer k"}


def test_api_key_on_every_route_but_health(client: TestClient) -> None:
    assert client.get("/health").status_code == 200
    for path in ("/ready", "/metrics", "/v1/models"):
        r = client.get(path)
        assert r.status_code == 401 and "API key" in r.json()["error"]["message"]
    assert client.get("/v1/models", headers={"Authorization": "Bearer wrong"}).status_code == 401
    assert client.get("/v1/models", headers=AUTH).json()["data"][0]["id"] == "m"


def test_no_workers_is_503_with_retry_after(client: TestClient) -> None:
    assert client.get("/ready", headers=AUTH).status_code == 503
    r = client.post("/v1/completions", json={"prompt": "hi"}, headers=AUTH)
    assert r.status_code == 503 and r.headers["retry-after"] == "2"
    assert r.json()["error"]["type"] == "server_error"


def test_refusals_before_any_worker_is_asked(client: TestClient) -> None:
    cases = [
        ({"prompt": "hi", "n": 2}, "n=2 is not supported"),
        ({"prompt": "hi", "logprobs": 3}, "logprobs"),
        ({"prompt": ["a", "b"]}, "batched prompts"),
        ({"prompt": "hi", "top_p": 0}, "top_p"),
        ({"prompt": "hi", "stop": ["s"] * 17}, "stop"),
        ({"prompt": "hi", "max_tokens": 255}, "context length 256"),
        ({"prompt": "hi", "unknown": True}, "unknown: Extra inputs are not permitted"),
    ]
    for body, needle in cases:
        r = client.post("/v1/completions", json=body, headers=AUTH)
        assert r.status_code == 400 and needle in r.json()["error"]["message"], (body, r.text)
    r = client.post(
        "/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}]}, headers=AUTH
    )
    assert r.status_code == 400 and "chat template" in r.json()["error"]["message"]


def test_oversized_body_is_413(client: TestClient) -> None:
    r = client.post(
        "/v1/completions",
        content=b" " * (MAX_BODY_BYTES + 1),
        headers={**AUTH, "content-type": "application/json"},
    )
    assert r.status_code == 413


def test_capacity_serves_each_decode_workers_live_model(client: TestClient) -> None:
    """GET /capacity: 404 until a worker sent a capacity model, then its model per worker (JSON),
    or one worker's as a profile (YAML) that validates; bad parameters are a 4xx naming them."""
    from dspark_sglang.algo.capacity import CapacityModel, Curve, TableModel
    from dspark_sglang.capacity_profile import live_profile, profile_from_dict

    r = client.get("/capacity", headers=AUTH)
    assert r.status_code == 404 and "capacity-driven" in r.json()["error"]["message"]
    model = CapacityModel(TableModel((1, 8), (0.01, 0.03)), draft=Curve((1.0,), (0.002,)))
    profile = live_profile(
        model,
        name="live-decode0",
        hardware="cpu",
        target="m",
        drafter="d",
        ep=1,
        gamma=4,
        command="c",
        notes="n",
    )
    payload = {"version": 0, "observed": 0, "drift_events": 0, "mape": -1.0, "profile": profile}
    client.app.state.api.router.workers["decode0"].capacity = payload
    got = client.get("/capacity", headers=AUTH).json()
    assert got == {"workers": {"decode0": payload}}
    r = client.get("/capacity?format=profile", headers=AUTH)
    assert r.status_code == 200 and r.headers["content-type"].startswith("application/yaml")
    assert profile_from_dict(yaml.safe_load(r.text)).model == model
    assert client.get("/capacity?worker=decode0&format=profile", headers=AUTH).status_code == 200
    r = client.get("/capacity?worker=prefill0", headers=AUTH)
    assert r.status_code == 404 and "no capacity model" in r.json()["error"]["message"]
    r = client.get("/capacity?worker=nope", headers=AUTH)
    assert r.status_code == 404 and "nope" in r.json()["error"]["message"]
    r = client.get("/capacity?format=csv", headers=AUTH)
    assert r.status_code == 400 and "format" in r.json()["error"]["message"]
    assert client.get("/capacity").status_code == 401


def test_metrics_export_each_workers_speculation_counters(client: TestClient) -> None:
    """Every heartbeat's counters since boot become dspark_spec_*_total{worker} counters (and
    per position): the series a load generator differences for exact per-run acceptance."""
    from prometheus_client.parser import text_string_to_metric_families

    from dspark_sglang.serve import messages as m

    w = client.app.state.api.router.workers["decode0"]
    counts = m.SpecCounts(9, 30, 40, 21, 49, 3, [9, 7, 0], [7, 5, 0])
    hand = m.Handshake(1, "m", 2, 2, 16, 16, "float32", (), 0, 0)
    w.hb = m.Heartbeat("decode0", 1, hand, 3, 0, 5, 8, beats=4, counts=counts)
    got = {
        (s.name, s.labels.get("worker"), s.labels.get("position")): s.value
        for fam in text_string_to_metric_families(client.get("/metrics", headers=AUTH).text)
        for s in fam.samples
    }
    assert got[("dspark_worker_heartbeats_total", "decode0", None)] == 4
    assert got[("dspark_worker_boot", "decode0", None)] == 1
    assert got[("dspark_spec_rounds_total", "decode0", None)] == 9
    assert got[("dspark_spec_committed_tokens_total", "decode0", None)] == 30
    assert got[("dspark_spec_verified_drafts_total", "decode0", None)] == 40
    assert got[("dspark_spec_accepted_drafts_total", "decode0", None)] == 21
    assert got[("dspark_spec_verify_tokens_total", "decode0", None)] == 49
    assert got[("dspark_spec_steps_total", "decode0", None)] == 3
    assert got[("dspark_spec_at_risk_total", "decode0", "2")] == 7
    assert got[("dspark_spec_passed_total", "decode0", "1")] == 7
    assert ("dspark_spec_rounds_total", "prefill0", None) not in got  # no heartbeat yet
