"""Auth: with --api-key, every route but /health answers 401 without the exact Bearer key, and
an unauthenticated request never reaches a worker. Routes come from the live /openapi.json
(plus FastAPI's doc routes and an unknown path), so a new route is covered automatically.
"""

from __future__ import annotations

import httpx
import pytest

from tests.integration.conftest import Cluster
from tests.reliability.conftest import API_KEY

pytestmark = pytest.mark.timeout(120)
DOC_ROUTES = ("/openapi.json", "/docs", "/redoc", "/docs/oauth2-redirect")  # FastAPI's, GET
BAD_AUTH = [
    {},
    {"Authorization": ""},
    {"Authorization": "Bearer"},
    {"Authorization": f"Bearer {API_KEY}x"},
    {"Authorization": f"Bearer {API_KEY[:-1]}"},
    {"Authorization": f"Bearer  {API_KEY}"},
    {"Authorization": f"Basic {API_KEY}"},
    {"Authorization": API_KEY},
    {"X-API-Key": API_KEY},
    {"Api-Key": API_KEY},
]
GOOD = {"Authorization": f"Bearer {API_KEY}"}
BODIES = {
    "/v1/completions": {"prompt": "hi", "max_tokens": 2},
    "/v1/chat/completions": {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
}


def routes(c: Cluster) -> list[tuple[str, str]]:
    spec = httpx.get(f"{c.url}/openapi.json", headers=GOOD, timeout=10).json()
    found = [(m.upper(), p) for p, ops in spec["paths"].items() for m in ops]
    assert {p for _, p in found} == {
        "/health",
        "/ready",
        "/metrics",
        "/capacity",
        "/v1/models",
        "/v1/completions",
        "/v1/chat/completions",
    }, "a route was added: check it belongs behind the key (the guard covers it anyway)"
    return found + [("GET", p) for p in DOC_ROUTES] + [("GET", "/no/such/route")]


def dispatched(c: Cluster) -> float:
    text = httpx.get(f"{c.url}/metrics", headers=GOOD, timeout=10).text
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("dspark_worker_requests_total{")
    )


def test_every_route_but_health_needs_the_key(secure: Cluster) -> None:
    before = dispatched(secure)
    checked, all_routes = 0, routes(secure)
    for method, path in all_routes:
        body = BODIES.get(path)
        for headers in BAD_AUTH:
            r = httpx.request(method, f"{secure.url}{path}", json=body, headers=headers)
            if path == "/health":
                assert r.status_code == 200, (method, path, headers)
            else:
                assert r.status_code == 401, (method, path, headers, r.status_code)
                assert "API key" in r.json()["error"]["message"]
            checked += 1
        r = httpx.request(method, f"{secure.url}{path}", json=body, headers=GOOD, timeout=30)
        # /capacity: past the key, its own 404 (this cluster has no drafter, so no capacity model)
        want = 404 if path in ("/no/such/route", "/capacity") else 200
        assert r.status_code == want, (method, path, r.status_code, r.text[:200])
        if path == "/capacity":
            assert "no capacity model" in r.json()["error"]["message"]
    print(f"[reliability] auth: {checked} unauthenticated requests, {len(all_routes)} routes")
    # Only the two authenticated generation requests reached a worker (prefill + decode each).
    assert dispatched(secure) - before == 4


def test_unauthenticated_body_is_refused_before_it_is_read(secure: Cluster) -> None:
    big = b"x" * (9 << 20)
    r = httpx.post(f"{secure.url}/v1/completions", content=big, timeout=30)
    assert r.status_code == 401  # not 413: the key is checked first, the body never parsed
    r = httpx.post(f"{secure.url}/v1/completions", content=big, headers=GOOD, timeout=30)
    assert r.status_code == 413
