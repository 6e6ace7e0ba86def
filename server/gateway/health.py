"""Replica health (three strikes out, one good check back in) and the /metrics scrape
parser: pure functions.

A replica starts out of its pool and joins on its first good check, so the gateway
never sends traffic to a process that is still loading. `threshold` failed checks in a
row take it out (seed report 002: "实例连续 3 次健康检查失败就自动摘除"); a connection
failure on a real request counts as a failed check. Every join bumps `incarnation`: a
request that failed on one incarnation may be retried on the next (a restart), and
the gateway's picture of that replica's prefix cache is dropped, since a restarted
engine starts empty.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace


@dataclass(frozen=True)
class Health:
    ready: bool = False
    failures: int = 0          # failed checks in a row
    incarnation: int = 0       # joins so far


def on_check(h: Health, ok: bool, threshold: int) -> tuple[Health, str | None]:
    """Apply one check result; the event is 'joined', 'left' or None."""
    if ok:
        if h.ready:
            return (replace(h, failures=0) if h.failures else h), None
        return Health(ready=True, failures=0, incarnation=h.incarnation + 1), "joined"
    failures = h.failures + 1
    if h.ready and failures >= threshold:
        return Health(ready=False, failures=failures, incarnation=h.incarnation), "left"
    return replace(h, failures=failures), None


def on_drain(h: Health) -> tuple[Health, str | None]:
    """The replica said it is shutting down (its /health carries the draining header,
    or it refused a request with the draining 503): out of the pool at once, not after
    `threshold` checks, since every request sent there would be refused. It comes back
    as a new incarnation when a check finds it serving again (restarted)."""
    if h.ready:
        return Health(ready=False, failures=h.failures, incarnation=h.incarnation), "left"
    return h, None


# -- /metrics -------------------------------------------------------------------------------
@dataclass(frozen=True)
class ScrapedMetrics:
    running: float = 0.0
    waiting: float = 0.0
    kv_usage: float = 0.0
    block_size: int | None = None
    num_gpu_blocks: int | None = None
    model_name: str | None = None
    own_inflight: int = 0    # this gateway's requests there while the scrape ran (prober)


_LINE = re.compile(r'^([A-Za-z_:][A-Za-z0-9_:]*)(?:\{(.*)\})?\s+(\S+)')
_LABEL = re.compile(r'([A-Za-z_][A-Za-z0-9_]*)="((?:[^"\\]|\\.)*)"')
_WANTED = ("vllm:num_requests_running", "vllm:num_requests_waiting",
           "vllm:kv_cache_usage_perc", "vllm:cache_config_info")


def parse_metrics(text: str) -> ScrapedMetrics:
    """The few vLLM-named samples routing reads, summed over label sets (one engine
    per server today). Unknown lines are skipped; a missing sample reads as 0."""
    vals = {n: 0.0 for n in _WANTED[:3]}
    block_size = num_blocks = model = None
    for line in text.splitlines():
        if not line.startswith("vllm:"):
            continue
        m = _LINE.match(line)
        if not m or m.group(1) not in _WANTED:
            continue
        name, labels, raw = m.group(1), m.group(2) or "", m.group(3)
        try:
            value = float(raw)
        except ValueError:
            continue
        lab = dict(_LABEL.findall(labels))
        model = model or lab.get("model_name")
        if name == "vllm:cache_config_info":
            try:
                block_size = int(lab["block_size"])
                num_blocks = int(lab["num_gpu_blocks"])
            except (KeyError, ValueError):
                pass
        elif value == value:   # skip NaN
            vals[name] += value
    return ScrapedMetrics(running=vals["vllm:num_requests_running"],
                          waiting=vals["vllm:num_requests_waiting"],
                          kv_usage=vals["vllm:kv_cache_usage_perc"],
                          block_size=block_size, num_gpu_blocks=num_blocks, model_name=model)
