"""Scrape the servers' `/metrics` and read one metric per pod.

Each ready pod is asked directly (no Prometheus in the loop: fewer moving parts and
no scrape-interval lag). A pod that times out, answers garbage, or lacks the metric
is reported as missing (None) - the autoscaler decides what missing means. Pods are
scraped concurrently with a short timeout so one stuck server cannot stall the loop.

Where to scrape: the pod's `prometheus.io/port` / `prometheus.io/path` annotations
(the operator sets them on its pod template), else the container port named `http`,
else 8000, on `status.podIP`.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Mapping, Sequence
from typing import Any

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from pagefleet.operator.autoscale import PodSample
from pagefleet.operator.resources import METRICS_PATH, PORT, PORT_NAME

MAX_BODY_BYTES = 8 * 1024 * 1024
DEFAULT_TIMEOUT_S = 2.0


def pod_ready(pod: Mapping[str, Any]) -> bool:
    """Ready condition True, has an IP, and is not being deleted."""
    if (pod.get("metadata") or {}).get("deletionTimestamp"):
        return False
    status = pod.get("status") or {}
    if not status.get("podIP"):
        return False
    return any(c.get("type") == "Ready" and c.get("status") == "True"
               for c in status.get("conditions") or [])


def metrics_url(pod: Mapping[str, Any]) -> str | None:
    ip = (pod.get("status") or {}).get("podIP")
    if not ip:
        return None
    annotations = (pod.get("metadata") or {}).get("annotations") or {}
    port: Any = annotations.get("prometheus.io/port")
    if not port:
        containers = (pod.get("spec") or {}).get("containers") or []
        ports = [p for c in containers for p in c.get("ports") or []]
        named = [p["containerPort"] for p in ports if p.get("name") == PORT_NAME and "containerPort" in p]
        port = named[0] if named else PORT
    path = annotations.get("prometheus.io/path") or METRICS_PATH
    host = f"[{ip}]" if ":" in ip else ip
    return f"http://{host}:{port}{path}"


def parse_metric(text: str, metric: str) -> float | None:
    """Sum of the samples named `metric` (all label sets: model_name, engine...).
    None when the metric is absent or the text is not Prometheus exposition format."""
    total, found = 0.0, False
    try:
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name == metric and not math.isnan(sample.value):
                    total += sample.value
                    found = True
    except Exception:  # the parser raises assorted errors on garbage; all mean "missing"
        return None
    return total if found else None


async def scrape(session: aiohttp.ClientSession, url: str, metric: str,
                 timeout: float = DEFAULT_TIMEOUT_S) -> float | None:
    try:
        async with session.get(url, timeout=aiohttp.ClientTimeout(total=timeout)) as resp:
            if resp.status != 200:
                return None
            body = await resp.content.read(MAX_BODY_BYTES)
    except (aiohttp.ClientError, asyncio.TimeoutError, OSError, ValueError):
        return None
    return parse_metric(body.decode("utf-8", errors="replace"), metric)


async def sample_pods(pods: Sequence[Mapping[str, Any]], metric: str,
                      timeout: float = DEFAULT_TIMEOUT_S,
                      session: aiohttp.ClientSession | None = None) -> list[PodSample]:
    """One PodSample per pod; only ready pods are scraped."""
    own = session is None
    session = session or aiohttp.ClientSession()
    try:
        async def one(pod: Mapping[str, Any]) -> PodSample:
            name = (pod.get("metadata") or {}).get("name", "?")
            url = metrics_url(pod)
            if not pod_ready(pod) or url is None:
                return PodSample(name, ready=False, value=None)
            return PodSample(name, ready=True, value=await scrape(session, url, metric, timeout))

        return list(await asyncio.gather(*(one(p) for p in pods)))
    finally:
        if own:
            await session.close()
