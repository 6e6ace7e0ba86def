"""Scrape the servers' `/metrics` and read one metric per pod.

Each ready pod is asked directly (no Prometheus in the loop: fewer moving parts and
no scrape-interval lag), through one long-lived HTTP session. A pod that times out,
answers garbage, or lacks the metric is reported as missing (None, with the error
for the MetricsAvailable condition) - the autoscaler decides what missing means. Pods
are scraped concurrently with a short timeout so one stuck server cannot stall the
loop.

Where to scrape: the pod's `prometheus.io/port` / `prometheus.io/path` annotations
(the operator sets them on its pod template), else the container port named `http`,
else 8000, on `status.podIP`.
"""

from __future__ import annotations

import asyncio
import dataclasses
import math
from collections.abc import Collection, Mapping, Sequence
from typing import Any

import aiohttp

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


def parse_metrics(text: str, names: Collection[str]) -> dict[str, float] | None:
    """{name: sum of its samples} for the `names` present in a Prometheus text page
    (all label sets: model_name, engine...). None when a line of a wanted metric is not
    valid exposition format (the page is garbage: trust none of it).

    A line scanner rather than a full parser: a server's page is ~12 KB of histograms
    the autoscaler never reads, and every pod is scraped every interval on the
    operator's one event loop. Only lines that start with a wanted name are parsed."""
    wanted = tuple(names)
    totals: dict[str, float] = {}
    for line in text.splitlines():
        if not line.startswith(wanted):
            continue
        name, rest = _split_name(line)
        if name not in wanted:
            continue  # a longer name with a wanted prefix (e.g. foo_total vs foo)
        value = _sample_value(rest)
        if value is None:
            return None
        if not math.isnan(value):
            totals[name] = totals.get(name, 0.0) + value
    return totals


def _split_name(line: str) -> tuple[str, str]:
    for i, ch in enumerate(line):
        if ch == "{" or ch.isspace():
            return line[:i], line[i:]
    return line, ""


def _sample_value(rest: str) -> float | None:
    """`{labels} value [timestamp]` or ` value [timestamp]` -> value; None if malformed."""
    if rest.startswith("{"):
        end = _labels_end(rest)
        if end < 0:
            return None
        rest = rest[end + 1:]
    parts = rest.split()
    if not parts or len(parts) > 2:
        return None
    try:
        return float(parts[0])
    except ValueError:
        return None


def _labels_end(rest: str) -> int:
    """Index of the `}` closing the label set (quotes and escapes respected), or -1."""
    quoted = escaped = False
    for i, ch in enumerate(rest):
        if escaped:
            escaped = False
        elif ch == "\\":
            escaped = True
        elif ch == '"':
            quoted = not quoted
        elif ch == "}" and not quoted:
            return i
    return -1


def parse_metric(text: str, metric: str) -> float | None:
    """Sum of one metric's samples; None when absent or the page is garbage."""
    values = parse_metrics(text, (metric,))
    return None if values is None else values.get(metric)


@dataclasses.dataclass(frozen=True)
class Scrape:
    values: dict[str, float] | None    # None: the scrape failed
    error: str | None = None


async def _get(session: aiohttp.ClientSession, url: str, timeout: float) -> tuple[int, bytes]:
    for attempt in (1, 2):
        try:
            async with session.get(url, timeout=aiohttp.ClientTimeout(total=timeout)) as resp:
                return resp.status, await resp.content.read(MAX_BODY_BYTES)
        except (aiohttp.ServerDisconnectedError, aiohttp.ClientOSError):
            # A pooled keep-alive connection the server closed just as it was reused:
            # the GET is idempotent, so once more on a fresh connection.
            if attempt == 2:
                raise
    raise AssertionError("unreachable")


async def scrape(session: aiohttp.ClientSession, url: str, names: Collection[str],
                 timeout: float = DEFAULT_TIMEOUT_S) -> Scrape:
    try:
        status, body = await _get(session, url, timeout)
        if status != 200:
            return Scrape(None, f"{url}: HTTP {status}")
    except asyncio.TimeoutError:
        return Scrape(None, f"{url}: timed out after {timeout:g}s")
    except (aiohttp.ClientError, OSError, ValueError) as e:
        return Scrape(None, f"{url}: {e.__class__.__name__}: {e}")
    values = parse_metrics(body.decode("utf-8", errors="replace"), names)
    if values is None:
        return Scrape(None, f"{url}: not Prometheus text format")
    return Scrape(values)


def value_of(values: Mapping[str, float] | None, samples: Sequence[str]) -> float | None:
    """The sum of `samples` when every one of them was reported, else None."""
    if values is None or any(s not in values for s in samples):
        return None
    return float(sum(values[s] for s in samples))


async def sample_pods(pods: Sequence[Mapping[str, Any]], samples: Sequence[str],
                      timeout: float = DEFAULT_TIMEOUT_S,
                      session: aiohttp.ClientSession | None = None,
                      extra: Sequence[str] = ()) -> list[PodSample]:
    """One PodSample per pod; only ready pods are scraped, concurrently. `samples` make
    the autoscaling value; `extra` metrics are read in the same pass (for the status).
    Pass the operator's long-lived `session` (keep-alive connections to the pods)."""
    own = session is None
    session = session or aiohttp.ClientSession()
    names = tuple(dict.fromkeys([*samples, *extra]))
    try:
        async def one(pod: Mapping[str, Any]) -> PodSample:
            name = (pod.get("metadata") or {}).get("name", "?")
            url = metrics_url(pod)
            if not pod_ready(pod) or url is None:
                return PodSample(name, ready=False, value=None)
            got = await scrape(session, url, names, timeout)
            value = value_of(got.values, samples)
            error = got.error or (None if value is not None else
                                  f"{url}: no {' / '.join(s for s in samples if s not in (got.values or {}))}")
            return PodSample(name, ready=True, value=value, values=dict(got.values or {}), error=error)

        return list(await asyncio.gather(*(one(p) for p in pods)))
    finally:
        if own:
            await session.close()


def new_session(limit: int = 64) -> aiohttp.ClientSession:
    """The operator's one scrape session: pooled keep-alive connections to the pods,
    dropped after 4 s idle, before the server closes them (its --timeout-keep-alive is
    75 s by default; 4 s stays below even uvicorn's own 5 s)."""
    return aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=limit, keepalive_timeout=4.0))
