"""`http_requests_total{handler,method,status}`: every answered HTTP request, rejections
included (400, 401, 413, 429, 503...), as vLLM's server exposes it through
prometheus-fastapi-instrumentator.

The same label set as the instrumentator's: `handler` is the route's template
(`/v1/completions`, `/v1/models/{model_id:path}`), `"none"` for a path no route
matches (made-up paths cannot grow the series count); `method` is the HTTP method
(anything outside the standard ones is `"other"`). One difference: `status` is the
exact code ("429"), where vLLM's default configuration groups it ("4xx"); a query
written `status=~"4.."` reads both. Like vLLM, probes and scrapes (/metrics, /health,
/ping, /version) are not counted.

A pure ASGI middleware, outermost, so requests refused before any route runs (API
key, body cap) count too. Per request: one label lookup and one increment, when the
response starts.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter
from starlette.routing import Match

EXCLUDED_HANDLERS = frozenset({"/metrics", "/health", "/ping", "/version", "/load",
                               "/server_info"})
METHODS = frozenset({"GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"})
UNTEMPLATED = "none"


def http_requests_counter(registry: CollectorRegistry) -> Counter:
    return Counter("http_requests", "Total number of requests by method, status and handler.",
                   ("handler", "method", "status"), registry=registry)


def route_template(scope, routes) -> str:
    """The template of the route serving `scope`: the one the router picked, else the
    first that matches it (also by path alone, as a 405 does), else "none"."""
    route = scope.get("route")
    if route is not None and getattr(route, "path", None):
        return route.path
    partial = None
    for r in routes:
        match, _ = r.matches(scope)
        if match == Match.FULL:
            return getattr(r, "path", UNTEMPLATED)
        if match == Match.PARTIAL and partial is None:
            partial = getattr(r, "path", None)
    return partial or UNTEMPLATED


class HTTPMetricsMiddleware:
    def __init__(self, app, counter: Counter, routes) -> None:
        self.app = app
        self.counter = counter
        self.routes = routes   # the app's live route list

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        started = False

        def count(status: int) -> None:
            handler = route_template(scope, self.routes)
            if handler in EXCLUDED_HANDLERS:
                return
            method = scope["method"] if scope["method"] in METHODS else "other"
            self.counter.labels(handler, method, str(status)).inc()

        async def send_counted(message):
            nonlocal started
            if message["type"] == "http.response.start" and not started:
                started = True
                count(message["status"])
            await send(message)

        try:
            await self.app(scope, receive, send_counted)
        except Exception:
            if not started:
                count(500)    # what the server's error middleware answers
            raise
