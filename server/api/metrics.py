"""Prometheus metrics with vLLM's names, labels and histogram buckets.

Dashboards, KEDA/HPA rules and gateway endpoint pickers written for vLLM read these
unchanged. Each app has its own `CollectorRegistry` (several servers can live in one
test process). Gauges and engine-side counters are read at scrape time from the
API process's own queue counts (moved by admission, scheduling, preemption and finish
events, so a scrape mid-step sees the real queue) and the core's latest step stats;
per-request histograms and token counters are fed by `MetricsListener`, which sees
every step's outputs on the event loop.
"""

from __future__ import annotations

import time

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from pagefleet.server.api.http_metrics import http_requests_counter
from pagefleet.server.engine.async_engine import RequestStream, StepListener
from pagefleet.server.engine.outputs import RequestOutput

TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5,
                5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0,
               7.5, 10.0, 20.0, 40.0, 80.0)
REQUEST_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0,
                           40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
ITERATION_TOKENS_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
PARAMS_N_BUCKETS = (1, 2, 5, 10, 20)
FINISHED_REASONS = ("stop", "length", "abort", "error")


def buckets_1_2_5(limit: int) -> tuple[int, ...]:
    """vLLM's token-count buckets: 1, 2, 5, 10, 20, 50, ... up to `limit`."""
    out, mag = [], 1
    while True:
        for m in (1, 2, 5):
            v = m * mag
            if v > limit:
                return tuple(out)
            out.append(v)
        mag *= 10
LABELS = ("model_name", "engine")


class _EngineStatsCollector:
    """Gauges and counters whose source of truth is the engine (read at scrape time)."""

    def __init__(self, engine, labels: list[str]) -> None:
        self.engine = engine
        self.labels = labels

    def describe(self):
        return []

    def collect(self):
        eng = self.engine
        s = eng.stats

        def gauge(name, doc, value):
            g = GaugeMetricFamily(name, doc, labels=LABELS)
            g.add_metric(self.labels, value)
            return g

        def counter(name, doc, value):
            c = CounterMetricFamily(name, doc, labels=LABELS)
            c.add_metric(self.labels, value)
            return c

        yield gauge("vllm:num_requests_running", "Number of requests in model execution "
                    "batches.", eng.num_running)
        yield gauge("vllm:num_requests_waiting", "Number of requests waiting to be "
                    "processed.", eng.num_waiting)
        kv = s.kv_cache_usage if s else 0.0
        queries = s.prefix_cache_queries if s else 0
        hits = s.prefix_cache_hits if s else 0
        yield gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.",
                    kv)
        yield counter("vllm:prefix_cache_queries", "Prefix cache queries, in terms of "
                      "number of queried tokens.", queries)
        yield counter("vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of "
                      "cached tokens.", hits)
        # The same values under the names older vLLM releases exported, which alerts
        # and dashboards carried over from them still read (an absent series never
        # fires). Read from the same stats: nothing is counted twice.
        yield gauge("vllm:gpu_cache_usage_perc", "GPU KV-cache usage. 1 means 100 percent "
                    "usage (older name of vllm:kv_cache_usage_perc).", kv)
        yield counter("vllm:gpu_prefix_cache_queries", "GPU prefix cache queries, in terms "
                      "of number of queried tokens (older name of "
                      "vllm:prefix_cache_queries).", queries)
        yield counter("vllm:gpu_prefix_cache_hits", "GPU prefix cache hits, in terms of "
                      "number of cached tokens (older name of vllm:prefix_cache_hits).", hits)
        yield counter("vllm:num_preemptions", "Cumulative number of preemption from the "
                      "engine.", s.num_preemptions if s else 0)


class ServerMetrics:
    def __init__(self, model_name: str, engine, *, block_size: int, num_blocks: int,
                 enable_prefix_caching: bool, cache_dtype: str,
                 gpu_memory_utilization: float, engine_index: str = "0",
                 max_model_len: int = 1 << 20) -> None:
        self.registry = r = CollectorRegistry()
        self.labels = [model_name, engine_index]
        r.register(_EngineStatsCollector(engine, self.labels))

        def hist(name, doc, buckets):
            return Histogram(name, doc, LABELS, buckets=buckets, registry=r).labels(*self.labels)

        self.ttft = hist("vllm:time_to_first_token_seconds", "Histogram of time to first "
                         "token in seconds.", TTFT_BUCKETS)
        self.itl = hist("vllm:inter_token_latency_seconds", "Histogram of inter-token "
                        "latency in seconds.", ITL_BUCKETS)
        # The same observations under the name vLLM used before 0.11, which older
        # dashboards (vLLM's own Grafana board among them) still read.
        self.tpot_legacy = hist("vllm:time_per_output_token_seconds", "Histogram of time per "
                                "output token in seconds (the older name of "
                                "vllm:inter_token_latency_seconds).", ITL_BUCKETS)
        self.request_tpot = hist("vllm:request_time_per_output_token_seconds", "Histogram of "
                                 "time_per_output_token_seconds per request.", ITL_BUCKETS)
        self.e2e = hist("vllm:e2e_request_latency_seconds", "Histogram of e2e request "
                        "latency in seconds.", REQUEST_LATENCY_BUCKETS)
        self.queue_time = hist("vllm:request_queue_time_seconds", "Histogram of time spent "
                               "in WAITING phase for request.", REQUEST_LATENCY_BUCKETS)
        tokens = buckets_1_2_5(max_model_len)
        self.iteration_tokens = hist("vllm:iteration_tokens_total", "Histogram of number of "
                                     "tokens per engine_step.", ITERATION_TOKENS_BUCKETS)
        self.request_prompt_tokens = hist("vllm:request_prompt_tokens", "Number of prefill "
                                          "tokens processed.", tokens)
        self.request_generation_tokens = hist("vllm:request_generation_tokens", "Number of "
                                              "generation tokens processed.", tokens)
        self.params_n = hist("vllm:request_params_n", "Histogram of the n request "
                             "parameter.", PARAMS_N_BUCKETS)
        self.params_max_tokens = hist("vllm:request_params_max_tokens", "Histogram of the "
                                      "max_tokens request parameter.", tokens)
        self.inference_time = hist("vllm:request_inference_time_seconds", "Histogram of time "
                                   "spent in RUNNING phase for request.", REQUEST_LATENCY_BUCKETS)
        self.prefill_time = hist("vllm:request_prefill_time_seconds", "Histogram of time "
                                 "spent in PREFILL phase for request.", REQUEST_LATENCY_BUCKETS)
        self.decode_time = hist("vllm:request_decode_time_seconds", "Histogram of time spent "
                                "in DECODE phase for request.", REQUEST_LATENCY_BUCKETS)
        self.prompt_tokens = Counter("vllm:prompt_tokens", "Number of prefill tokens "
                                     "processed.", LABELS, registry=r).labels(*self.labels)
        self.generation_tokens = Counter("vllm:generation_tokens", "Number of generation "
                                         "tokens processed.", LABELS,
                                         registry=r).labels(*self.labels)
        success = Counter("vllm:request_success", "Count of successfully processed requests.",
                          (*LABELS, "finished_reason"), registry=r)
        # vLLM has no queue timeout; it would count such a request as aborted, and so
        # does vllm:request_success_total. This counter tells them apart from hang-ups.
        self.queue_timeouts = Counter(
            "pagefleet:request_queue_timeouts", "Requests that waited past --queue-timeout "
            "without being scheduled (answered 503; also counted as finished_reason=abort).",
            LABELS, registry=r).labels(*self.labels)
        self.success = {reason: success.labels(*self.labels, reason)
                        for reason in FINISHED_REASONS}
        # Every answered HTTP request by route, method and status (HTTPMetricsMiddleware).
        self.http_requests = http_requests_counter(r)
        info = Gauge("vllm:cache_config_info", "Information of the LLMEngine CacheConfig",
                     ("block_size", "num_gpu_blocks", "enable_prefix_caching", "cache_dtype",
                      "gpu_memory_utilization", *LABELS), registry=r)
        info.labels(str(block_size), str(num_blocks), str(enable_prefix_caching), cache_dtype,
                    str(gpu_memory_utilization), *self.labels).set(1)

    def render(self) -> bytes:
        return generate_latest(self.registry)


class MetricsListener(StepListener):
    """Turns the stream of per-step deltas into vLLM's per-request metrics."""

    def __init__(self, metrics: ServerMetrics) -> None:
        self.m = metrics

    def on_scheduled(self, stream: RequestStream, now: float) -> None:
        self.m.queue_time.observe(max(now - stream.arrival_time, 0.0))

    def on_output(self, stream: RequestStream, out: RequestOutput, now: float) -> None:
        new = len(out.outputs[0].token_ids)
        if new <= 0:
            return
        if stream.num_tokens == 0:
            self.m.prompt_tokens.inc(stream.prompt_len)
            self.m.ttft.observe(max(now - stream.arrival_time, 0.0))
            stream.first_token_time = now
        elif stream.last_token_time is not None:
            gap = max(now - stream.last_token_time, 0.0)
            self.m.itl.observe(gap)
            self.m.tpot_legacy.observe(gap)
        stream.last_token_time = now
        stream.num_tokens += new
        self.m.generation_tokens.inc(new)

    def on_finished(self, stream: RequestStream, reason: str) -> None:
        if reason == "timeout":
            self.m.queue_timeouts.inc()
        m = self.m
        m.success.get(reason, m.success["abort"]).inc()
        m.e2e.observe(max(time.time() - stream.arrival_time, 0.0))
        if reason in ("stop", "length"):   # as vLLM: the request's own sizes and phases
            m.request_prompt_tokens.observe(stream.prompt_len)
            m.request_generation_tokens.observe(stream.num_tokens)
            sched, first, last = (stream.scheduled_time, stream.first_token_time,
                                  stream.last_token_time)
            if sched is not None and first is not None and last is not None:
                m.prefill_time.observe(max(first - sched, 0.0))
                m.decode_time.observe(max(last - first, 0.0))
                m.inference_time.observe(max(last - sched, 0.0))
                if stream.num_tokens > 1:
                    m.request_tpot.observe(max(last - first, 0.0) / (stream.num_tokens - 1))

    def on_stats(self, stats) -> None:
        if stats.step_tokens:
            self.m.iteration_tokens.observe(stats.step_tokens)

    def on_request(self, n: int, max_tokens: int | None) -> None:
        self.m.params_n.observe(n)
        if max_tokens is not None:
            self.m.params_max_tokens.observe(max_tokens)
