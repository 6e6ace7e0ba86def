"""The gateway's Prometheus metrics.

`pagefleet_gateway_requests_waiting{model_name}` is the scale-from-zero signal: the
requests the gateway holds for a model because no replica is ready or every one is at
its in-flight cap. `..._pool_requests_waiting{model_name,pool}` splits it by pool (a
waiting request counts for every pool of the context class it fits), so the operator
can scale the right ModelDeployment. Gauges are read from the live state at scrape
time; counters and histograms are fed as requests pass.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily

OVERHEAD_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1,
                    0.25, 0.5, 1.0)
QUEUE_BUCKETS = (0.001, 0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0,
                 300.0, 600.0)


class _StateCollector:
    def __init__(self, gateway) -> None:
        self.gw = gateway

    def describe(self):
        return []

    def collect(self):
        gw = self.gw
        waiting = GaugeMetricFamily("pagefleet_gateway_requests_waiting",
                                    "Requests the gateway holds for the model (no ready "
                                    "replica, or all at their in-flight cap).",
                                    labels=["model_name"])
        pool_waiting = GaugeMetricFamily("pagefleet_gateway_pool_requests_waiting",
                                         "Held requests that this pool could serve.",
                                         labels=["model_name", "pool"])
        ready = GaugeMetricFamily("pagefleet_gateway_pool_ready_endpoints",
                                  "Replicas of the pool that pass health checks.",
                                  labels=["model_name", "pool"])
        inflight = GaugeMetricFamily("pagefleet_gateway_requests_in_flight",
                                     "The gateway's requests in flight per replica.",
                                     labels=["model_name", "pool", "endpoint"])
        ep_ready = GaugeMetricFamily("pagefleet_gateway_endpoint_ready",
                                     "1 while the replica is in its pool.",
                                     labels=["model_name", "pool", "endpoint"])
        index = GaugeMetricFamily("pagefleet_gateway_prefix_index_blocks",
                                  "Blocks the gateway believes the replica caches.",
                                  labels=["model_name", "pool", "endpoint"])
        last = GaugeMetricFamily("pagefleet_gateway_last_request_timestamp_seconds",
                                 "Unix time of the model's last request (idle windows).",
                                 labels=["model_name"])
        for m in gw.models.values():
            waiting.add_metric([m.name], gw.dispatcher.waiting(m.name))
            last.add_metric([m.name], m.last_request_time)
            for p in m.pools.values():
                pool_waiting.add_metric([m.name, p.name],
                                        gw.dispatcher.waiting_for_pool(m.name, p.name))
                ready.add_metric([m.name, p.name], len(p.ready_endpoints()))
                for e in p.endpoints.values():
                    labels = [m.name, p.name, e.name]
                    inflight.add_metric(labels, e.inflight)
                    ep_ready.add_metric(labels, 1.0 if e.ready else 0.0)
                    index.add_metric(labels, p.index.size(e.name))
        yield from (waiting, pool_waiting, ready, inflight, ep_ready, index, last)


class GatewayMetrics:
    def __init__(self, gateway) -> None:
        self.registry = r = CollectorRegistry()
        r.register(_StateCollector(gateway))
        self.requests = Counter("pagefleet_gateway_requests", "Requests answered, by "
                                "model and HTTP status.", ["model_name", "code"], registry=r)
        self.decisions = Counter("pagefleet_gateway_routing_decisions", "Routing "
                                 "decisions by reason (prefix, ring, least_load, spill, "
                                 "round_robin).", ["model_name", "pool", "reason"], registry=r)
        self.rejections = Counter("pagefleet_gateway_rejections", "Requests refused by "
                                  "admission (queue_full, shed, queue_timeout, "
                                  "rate_limited).", ["model_name", "reason"], registry=r)
        self.retries = Counter("pagefleet_gateway_upstream_retries", "Requests sent to "
                               "another replica after a connection failure before the "
                               "first byte.", ["model_name", "pool"], registry=r)
        self.queue = Histogram("pagefleet_gateway_queue_time_seconds", "Time requests "
                               "waited in the gateway queue.", ["model_name"],
                               buckets=QUEUE_BUCKETS, registry=r)
        self.overhead = Histogram("pagefleet_gateway_overhead_seconds", "The gateway's "
                                  "own time per request before the upstream call (parse, "
                                  "tokenize, hash, route), queue time excluded.",
                                  ["model_name"], buckets=OVERHEAD_BUCKETS, registry=r)

    # hooks called by the dispatcher and the app
    def routed(self, model: str, pool: str, reason: str) -> None:
        self.decisions.labels(model, pool, reason).inc()

    def rejected(self, model: str, reason: str) -> None:
        self.rejections.labels(model, reason).inc()

    def queue_time(self, model: str, seconds: float) -> None:
        self.queue.labels(model).observe(seconds)

    def render(self) -> bytes:
        return generate_latest(self.registry)
