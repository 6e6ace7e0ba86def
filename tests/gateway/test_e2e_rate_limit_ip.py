"""The gateway's rate limit for clients without an API key (audit G5, seed 000's nginx
`limit_req_zone $binary_remote_addr`): one bucket per client address, not one shared
by every keyless client; X-Forwarded-For only from --forwarded-allow-ips proxies.

Real `pagefleet gateway` processes, real clients bound to different loopback
addresses (127.0.0.x). The model's only replica is never up: the rate limit is
checked before anything else, so a request that passes it gets the 404 of an unknown
model and one that does not gets the 429; no backend is needed to tell them apart.
The refill rate is one token per 1000 s, so no count depends on timing.
"""

from __future__ import annotations

import httpx
import pytest

from tests.gateway.helpers import GatewayProcess, models_yaml
from tests.server.helpers_serve import free_port


@pytest.fixture(scope="module")
def models_file(tmp_path_factory):
    d = tmp_path_factory.mktemp("rl")
    return models_yaml(d / "m.yaml", [{"name": "tiny", "pools": [{
        "name": "p", "endpoints": [{"name": "down", "url": f"http://127.0.0.1:{free_port()}"}]}]}])


def gateway(models_file, tmp_path, *extra: str) -> GatewayProcess:
    return GatewayProcess(["--models-file", str(models_file), "--rate-limit", "0.001",
                           "--rate-limit-burst", "2", *extra], tmp_path / "gw.log",
                          port=0).wait_ready()


def post(gw: GatewayProcess, source: str = "127.0.0.1", **headers: str) -> httpx.Response:
    transport = httpx.HTTPTransport(local_address=source)
    with httpx.Client(transport=transport, timeout=60) as c:
        return c.post(gw.url + "/v1/completions", headers=headers,
                      json={"model": "no-such-model", "prompt": "hi", "max_tokens": 1})


def statuses(gw, n, source="127.0.0.1", **headers) -> list[int]:
    return [post(gw, source, **headers).status_code for _ in range(n)]


def test_keyless_clients_get_a_bucket_per_address(models_file, tmp_path):
    gw = gateway(models_file, tmp_path)
    try:
        assert statuses(gw, 2, "127.0.0.2") == [404, 404]    # passed the limit
        r = post(gw, "127.0.0.2")
        assert r.status_code == 429 and int(r.headers["retry-after"]) >= 1
        err = r.json()["error"]
        assert err["type"] == "RateLimitError"
        assert "for this API key" not in err["message"]          # none was sent
        assert err["message"].startswith("rate limit exceeded for this client address")
        # Another keyless client is not limited by the first one's burst.
        assert statuses(gw, 2, "127.0.0.3") == [404, 404]
        assert post(gw, "127.0.0.3").status_code == 429
        # X-Forwarded-For is not honoured without --forwarded-allow-ips, even from
        # loopback (uvicorn trusts 127.0.0.1 by default): a client cannot pick a
        # fresh bucket by sending the header.
        assert statuses(gw, 2) == [404, 404]
        assert statuses(gw, 2, **{"X-Forwarded-For": "10.1.1.1"}) == [429, 429]
        # A bearer token nobody verified (no --api-keys-file) buys no bucket of its own:
        # a made-up token per request would dodge the limit. Its address's bucket,
        # spent above, answers.
        assert post(gw, "127.0.0.2", Authorization="Bearer t1").status_code == 429
        r = post(gw, "127.0.0.4", Authorization="Bearer made-up-1")
        assert r.status_code == 404
        assert statuses(gw, 2, "127.0.0.4", Authorization="Bearer made-up-2") == [404, 429]
        assert "for this client address" in post(gw, "127.0.0.4").json()["error"]["message"]
    finally:
        gw.close()


def test_forwarded_for_from_a_trusted_proxy_names_the_client(models_file, tmp_path):
    gw = gateway(models_file, tmp_path, "--forwarded-allow-ips", "127.0.0.1")
    try:
        xff = {"X-Forwarded-For": "10.0.0.1"}
        assert statuses(gw, 2, **xff) == [404, 404]
        assert post(gw, **xff).status_code == 429
        # The proxy's other clients have buckets of their own ...
        assert statuses(gw, 2, **{"X-Forwarded-For": "10.0.0.2"}) == [404, 404]
        # ... and the header from an untrusted peer is ignored (its address counts).
        assert statuses(gw, 2, "127.0.0.4", **xff) == [404, 404]
        assert post(gw, "127.0.0.4", **{"X-Forwarded-For": "10.0.0.9"}).status_code == 429
    finally:
        gw.close()
