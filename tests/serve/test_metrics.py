"""/metrics through prometheus_client: content negotiation and requests with ignored fields."""

from __future__ import annotations

import re

import httpx

from tests.serve.conftest import API_KEY


def _value(text: str, name: str, labels: str = "") -> float:
    match = re.search(rf"^{name}{re.escape(labels)}(?:{{[^}}]*}})? (\S+)$", text, re.M)
    return float(match.group(1)) if match else 0.0


def test_ignored_fields_are_counted_and_logged_once(server):
    def post(body):
        r = httpx.post(server.base_url + "/v1/chat/completions", headers={"Authorization": f"Bearer {API_KEY}"},
                       json={"model": "tiny-model", "max_tokens": 1, **body}, timeout=30)
        assert r.status_code == 200, r.text
        return httpx.get(server.base_url + "/metrics").text

    name = "astrai_requests_with_ignored_fields_total"
    route = '{route="/v1/chat/completions"}'
    before = _value(httpx.get(server.base_url + "/metrics").text, name, route)
    plain = post({"messages": [{"role": "user", "content": "hi"}]})
    assert _value(plain, name, route) == before
    odd = post({"messages": [{"role": "user", "content": "hi", "mood": "x"}], "reasoning_effort": "low"})
    assert _value(odd, name, route) == before + 1
    assert _value(post({"messages": [{"role": "user", "content": "hi"}], "reasoning_effort": "low"}), name,
                  route) == before + 2


def test_openmetrics_when_asked_for(server):
    plain = httpx.get(server.base_url + "/metrics")
    assert plain.headers["content-type"].startswith("text/plain") and "astrai_http_requests_total" in plain.text
    om = httpx.get(server.base_url + "/metrics", headers={"Accept": "application/openmetrics-text; version=1.0.0"})
    assert om.headers["content-type"].startswith("application/openmetrics-text")
    assert om.text.rstrip().endswith("# EOF")
