"""/metrics against a real server: vLLM's older metric names (seed 002's alerts), the
HTTP request counter that sees rejections, and a warm-up that stays out of the
prefix-cache counters (audit G1, G3, G9)."""

from __future__ import annotations

import os
import signal

import httpx
import pytest

from tests.server.helpers_serve import ThreadServer, metric, wait_for


@pytest.fixture(scope="module")
def srv(tiny_models):
    # A queue of 2: with the core process stopped, two accepted requests fill it and a
    # third gets the 429 (no race: nothing is scheduled while the core is stopped).
    server = ThreadServer(tiny_models("qwen3"), max_num_seqs=4, max_num_queued_requests=2,
                          enable_prefix_caching=True).start()
    yield server
    server.stop()


def test_a_fresh_server_reports_no_prefix_cache_lookups(srv):
    """The warm-up request runs through the engine, but the counters start at 0 (the
    docs keep warm-up out of the metrics). First in the module: no user request yet."""
    text = srv.metrics()
    assert metric(text, "vllm:prefix_cache_queries_total") == 0
    assert metric(text, "vllm:prefix_cache_hits_total") == 0
    assert metric(text, "vllm:gpu_prefix_cache_queries_total") == 0


def _gen(srv, prompt: str, **kw) -> httpx.Response:
    return httpx.post(srv.url + "/v1/completions", timeout=120,
                      json={"model": "tiny", "prompt": prompt, "max_tokens": 4,
                            "ignore_eos": True, **kw})


def test_older_vllm_names_carry_the_same_values(srv):
    """vllm:gpu_cache_usage_perc and vllm:gpu_prefix_cache_{queries,hits}_total (the names
    of older vLLM releases that carried-over alerts read) equal the current series."""
    long = "the scheduler sends a batch of requests to the model " * 6
    for _ in range(2):          # the second one hits the first one's cached blocks
        assert _gen(srv, long).status_code == 200
    text = srv.metrics()
    for old, new in (("vllm:gpu_cache_usage_perc", "vllm:kv_cache_usage_perc"),
                     ("vllm:gpu_prefix_cache_queries_total", "vllm:prefix_cache_queries_total"),
                     ("vllm:gpu_prefix_cache_hits_total", "vllm:prefix_cache_hits_total")):
        assert metric(text, old, model_name="tiny", engine="0") == metric(text, new), old
    assert metric(text, "vllm:gpu_prefix_cache_hits_total") > 0
    assert "# TYPE vllm:gpu_prefix_cache_queries_total counter" in text or \
        "# TYPE vllm:gpu_prefix_cache_queries counter" in text
    assert "# TYPE vllm:gpu_cache_usage_perc gauge" in text


def _http(text: str, **labels: str) -> float:
    try:
        return metric(text, "http_requests_total", **labels)
    except KeyError:
        return 0.0


def test_http_requests_total_counts_rejections(srv):
    """A 400, a 404 on an unknown path and a 429 from the full queue each land in
    http_requests_total{handler,method,status}, with the route template as handler."""
    before = srv.metrics()
    comp = dict(handler="/v1/completions", method="POST")
    # 400: a prompt longer than the context.
    r = _gen(srv, "word " * 2000)
    assert r.status_code == 400, r.text
    # 404s on made-up paths share one handler label ("none"), whatever the path.
    for path in ("/v1/nothing-here", "/a/b/c", "/x?y=1"):
        assert httpx.get(srv.url + path).status_code == 404
    # 429: stop the core; the 4 free rows and the queue of 2 fill (the free rows'
    # share of a burst is not queued), the seventh finds the queue full.
    core = srv.served.core.proc.pid
    os.kill(core, signal.SIGSTOP)
    try:
        with httpx.Client(timeout=120) as c:
            import threading

            waiting = [threading.Thread(target=_gen, args=(srv, f"waiting {i}"), daemon=True)
                       for i in range(6)]
            for t in waiting:
                t.start()
            wait_for(lambda: metric(srv.metrics(), "vllm:num_requests_waiting") == 6, 60,
                     what="six waiting requests")
            r = c.post(srv.url + "/v1/completions",
                       json={"model": "tiny", "prompt": "one too many", "max_tokens": 4})
            assert r.status_code == 429, r.text
    finally:
        os.kill(core, signal.SIGCONT)
    for t in waiting:
        t.join(120)
    after = srv.metrics()

    def delta(**labels):
        return _http(after, **labels) - _http(before, **labels)

    assert delta(status="400", **comp) == 1
    assert delta(status="429", **comp) == 1
    assert delta(status="200", **comp) == 6
    assert delta(handler="none", method="GET", status="404") == 3
    assert "/a/b/c" not in after and "/v1/nothing-here" not in after
    # Probes and scrapes are not counted (as vLLM's instrumentator excludes them).
    httpx.get(srv.url + "/health")
    assert 'handler="/metrics"' not in srv.metrics()
    assert 'handler="/health"' not in srv.metrics()


def test_shipped_alerts_read_series_this_server_exports(srv):
    """Every server metric the PrometheusRule in manifests/monitoring queries (the
    chart's render) is one a live server exports, the rejections alert's included."""
    import yaml

    from tests.deploy.render import REPO
    from tests.deploy.test_chart import metric_names

    rule = yaml.safe_load((REPO / "manifests/monitoring/prometheusrule.yaml").read_text())
    queried = {n for g in rule["spec"]["groups"] for r in g["rules"]
               for n in metric_names(r["expr"])}
    assert "http_requests_total" in queried
    exported = {line.split("{")[0].split(" ")[0] for line in srv.metrics().splitlines()
                if line and not line.startswith("#")}
    missing = {n for n in queried if n.startswith(("vllm:", "http_"))} - exported
    assert not missing, missing


def test_http_requests_total_counts_requests_refused_before_routing(tiny_models):
    """401 (API key) and 413 (body cap) are answered by middleware before any route
    runs; they still count, under their route's template."""
    server = ThreadServer(tiny_models("qwen3"), api_key="k", max_request_body_bytes=1024).start()
    try:
        assert httpx.get(server.url + "/v1/models").status_code == 401
        big = httpx.post(server.url + "/v1/completions", content=b"x" * 4096,
                         headers={"Authorization": "Bearer k",
                                  "Content-Type": "application/json"})
        assert big.status_code == 413
        ok = httpx.get(server.url + "/v1/models/tiny", headers={"Authorization": "Bearer k"})
        assert ok.status_code == 200
        text = server.metrics()
        assert metric(text, "http_requests_total", handler="/v1/models", method="GET",
                      status="401") == 1
        assert metric(text, "http_requests_total", handler="/v1/completions", method="POST",
                      status="413") == 1
        # (a template with braces: read the line itself, the helper's parser stops at "}")
        assert 'http_requests_total{handler="/v1/models/{model_id:path}",method="GET",' \
            'status="200"} 1.0' in text
    finally:
        server.stop()
