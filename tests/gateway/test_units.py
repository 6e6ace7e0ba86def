"""Pure parts of the gateway: block hashes and the prefix index, admission, rate
limits, API keys, health, the /metrics parser, the fleet file and the CLI config."""

from __future__ import annotations

import hashlib

import httpx
import pytest

from pagefleet.server.api.errors import DRAINING_HEADER
from pagefleet.server.config import ConfigError
from pagefleet.server.engine.kv_cache import hash_block
from pagefleet.server.gateway.admission import (
    ClientNetworks,
    Queued,
    RateLimit,
    RateLimiter,
    TokenBucket,
    TrustedProxies,
    admit,
    client_key,
    parse_api_keys,
    retry_after_header,
)
from pagefleet.server.gateway.fleet import parse_fleet
from pagefleet.server.gateway.health import Health, on_check, on_drain, parse_metrics
from pagefleet.server.gateway.proxy import is_draining
from pagefleet.server.gateway.prefix import PrefixIndex, prompt_blocks, ring_key


# -- block hashes -----------------------------------------------------------------------------
def test_prompt_blocks_is_the_engines_chain_over_full_blocks():
    ids = list(range(3, 3 + 37))
    b = prompt_blocks(ids, 16)
    h0 = hash_block(None, ids[:16])
    assert b.hashes == (h0, hash_block(h0, ids[16:32]))
    assert b.lookup == 2 and b.lookup_hashes == b.hashes
    # The last prompt token never hits the cache: 32 tokens look up one block only.
    b32 = prompt_blocks(ids[:32], 16)
    assert len(b32.hashes) == 2 and b32.lookup == 1
    assert prompt_blocks(ids[:16], 16).lookup == 0 and ring_key(prompt_blocks(ids[:16], 16), 4) is None


def test_ring_key_covers_the_first_blocks_only():
    base = list(range(100, 100 + 16 * 6))
    a = prompt_blocks(base + [1, 2, 3], 16)
    b = prompt_blocks(base[:16 * 4] + list(range(500, 540)), 16)
    assert ring_key(a, 4) == ring_key(b, 4)            # same first 4 blocks
    c = prompt_blocks([7] + base[1:], 16)
    assert ring_key(c, 4) != ring_key(a, 4)
    short = prompt_blocks(base[:40], 16)                # 2 lookup blocks -> key of 2
    assert ring_key(short, 4)[1] == 1


def test_prefix_index_matches_leading_blocks_per_replica():
    idx = PrefixIndex(ttl=100)
    p = prompt_blocks(list(range(200)), 16)            # 12 full blocks
    idx.record("a", p, root=3, now=0.0)
    assert idx.match("a", p.lookup_hashes, 1.0) == 12
    assert idx.match("b", p.lookup_hashes, 1.0) == 0
    q = prompt_blocks(list(range(100)) + [999] * 100, 16)   # diverges inside block 6
    assert idx.match("a", q.lookup_hashes, 1.0) == 6
    assert idx.groups("a", 1.0) == 1
    idx.record("a", p, root=3, now=2.0)                # same group again: still one
    assert idx.groups("a", 2.0) == 1


def test_prefix_index_evicts_tail_blocks_first_and_ages_out():
    idx = PrefixIndex(ttl=10)
    p = prompt_blocks(list(range(160)), 16)            # 10 blocks
    idx.set_capacity("a", 6)
    idx.record("a", p, root=3, now=0.0)
    assert idx.size("a") == 6
    assert idx.match("a", p.lookup_hashes, 1.0) == 6   # the head survives, as in the engine
    assert idx.match("a", p.lookup_hashes, 10.5) == 0  # past the TTL
    assert idx.groups("a", 10.5) == 0
    idx.record("a", p, root=3, now=20.0)
    idx.forget("a")
    assert idx.match("a", p.lookup_hashes, 20.0) == 0


# -- admission ---------------------------------------------------------------------------------
def q(*prios) -> list[Queued]:
    return [Queued(p, i) for i, p in enumerate(prios)]


def test_admit_below_the_cap():
    assert admit(q(0, 5), 9, 3, None).kind == "enqueue"


def test_full_queue_refuses_the_least_urgent_first():
    full = q(0, 5, 5)
    assert admit(full, 5, 3, None).kind == "refuse"            # equal: newcomer loses
    assert admit(full, 9, 3, None).kind == "refuse"
    d = admit(full, 1, 3, None)                                 # more urgent: shed the worst
    assert d.kind == "shed" and d.victim == Queued(5, 2)       # the latest of the worst


def test_critical_requests_are_never_refused():
    assert admit(q(-5, -5), -5, 2, critical_priority=-1).kind == "enqueue"   # beyond the cap
    d = admit(q(-5, 0), -3, 2, critical_priority=-1)
    assert d.kind == "shed" and d.victim == Queued(0, 1)
    d = admit(q(-5, 0), 3, 2, critical_priority=-1)            # critical waiters are safe
    assert d.kind == "refuse"


def test_token_bucket_holds_the_rate_over_a_window():
    b = TokenBucket(RateLimit(rate=5, burst=10), now=0.0)
    allowed = sum(1 for i in range(2000) if b.take(i * 0.005) == 0.0)   # 10 s at 200/s
    assert abs(allowed - (10 + 5 * 10)) <= 1
    b = TokenBucket(RateLimit(rate=2, burst=1), now=0.0)
    assert b.take(0.0) == 0.0
    assert b.take(0.0) == pytest.approx(0.5)
    assert retry_after_header(0.5) == "1" and retry_after_header(2.1) == "3"


def test_rate_limiter_keeps_one_bucket_per_key():
    rl = RateLimiter(RateLimit(1, 1), max_keys=2)
    assert rl.check("a", None, 0.0) == 0.0 and rl.check("a", None, 0.0) > 0
    assert rl.check("b", None, 0.0) == 0.0
    assert rl.check("a", RateLimit(100, 5), 0.0) == 0.0        # a key's own limit
    assert RateLimiter(None).check("x", None, 0.0) == 0.0       # off


def test_client_key_is_a_parsed_address_ipv6_by_its_64():
    none = TrustedProxies(None)
    assert client_key(none, "127.0.0.2", []) == "addr:127.0.0.2"
    assert client_key(none, "::ffff:127.0.0.2", []) == "addr:127.0.0.2"      # v4-mapped
    # Two addresses of one IPv6 /64 share a bucket; the next /64 has its own.
    a = client_key(none, "2001:db8:1:2::1", [])
    assert a == "addr:2001:db8:1:2::/64"
    assert client_key(none, "2001:db8:1:2:ffff:ffff:ffff:ffff", []) == a
    assert client_key(none, "2001:DB8:1:2:0:0:0:7", []) == a
    assert client_key(none, "2001:db8:1:3::1", []) != a
    assert client_key(none, "fe80::1%eth0", []) == "addr:fe80::/64"
    # Without --forwarded-allow-ips the header is ignored.
    assert client_key(none, "127.0.0.1", ["10.0.0.1"]) == "addr:127.0.0.1"


def test_client_networks_set_how_wide_a_keyless_client_is():
    """--rate-limit-ipv4-prefix / --rate-limit-ipv6-prefix: one bucket per network of
    that width (a home line's /56, a NAT pool's /24), or per address at full width."""
    none = TrustedProxies(None)
    wide = ClientNetworks(ipv4=24, ipv6=48)
    assert client_key(none, "192.0.2.77", [], wide) == "addr:192.0.2.0/24"
    assert client_key(none, "192.0.2.1", [], wide) == client_key(none, "192.0.2.254", [], wide)
    assert client_key(none, "192.0.3.1", [], wide) == "addr:192.0.3.0/24"
    assert client_key(none, "::ffff:192.0.2.9", [], wide) == "addr:192.0.2.0/24"   # v4-mapped
    assert client_key(none, "2001:db8:1:2::1", [], wide) == "addr:2001:db8:1::/48"
    assert client_key(none, "2001:db8:1:ff::1", [], wide) == "addr:2001:db8:1::/48"
    assert client_key(none, "2001:db8:2::1", [], wide) == "addr:2001:db8:2::/48"
    exact = ClientNetworks(ipv4=32, ipv6=128)
    assert client_key(none, "2001:db8:1:2::1", [], exact) == "addr:2001:db8:1:2::1/128"
    assert client_key(none, "2001:db8:1:2::1", [], exact) != \
        client_key(none, "2001:db8:1:2::2", [], exact)
    assert client_key(none, "192.0.2.77", [], exact) == "addr:192.0.2.77"


@pytest.mark.parametrize("flag,value", [("--rate-limit-ipv4-prefix", "33"),
                                        ("--rate-limit-ipv4-prefix", "7"),
                                        ("--rate-limit-ipv6-prefix", "129"),
                                        ("--rate-limit-ipv6-prefix", "8")])
def test_client_network_widths_out_of_range_are_config_errors(flag, value):
    from pagefleet.server.cli import build_gateway_config
    with pytest.raises(ConfigError, match=flag):
        build_gateway_config(["--models-file", "x", flag, value])


def test_forwarded_for_is_read_from_the_right_past_trusted_proxies_only():
    p = TrustedProxies("127.0.0.1, 10.9.0.0/16")
    key = lambda *xff, peer="127.0.0.1": client_key(p, peer, list(xff))  # noqa: E731
    # The left-most entries are the client's own writing: the right-most untrusted counts.
    assert key("6.6.6.6, 10.0.0.1") == key("7.7.7.7, 10.0.0.1") == "addr:10.0.0.1"
    assert key("6.6.6.6, 10.0.0.1, 10.9.3.4") == "addr:10.0.0.1"     # past a trusted hop
    assert key("6.6.6.6", "10.0.0.1:5678") == "addr:10.0.0.1"         # two header lines, port
    assert key("[2001:db8::5]:443") == "addr:2001:db8::/64"
    # Not an address: the peer counts, no bucket of the header's text.
    assert key("x" * 15000) == key("nonsense, 10.9.0.1") == key("") == "addr:127.0.0.1"
    assert key("10.0.0.1, unknown") == "addr:127.0.0.1"
    # Every hop a trusted proxy: the left-most of them.
    assert key("10.9.0.1, 10.9.0.2") == "addr:10.9.0.1"
    # The header from a peer that is not a trusted proxy is ignored.
    assert key("10.0.0.1", peer="127.0.0.4") == "addr:127.0.0.4"
    # '*': any peer is a proxy, no address in the header is: the right-most entry.
    star = TrustedProxies("*")
    assert client_key(star, "192.0.2.1", ["6.6.6.6, 10.0.0.1"]) == "addr:10.0.0.1"
    assert client_key(star, "192.0.2.1", ["6.6.6.6, bogus"]) == "addr:192.0.2.1"
    with pytest.raises(ConfigError, match="forwarded-allow-ips"):
        TrustedProxies("10.0.0.0/8, proxy.local")


def test_api_keys_file():
    keys = parse_api_keys({"keys": [
        {"key": "sk-a", "name": "team-a", "requests_per_second": 2, "burst": 4},
        {"key_sha256": hashlib.sha256(b"sk-b").hexdigest()}]}, "keys.yaml", None)
    assert keys.lookup("sk-a").name == "team-a"
    assert keys.lookup("sk-a").limit == RateLimit(2.0, 4.0)
    assert keys.lookup("sk-b").limit is None and keys.lookup("sk-c") is None
    for bad, word in [({"keys": [{"name": "x"}]}, "exactly one of key"),
                      ({"keys": [{"key": "k", "requests_per_second": 0}]}, "requests_per_second"),
                      ({"keys": [{"key_sha256": "abc"}]}, "64 hex"),
                      ({"keys": [{"key": "k", "role": "x"}]}, "unknown field"),
                      ({"users": []}, "'keys' list")]:
        with pytest.raises(ConfigError, match=word):
            parse_api_keys(bad, "keys.yaml", None)


# -- health ------------------------------------------------------------------------------------
def test_three_failed_checks_in_a_row_take_a_replica_out():
    h = Health()
    assert not h.ready
    h, ev = on_check(h, True, 3)
    assert ev == "joined" and h.ready and h.incarnation == 1
    h, ev = on_check(h, False, 3)
    h, ev = on_check(h, True, 3)          # not in a row
    assert h.ready and h.failures == 0
    for i in range(3):
        h, ev = on_check(h, False, 3)
    assert ev == "left" and not h.ready
    h, ev = on_check(h, False, 3)
    assert ev is None
    h, ev = on_check(h, True, 3)
    assert ev == "joined" and h.incarnation == 2


def test_a_draining_replica_leaves_at_once_and_returns_as_a_new_incarnation():
    h, _ = on_check(Health(), True, 3)
    h, ev = on_drain(h)
    assert ev == "left" and not h.ready
    assert on_drain(h) == (h, None)
    h, ev = on_check(h, True, 3)           # restarted: /health without the header
    assert ev == "joined" and h.incarnation == 2


def test_the_draining_503_is_told_by_its_header_or_older_servers_message():
    msg = {"error": {"message": "the server is shutting down and accepts no new requests",
                     "type": "ServiceUnavailableError", "param": None, "code": 503}}
    other = {"error": {"message": "the request waited more than 5s", "code": 503}}
    assert is_draining(httpx.Response(503, json=msg))
    assert is_draining(httpx.Response(503, json=other, headers={DRAINING_HEADER: "1"}))
    assert not is_draining(httpx.Response(503, json=other))         # a queue timeout
    assert not is_draining(httpx.Response(503, content=b"<html>busy</html>"))
    assert not is_draining(httpx.Response(500, json=msg))


SAMPLE = """# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="tiny"} 3.0
vllm:num_requests_waiting{engine="0",model_name="tiny"} 2.0
vllm:kv_cache_usage_perc{engine="0",model_name="tiny"} 0.25
vllm:prefix_cache_queries_total{engine="0",model_name="tiny"} 100.0
vllm:cache_config_info{block_size="16",cache_dtype="auto",enable_prefix_caching="True",engine="0",gpu_memory_utilization="0.9",model_name="tiny",num_gpu_blocks="910"} 1.0
"""


def test_parse_metrics_reads_the_vllm_names():
    m = parse_metrics(SAMPLE)
    assert (m.running, m.waiting, m.kv_usage) == (3.0, 2.0, 0.25)
    assert (m.block_size, m.num_gpu_blocks, m.model_name) == (16, 910, "tiny")
    assert parse_metrics("garbage\nvllm:num_requests_waiting{x=\"1\"} nan\n").waiting == 0.0


# -- fleet file ------------------------------------------------------------------------------------
def test_fleet_file_pools_and_shorthand():
    f = parse_fleet({"models": [
        {"name": "m", "tokenizer": "/tok", "pools": [
            {"name": "short", "max_model_len": 256, "weight": 80,
             "endpoints": ["http://10.0.0.1:8000", {"name": "b", "url": "http://h:1/v1"}]},
            {"name": "long", "max_model_len": 1024, "endpoints": []}]},
        {"name": "small", "endpoints": ["http://127.0.0.1:9"], "scheduling_policy": "priority"}]})
    m = f.model("m")
    assert [p.name for p in m.pools] == ["short", "long"]
    assert m.pools[0].endpoints[0].name == "10.0.0.1:8000"
    assert m.pools[0].endpoints[1].url == "http://h:1" and m.pools[0].weight == 80
    s = f.model("small")
    assert s.pools[0].name == "small" and s.pools[0].scheduling_policy == "priority"


@pytest.mark.parametrize("doc,word", [
    ({"models": [{"pools": []}]}, r"models\[0\].name"),
    ({"models": [{"name": "m", "endpoints": ["ftp://x"]}]}, r"models\[0\].endpoints\[0\]"),
    ({"models": [{"name": "m", "endpoints": ["http://x:1/v1/chat"]}]}, "base URL"),
    ({"models": [{"name": "m", "max_model_len": 0}]}, r"max_model_len: must be an integer >= 1"),
    ({"models": [{"name": "m", "weight": -1}]}, "weight"),
    ({"models": [{"name": "m", "block_size": 24}]}, "block_size"),
    ({"models": [{"name": "m", "pools": [{"name": "a"}, {"name": "a"}]}]}, "duplicate pool"),
    ({"models": [{"name": "m"}, {"name": "m"}]}, "duplicate model"),
    ({"models": [{"name": "m", "pools": [{}], "endpoints": []}]}, "either pools"),
    ({"models": [{"name": "m", "replicas": 2}]}, "unknown field"),
    ({"model": []}, "'models' list"),
])
def test_fleet_file_errors_name_the_field(doc, word):
    with pytest.raises(ConfigError, match=word):
        parse_fleet(doc)


# -- CLI --------------------------------------------------------------------------------------------
def test_gateway_config_from_yaml_and_flags(tmp_path):
    from pagefleet.server.cli import build_gateway_config

    conf = tmp_path / "gw.yaml"
    conf.write_text("models-file: /m.yaml\nqueue_timeout: 5\nrouting: round-robin\n")
    cfg = build_gateway_config(["--config", str(conf), "--queue-timeout", "7"])
    assert (cfg.models_file, cfg.queue_timeout, cfg.routing) == ("/m.yaml", 7.0, "round-robin")
    with pytest.raises(ConfigError, match="--models-file"):
        build_gateway_config([])
    with pytest.raises(ConfigError, match="--load-epsilon"):
        build_gateway_config(["--models-file", "x", "--load-epsilon", "-1"])
    conf.write_text("models_file: x\nbogus: 1\n")
    with pytest.raises(ConfigError, match="bogus"):
        build_gateway_config(["--config", str(conf)])


def test_upstream_body_strips_or_adds_priority_for_the_pools_policy():
    import json
    from types import SimpleNamespace

    from pagefleet.server.gateway.app import Gateway
    from pagefleet.server.gateway.prompt import parse_request

    def pool(policy):
        return SimpleNamespace(spec=SimpleNamespace(scheduling_policy=policy))

    with_prio = b'{"model":"m","prompt":"x","priority":3}'
    without = b'{"model":"m","prompt":"x"}'
    p1, p0 = parse_request("completion", with_prio), parse_request("completion", without)
    assert "priority" not in json.loads(Gateway.upstream_body(None, with_prio, p1, pool("fcfs"), 3))
    assert Gateway.upstream_body(None, with_prio, p1, pool("priority"), 3) == with_prio
    assert json.loads(Gateway.upstream_body(None, without, p0, pool("priority"), 4))["priority"] == 4
    assert Gateway.upstream_body(None, without, p0, pool("fcfs"), 4) == without
