"""The gateway's rate limit for clients without an API key (audit G5, seed 000's nginx
`limit_req_zone $binary_remote_addr`): one bucket per client address, not one shared
by every keyless client; X-Forwarded-For only from --forwarded-allow-ips proxies.

Real `pagefleet gateway` processes, real clients bound to different loopback
addresses (127.0.0.x). The model's only replica is never up: the rate limit is
checked before anything else, so a request that passes it gets the 404 of an unknown
model and one that does not gets the 429; no backend is needed to tell them apart.
The refill rate is one token per 1000 s, so no count depends on timing.

Behind a trusted proxy the client is the right-most X-Forwarded-For entry that is not
a trusted proxy, always a parsed IP address (IPv6 by its /64): the left-most entries
are the client's own writing, so rotating them, or writing garbage, buys no bucket.
"""

from __future__ import annotations

import itertools

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


def test_a_wider_client_network_shares_one_bucket(models_file, tmp_path):
    # --rate-limit-ipv4-prefix 24: every 127.0.0.x client is one client (a NAT pool, a
    # site), so the second address finds the first one's burst spent; IPv6 clients by
    # their /48 behind the trusted proxy.
    gw = gateway(models_file, tmp_path, "--rate-limit-ipv4-prefix", "24",
                 "--rate-limit-ipv6-prefix", "48", "--forwarded-allow-ips", "127.0.0.9")
    try:
        assert statuses(gw, 2, "127.0.0.2") == [404, 404]
        assert post(gw, "127.0.0.3").status_code == 429
        v6 = {"X-Forwarded-For": "2001:db8:1:2::1"}
        assert statuses(gw, 2, "127.0.0.9", **v6) == [404, 404]
        assert post(gw, "127.0.0.9", **{"X-Forwarded-For": "2001:db8:1:ff::1"}).status_code == 429
        assert post(gw, "127.0.0.9", **{"X-Forwarded-For": "2001:db8:2::1"}).status_code == 404
    finally:
        gw.close()


_n = itertools.count(1)


def spoof() -> str:
    """A fresh client-written address per call (what a client rotating the header sends)."""
    i = next(_n)
    return f"203.0.{i // 250}.{i % 250 + 1}"


def test_forwarded_for_star_takes_the_right_most_entry_not_the_client_written_one(
        models_file, tmp_path):
    # '*' (e.g. ingress pods whose addresses change): the client's address is the entry
    # the nearest proxy appended; a fresh left-most entry per request is never limited
    # otherwise (uvicorn's '*' takes the left-most, and a proxy such as nginx's
    # $proxy_add_x_forwarded_for keeps what the client sent).
    gw = gateway(models_file, tmp_path, "--forwarded-allow-ips", "*")
    try:
        assert "--forwarded-allow-ips '*'" in gw.output()      # the startup warning
        assert "picks its rate-limit bucket" in gw.output()
        got = [post(gw, **{"X-Forwarded-For": f"{spoof()}, 10.0.0.1"}).status_code
               for _ in range(4)]
        assert got == [404, 404, 429, 429]
        # The proxy's other clients keep their own buckets.
        assert statuses(gw, 2, **{"X-Forwarded-For": f"{spoof()}, 10.0.0.2"}) == [404, 404]
    finally:
        gw.close()


def test_forwarded_for_is_read_from_the_right_and_must_be_an_address(models_file, tmp_path):
    gw = gateway(models_file, tmp_path, "--forwarded-allow-ips", "127.0.0.1,10.9.0.0/16")
    try:
        # Past the trusted hop 10.9.0.5 to the right-most untrusted entry, 10.0.0.1;
        # the rotated left-most one is ignored.
        got = [post(gw, **{"X-Forwarded-For": f"{spoof()}, 10.0.0.1, 10.9.0.5"}).status_code
               for _ in range(3)]
        assert got == [404, 404, 429]
        # Entries that are not addresses buy no bucket: the peer's (127.0.0.1) counts,
        # 15 KB of rotated text included, and the peer's own requests share it.
        assert post(gw, **{"X-Forwarded-For": "garbage-1"}).status_code == 404
        assert post(gw, **{"X-Forwarded-For": f"{'x' * 15000}-2"}).status_code == 404
        assert post(gw, **{"X-Forwarded-For": "garbage-3"}).status_code == 429
        assert post(gw, **{"X-Forwarded-For": f"10.0.0.3, {'y' * 15000}"}).status_code == 429
        assert post(gw).status_code == 429
        # IPv6 clients get a bucket per /64: two addresses of one /64 share it ...
        assert post(gw, **{"X-Forwarded-For": "2001:db8:1:2::1"}).status_code == 404
        assert post(gw, **{"X-Forwarded-For": "[2001:db8:1:2:ab::9]:443"}).status_code == 404
        assert post(gw, **{"X-Forwarded-For": "2001:db8:1:2:ffff::1"}).status_code == 429
        # ... and the next /64 is another client.
        assert post(gw, **{"X-Forwarded-For": "2001:db8:1:3::1"}).status_code == 404
    finally:
        gw.close()
