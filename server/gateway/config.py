"""Gateway settings: one dataclass, the single source of the `pagefleet gateway` flags.

Built with the same `opt()` helper as the server's configs, so `pagefleet gateway
--help`, the `--config` YAML file and the chart's values read the same names. What the
fleet looks like (models, pools, endpoints) is not a flag: it comes from discovery (a
static YAML file or Kubernetes), see `fleet.py`.
"""

from __future__ import annotations

from dataclasses import dataclass

from pagefleet.server.config import KEEP_ALIVE_TIMEOUT_S, need, opt

ROUTING_MODES = ("prefix", "least-load", "round-robin")
DISCOVERY_KINDS = ("static", "kubernetes")


@dataclass
class GatewayConfig:
    """Listening, discovery, routing, health and admission settings of the gateway."""

    host: str = opt("0.0.0.0", "Address to listen on.")
    port: int = opt(8080, "Port to listen on.")
    discovery: str = opt("static", "Where models and endpoints come from: a static YAML "
                         "file (--models-file) or the Kubernetes API (ModelDeployments "
                         "and their ready pods).", choices=DISCOVERY_KINDS)
    models_file: str | None = opt(None, "Static discovery: YAML file of models, pools and "
                                  "endpoints (docs/gateway.md); re-read when it changes.")
    namespace: str | None = opt(None, "Kubernetes discovery: namespace to watch (default: "
                                "the gateway pod's own; '*' for all namespaces).")
    reload_interval: float = opt(2.0, "Static discovery: seconds between checks of the "
                                 "models file for changes.")
    routing: str = opt("prefix", "prefix: longest cached prefix within the load bound, "
                       "then a consistent-hash ring of the first blocks, then least load. "
                       "least-load / round-robin: ignore prefixes (baselines).",
                       choices=ROUTING_MODES)
    load_epsilon: float = opt(0.25, "Bounded load: a replica takes a request by prefix "
                              "or ring only while its load stays within (1 + eps) x the "
                              "pool average.")
    ring_blocks: int = opt(4, "KV blocks of the prompt's start that key the consistent-"
                           "hash ring for prefixes no replica holds yet.")
    ring_vnodes: int = opt(64, "Points per replica on the consistent-hash ring.")
    prefix_ttl: float = opt(600.0, "Seconds the gateway remembers that a replica holds a "
                            "block it routed there.")
    kv_cache_saturation: float = opt(0.9, "A replica whose scraped KV usage is at or above "
                                     "this fraction takes no request by prefix or ring.")
    max_inflight_per_endpoint: int = opt(256, "Requests in flight per replica before the "
                                         "gateway queues (pools may override; set it to "
                                         "the servers' --max-num-seqs).")
    max_num_queued_requests: int = opt(1024, "Requests held per model; beyond it the "
                                       "lowest priority is refused with 429.")
    queue_timeout: float = opt(30.0, "Seconds a request may wait in the gateway (busy or "
                               "absent replicas) before it gets 503. Models may override.")
    critical_priority: int | None = opt(None, "Requests with a priority value at or below "
                                        "this (lower = more urgent, as vLLM's 'priority') "
                                        "are never refused for a full queue.")
    retry_after: int = opt(1, "Retry-After seconds sent with a full-queue 429.")
    rate_limit: float | None = opt(None, "Requests per second per API key (token bucket), "
                                   "and per client address for requests without a key; "
                                   "off when unset. Keys may override in --api-keys-file.")
    rate_limit_burst: float | None = opt(None, "Token bucket size (default: the rate, at "
                                         "least 1).")
    rate_limit_ipv4_prefix: int = opt(32, "Requests without an API key from IPv4 clients "
                                      "share one bucket per network of this prefix length "
                                      "(32: per address; 24 groups a /24).")
    rate_limit_ipv6_prefix: int = opt(64, "The same for IPv6 clients (64: a host is "
                                      "routinely given a whole /64; 56 or 48 group a site "
                                      "or a home line; 128: per address).")
    forwarded_allow_ips: str | None = opt(
        None, "Comma-separated addresses or networks (CIDR) of the proxies in front whose "
        "X-Forwarded-For header names the client (the rate limit of requests without an "
        "API key is per client address): the right-most entry that is not one of them "
        "counts; an entry that is not an IP address leaves the peer's. Unset: the header "
        "is ignored and the peer address counts, loopback included. '*' trusts every "
        "peer and takes the right-most entry (with a warning: a client that reaches the "
        "gateway directly then picks its address).")
    api_keys_file: str | None = opt(None, "YAML list of accepted API keys with optional "
                                    "per-key rate limits; when set, /v1/* needs one.")
    health_interval: float = opt(1.0, "Seconds between health checks (/health and "
                                 "/metrics) of each replica.")
    health_timeout: float = opt(2.0, "Seconds a health check may take.")
    unhealthy_threshold: int = opt(3, "Failed checks in a row that take a replica out of "
                                   "its pool; one good check brings it back.")
    connect_timeout: float = opt(5.0, "Seconds to connect to a replica.")
    max_attempts: int = opt(3, "Replicas tried for one request when connections fail "
                            "before the first byte.")
    upstream_first_byte_timeout: float = opt(
        600.0, "Seconds a replica has to send its response headers (a stream's come with "
        "its first token, after queueing and prefill; a non-streamed answer's only when "
        "the whole generation is done). Past it the request is retried on another "
        "replica (nothing reached the client yet), else 504. 600 s is the OpenAI "
        "clients' own default timeout; a frozen replica is failed over sooner, as soon "
        "as its health checks take it out of the pool.")
    upstream_idle_timeout: float = opt(
        120.0, "Seconds a replica may go silent once its response has started (between "
        "two streamed chunks, or before a non-streamed body). Past it a stream ends with "
        "an SSE error event and data: [DONE], a non-streamed answer with 504.")
    max_request_body_bytes: int = opt(32 << 20, "Largest request body accepted; larger "
                                      "ones get 413 before they are read or tokenized "
                                      "(as the server's flag).")
    request_body_timeout: float = opt(
        60.0, "Seconds a client may take to send its whole request body, counted from "
        "its headers; past it: 408 and the connection closes (as the server's flag).")
    endpoint_header: bool = opt(True, "Add X-Pagefleet-Endpoint (the replica that served) "
                                "to responses.")
    uvicorn_log_level: str = opt("warning", "Log level of uvicorn's own loggers.",
                                 choices=("critical", "error", "warning", "info", "debug",
                                          "trace"))
    timeout_keep_alive: float = opt(KEEP_ALIVE_TIMEOUT_S, "Seconds an idle client keep-alive "
                                    "connection stays open (above the idle timeout of the "
                                    "proxies in front, as for pagefleet serve).")

    def validate(self) -> None:
        need(self.discovery != "static" or bool(self.models_file), "models-file",
             "static discovery needs a models file")
        need(self.load_epsilon >= 0, "load-epsilon", "must be >= 0")
        need(self.ring_blocks >= 1, "ring-blocks", "must be >= 1")
        need(self.ring_vnodes >= 1, "ring-vnodes", "must be >= 1")
        need(self.prefix_ttl > 0, "prefix-ttl", "must be > 0")
        need(0 < self.kv_cache_saturation <= 1, "kv-cache-saturation", "must be in (0, 1]")
        need(self.max_inflight_per_endpoint >= 1, "max-inflight-per-endpoint", "must be >= 1")
        need(self.max_num_queued_requests >= 0, "max-num-queued-requests", "must be >= 0")
        need(self.queue_timeout > 0, "queue-timeout", "must be > 0")
        need(self.retry_after >= 1, "retry-after", "must be >= 1")
        need(self.rate_limit is None or self.rate_limit > 0, "rate-limit", "must be > 0")
        need(self.rate_limit_burst is None or self.rate_limit_burst >= 1, "rate-limit-burst",
             "must be >= 1")
        need(8 <= self.rate_limit_ipv4_prefix <= 32, "rate-limit-ipv4-prefix",
             "must be in [8, 32]")
        need(16 <= self.rate_limit_ipv6_prefix <= 128, "rate-limit-ipv6-prefix",
             "must be in [16, 128]")
        need(self.health_interval > 0, "health-interval", "must be > 0")
        need(self.health_timeout > 0, "health-timeout", "must be > 0")
        need(self.unhealthy_threshold >= 1, "unhealthy-threshold", "must be >= 1")
        need(self.connect_timeout > 0, "connect-timeout", "must be > 0")
        need(self.max_attempts >= 1, "max-attempts", "must be >= 1")
        need(self.upstream_first_byte_timeout > 0, "upstream-first-byte-timeout",
             "must be > 0")
        need(self.upstream_idle_timeout > 0, "upstream-idle-timeout", "must be > 0")
        need(self.max_request_body_bytes >= 1, "max-request-body-bytes", "must be >= 1")
        need(self.request_body_timeout > 0, "request-body-timeout", "must be > 0")
        need(self.timeout_keep_alive > 0, "timeout-keep-alive", "must be > 0")
        need(self.reload_interval > 0, "reload-interval", "must be > 0")
