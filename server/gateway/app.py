"""The gateway: the `Gateway` object that owns the live fleet, and its ASGI app.

Request path (`/v1/chat/completions`, `/v1/completions`, `/v1/responses`):

    request id -> API key (401) -> rate limit (429), both from the headers
      -> body cap (413 / 408, before the body is read) -> parse (400) -> model (404)
      -> render + tokenize per pool tokenizer -> smallest fitting context class (400)
      -> dispatcher: route now or wait in priority order (429 full / 503 timeout)
      -> upstream call (retry elsewhere before the first byte: connection failure,
         first-byte timeout, replica left its pool, replica draining; else 502 / 504)
      -> relay (idle timeout between chunks)

Every response carries `X-Request-Id` (the client's, else a new one), which is also
sent to the replica, so one id names the request in the gateway's and the server's
logs. Routed responses also carry `Server-Timing: gateway;dur=<ms>, queue;dur=<ms>`
(the gateway's own time before the upstream call, and the time queued) and, unless
--no-endpoint-header, `X-Pagefleet-Endpoint` (the replica that served). Errors are OpenAI-shaped (`pagefleet.server.api.errors.error_body`).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import hmac
import json
import logging
import time
from collections.abc import Callable

import httpx
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from pagefleet.server.api.body_limit import BodyLimitMiddleware
from pagefleet.server.api.errors import DRAINING_HEADER, APIError, error_body
from pagefleet.server.api.request_id import RequestIdMiddleware, clean_request_id, new_request_id
from pagefleet.server.gateway.admission import (
    APIKeys,
    ClientNetworks,
    KeyInfo,
    RateLimiter,
    TrustedProxies,
    client_key,
    default_limit,
    retry_after_header,
)
from pagefleet.server.gateway.config import GatewayConfig
from pagefleet.server.gateway.discovery import Discovery
from pagefleet.server.gateway.dispatch import DispatchSettings, Dispatcher, Reservation, Ticket
from pagefleet.server.gateway.fleet import FleetSpec
from pagefleet.server.gateway.metrics import GatewayMetrics
from pagefleet.server.gateway.prefix import PromptBlocks, prompt_blocks
from pagefleet.server.gateway.prober import probe_forever
from pagefleet.server.gateway.prompt import (
    ParsedRequest,
    PromptTokenizer,
    load_tokenizer,
    parse_request,
    resolve_chat_template,
)
from pagefleet.server.gateway.proxy import (
    RETRYABLE,
    STREAM_ERRORS,
    FirstByteTimeout,
    RelayResponse,
    ReplicaLost,
    connection_error,
    is_draining,
    read_body,
    response_headers,
    upstream_headers,
    wait_disconnect,
)
from pagefleet.server.gateway.routing import PoolFit, RouteSettings, context_error, fitting_class
from pagefleet.server.gateway.state import EndpointState, ModelState, PoolState, apply_fleet

log = logging.getLogger("pagefleet.gateway")
ENDPOINT_HEADER = "x-pagefleet-endpoint"
TOKENIZER_STARTUP_WAIT_S = 120.0


def request_id(request: Request) -> str:
    """The request's id, named by `RequestIdMiddleware` (the server's) before anything
    else ran, so the body cap's own answers (413, 408) carry it too."""
    rid = getattr(request.state, "request_id", None)
    if rid is None:
        given = request.headers.get("x-request-id")
        rid = request.state.request_id = clean_request_id(given) if given else new_request_id()
    return rid


def bearer(request: Request) -> str | None:
    h = request.headers.get("authorization")
    if not h:
        return None
    scheme, _, token = h.partition(" ")
    return token.strip() or None if scheme.lower() == "bearer" else None


def json_response(obj, status: int = 200, headers: dict[str, str] | None = None) -> Response:
    return Response(json.dumps(obj, separators=(",", ":")), status_code=status,
                    media_type="application/json", headers=headers)


def error_response(err: APIError, rid: str) -> Response:
    return json_response(error_body(err.status, err.message, err.param), err.status,
                         {**err.headers, "x-request-id": rid})


class Tokenizers:
    """Each (tokenizer, chat template) loaded once, off the event loop."""

    def __init__(self) -> None:
        self._tasks: dict[tuple, asyncio.Task] = {}

    def ensure(self, key: tuple) -> None:
        source, template = key
        if source is None or key in self._tasks:
            return

        def load() -> PromptTokenizer | None:
            try:
                return PromptTokenizer(load_tokenizer(source), resolve_chat_template(template))
            except Exception as e:  # noqa: BLE001 - routing falls back to least load
                log.error("cannot load tokenizer %r (%s): requests for it are routed "
                          "without prefix affinity or context checks", source, e)
                return None

        self._tasks[key] = asyncio.ensure_future(asyncio.to_thread(load))

    async def wait_all(self, timeout: float) -> None:
        """Wait (bounded) for every load started so far; slow ones go on loading and
        the requests that need them wait for them."""
        tasks = list(self._tasks.values())
        if tasks:
            await asyncio.wait(tasks, timeout=timeout)

    async def get(self, key: tuple) -> PromptTokenizer | None:
        self.ensure(key)
        task = self._tasks.get(key)
        return await asyncio.shield(task) if task is not None else None


class Gateway:
    def __init__(self, cfg: GatewayConfig, discovery: Discovery,
                 api_keys: APIKeys | None = None) -> None:
        self.cfg = cfg
        self.discovery = discovery
        self.api_keys = api_keys
        self.models: dict[str, ModelState] = {}
        self.metrics = GatewayMetrics(self)
        self.dispatcher = Dispatcher(DispatchSettings(
            route=RouteSettings(cfg.routing, cfg.load_epsilon, cfg.kv_cache_saturation),
            ring_blocks=cfg.ring_blocks, ring_vnodes=cfg.ring_vnodes,
            max_inflight=cfg.max_inflight_per_endpoint,
            max_queued=cfg.max_num_queued_requests, queue_timeout=cfg.queue_timeout,
            critical_priority=cfg.critical_priority, retry_after=cfg.retry_after,
            unhealthy_threshold=cfg.unhealthy_threshold), events=self.metrics)
        self.rate = RateLimiter(default_limit(cfg.rate_limit, cfg.rate_limit_burst))
        self.proxies = TrustedProxies(cfg.forwarded_allow_ips)    # ConfigError if bad
        self.client_nets = ClientNetworks(cfg.rate_limit_ipv4_prefix, cfg.rate_limit_ipv6_prefix)
        self.tokenizers = Tokenizers()
        self.pool = concurrent.futures.ThreadPoolExecutor(4, thread_name_prefix="gw-prompt")
        self.client: httpx.AsyncClient | None = None
        self.probe_client: httpx.AsyncClient | None = None
        self._probers: dict[int, asyncio.Task] = {}
        self._tasks: list[asyncio.Task] = []

    # -- lifecycle ------------------------------------------------------------------------
    async def start(self) -> None:
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=1024)
        # No read timeout here: the wait for the headers (--upstream-first-byte-timeout,
        # cut short when the replica leaves its pool) and for each later chunk
        # (--upstream-idle-timeout) are timed around the calls, where they can differ.
        self.client = httpx.AsyncClient(timeout=httpx.Timeout(
            connect=self.cfg.connect_timeout, read=None, write=60.0, pool=None), limits=limits)
        self.probe_client = httpx.AsyncClient(timeout=self.cfg.health_timeout)
        self.apply(await self.discovery.first())
        await self.tokenizers.wait_all(TOKENIZER_STARTUP_WAIT_S)   # ready = routes by prefix
        self._tasks.append(asyncio.ensure_future(self.discovery.watch(self.apply)))

    async def stop(self) -> None:
        for t in [*self._tasks, *self._probers.values()]:
            t.cancel()
        for t in [*self._tasks, *self._probers.values()]:
            with contextlib.suppress(BaseException):
                await t
        self._probers.clear()
        for c in (self.client, self.probe_client):
            if c is not None:
                await c.aclose()
        self.pool.shutdown(wait=False, cancel_futures=True)

    def apply(self, spec: FleetSpec) -> None:
        """Bring the live fleet in line with a discovery snapshot."""
        change = apply_fleet(self.models, spec, self.cfg.prefix_ttl)
        for ep in change.removed:
            task = self._probers.pop(id(ep), None)
            if task is not None:
                task.cancel()
        for ep in change.added:
            self._probers[id(ep)] = asyncio.ensure_future(probe_forever(
                ep, self.probe_client, self.cfg.health_interval, self.cfg.unhealthy_threshold,
                self._on_endpoint_event))
        for m in change.removed_models:
            self.dispatcher.fail_model(m.name, APIError(
                404, f"The model `{m.name}` does not exist.", "model"))
        for m in self.models.values():
            for p in m.pools.values():
                self.tokenizers.ensure(p.tokenizer_key)
        self.dispatcher.pump()

    def _on_endpoint_event(self, ep: EndpointState, event: str) -> None:
        self.dispatcher.pump(ep.pool.model.name)

    # -- helpers ----------------------------------------------------------------------------
    def resolve_model(self, name: str | None) -> ModelState:
        if name is None:
            if len(self.models) == 1:
                return next(iter(self.models.values()))
            raise APIError(400, "model: required, the gateway serves several models", "model")
        m = self.models.get(name)
        if m is None:
            raise APIError(404, f"The model `{name}` does not exist.", "model")
        return m

    def authenticate(self, request: Request) -> KeyInfo | None:
        """The caller's key (None without --api-keys-file); 401 for a missing or
        unknown one."""
        if self.api_keys is None:
            return None
        info = self.api_keys.lookup(bearer(request))
        if info is None:
            raise APIError(401, "Unauthorized: a valid 'Authorization: Bearer <key>' "
                                "header is required", None, {"WWW-Authenticate": "Bearer"})
        return info

    def check_key(self, request: Request) -> str:
        """API key check and rate limit; returns the key's name for logs."""
        info = self.authenticate(request)
        if info:
            key_id, whose = f"name:{info.name}", "this API key"
        else:
            # Clients without a verified key (none sent, or no --api-keys-file to check
            # one against: a made-up token per request must not buy a fresh bucket):
            # one bucket per client address, as nginx's limit_req on
            # $binary_remote_addr: one client cannot spend the others' share. The
            # address is the peer's, or behind a --forwarded-allow-ips proxy the
            # right-most untrusted X-Forwarded-For entry, always a parsed IP (by its
            # network: IPv6 by its /64 unless --rate-limit-ipv6-prefix says otherwise):
            # the client cannot write its own key (uvicorn's proxy headers are off, as
            # its '*' takes the left-most, client-written entry).
            peer = request.client.host if request.client else None
            xff = request.headers.getlist("x-forwarded-for") if self.proxies.enabled else []
            key_id = client_key(self.proxies, peer, xff, self.client_nets)
            whose = "this client address (requests without a verified API key are " \
                "limited per client address)"
        wait = self.rate.check(key_id, info.limit if info else None, time.monotonic())
        if wait > 0:
            self.metrics.rejected("", "rate_limited")
            raise APIError(429, f"rate limit exceeded for {whose}; retry later", None,
                           {"Retry-After": retry_after_header(wait)})
        return info.name if info else "-"

    def check_model_key(self, model: ModelState, request: Request) -> None:
        """Kubernetes discovery without --api-keys-file: a model whose servers want a key
        (apiKeySecretRef) takes only clients that present it. Checked before the request
        may wait, so a wrong key cannot wake a model from zero or hold a queue slot."""
        if self.api_keys is not None or not model.spec.require_pool_key:
            return
        token = bearer(request) or ""
        keys = [p.spec.api_key for p in model.pools.values() if p.spec.api_key]
        if not any(hmac.compare_digest(token.encode(), k.encode()) for k in keys):
            raise APIError(401, "Unauthorized: this model needs its API key in an "
                                "'Authorization: Bearer <key>' header", None,
                           {"WWW-Authenticate": "Bearer"})

    def priority_of(self, parsed: ParsedRequest, request: Request) -> int:
        if parsed.priority is not None:
            return parsed.priority
        h = request.headers.get("x-priority")
        if h is None:
            return 0
        try:
            return int(h.strip())
        except ValueError:
            raise APIError(400, f"X-Priority: must be an integer, got {h!r}",
                           "X-Priority") from None

    async def fit(self, model: ModelState, parsed: ParsedRequest) -> tuple[list[PoolFit], dict, dict]:
        """Prompt lengths per pool (by its tokenizer), the first prompt's ids and its
        block-hash chains per (tokenizer, block size). Rendering, tokenizing and hashing
        run in a worker thread (the tokenizer releases the GIL), so long prompts do not
        stall the event loop that relays other requests' streams."""
        by_key: dict[tuple, set[int]] = {}
        for p in model.pools.values():
            by_key.setdefault(p.tokenizer_key, set()).add(p.block_size)
        lens: dict[tuple, int] = {}
        ids_by_key: dict[tuple, list[int]] = {}
        blocks: dict[tuple, PromptBlocks] = {}
        for key, sizes in by_key.items():
            tok = await self.tokenizers.get(key)
            if tok is None:
                lens[key] = 0
                continue

            def work(tok=tok, sizes=sizes):
                prompts = tok.prompts(parsed)
                first = prompts[0] if prompts and prompts[0] else None
                chains = {bs: prompt_blocks(first, bs) for bs in sizes} if first else {}
                return max((len(x) for x in prompts), default=0), first, chains

            n, first, chains = await asyncio.get_running_loop().run_in_executor(self.pool, work)
            lens[key] = n
            if first is not None:
                ids_by_key[key] = first
                blocks.update({(key, bs): b for bs, b in chains.items()})
        fits = [PoolFit(p.name, p.max_model_len, p.spec.weight, lens[p.tokenizer_key])
                for p in model.pools.values()]
        return fits, ids_by_key, blocks

    def upstream_body(self, raw: bytes, parsed: ParsedRequest, pool: PoolState,
                      priority: int) -> bytes:
        """The client's bytes, unless the pool's servers must not (or should) see a
        priority: fcfs servers refuse a non-zero `priority`, so the gateway, which has
        honoured it, strips it; priority servers get the X-Priority value in the body."""
        policy = pool.spec.scheduling_policy
        if policy == "fcfs" and parsed.priority:
            obj = json.loads(raw)
            obj.pop("priority", None)
            return json.dumps(obj).encode()
        if policy == "priority" and parsed.priority is None and priority:
            obj = json.loads(raw)
            obj["priority"] = priority
            return json.dumps(obj).encode()
        return raw

    # -- the generation endpoints -------------------------------------------------------------
    async def generate(self, kind: str, path: str, request: Request, raw: bytes) -> Response:
        rid = request_id(request)
        t0 = time.perf_counter()
        key_name = request.state.key_name     # KeyCheckMiddleware's, before the body
        parsed = parse_request(kind, raw)
        model = self.resolve_model(parsed.model)
        self.check_model_key(model, request)
        model.touch()
        priority = self.priority_of(parsed, request)
        fits, ids_by_key, blocks = await self.fit(model, parsed)
        cls = fitting_class(fits, parsed.max_tokens)
        if not cls:
            raise APIError(400, context_error(fits, parsed.max_tokens),
                           "input" if kind == "responses" else "messages")
        ticket = Ticket(rid, model, priority, tuple(p.name for p in cls), ids_by_key,
                        _blocks=blocks)
        res = await self.dispatcher.acquire(ticket)
        overhead = max(time.perf_counter() - t0 - ticket.waited, 0.0)
        self.metrics.queue_time(model.name, ticket.waited)
        self.metrics.overhead.labels(model.name).observe(overhead)
        d = res.decision
        log.info("request %s: %s model=%r key=%s priority=%d -> %s/%s (%s, %d blocks "
                 "cached, load %g of %g over %d) after %.3fs queued", rid, kind, model.name,
                 key_name, priority, res.pool.name, res.endpoint.name, d.reason, d.matched,
                 res.load, res.pool_load, res.pool_size, ticket.waited)
        res, upstream = await self._open(ticket, res, path, raw, parsed, priority, request)
        timing = f"gateway;dur={overhead * 1000:.3f}, queue;dur={ticket.waited * 1000:.3f}"
        return await self._respond(model, res, upstream, rid, timing)

    async def _open(self, ticket: Ticket, res: Reservation, path: str, raw: bytes,
                    parsed: ParsedRequest, priority: int, request: Request):
        """Send to the reserved replica; when nothing came back from it (connection
        failure, no headers in time, it left its pool meanwhile, or it is draining),
        release it and try the next pick, up to --max-attempts replicas."""
        attempts = 0
        client_auth = request.headers.get("authorization")
        while True:
            attempts += 1
            ep = res.endpoint
            req = self.client.build_request(
                "POST", ep.spec.url + path,
                content=self.upstream_body(raw, parsed, res.pool, priority),
                headers=upstream_headers(ticket.rid, client_auth, res.pool.spec.api_key))
            last = attempts >= self.cfg.max_attempts
            try:
                upstream = await self._send(req, ep)
                drained = upstream.status_code == 503 and await self._is_draining(upstream)
            except RETRYABLE as e:
                log.warning("request %s: %s (%s): %s before the first byte; %s", ticket.rid,
                            ep.name, ep.spec.url, _why(e),
                            "giving up" if last else "retrying elsewhere")
                self.dispatcher.release(res, failed=True)
                if last:
                    raise connection_error(ticket.rid, attempts, e,
                                           self.cfg.upstream_first_byte_timeout) from None
                self.metrics.retries.labels(ticket.model.name, res.pool.name).inc()
                res = await self.dispatcher.acquire(ticket, retry=True)
                continue
            except BaseException:
                self.dispatcher.release(res)
                raise
            if drained:
                log.warning("request %s: %s (%s) is shutting down and refused it; %s",
                            ticket.rid, ep.name, ep.spec.url,
                            "passing its 503 on" if last else "retrying elsewhere")
                self.dispatcher.release(res, drained=True)
                if not last:
                    await upstream.aclose()
                    self.metrics.retries.labels(ticket.model.name, res.pool.name).inc()
                    res = await self.dispatcher.acquire(ticket, retry=True)
                    continue
            if upstream.status_code < 400:
                self.dispatcher.confirm(res)
            return res, upstream

    async def _send(self, req: httpx.Request, ep: EndpointState) -> httpx.Response:
        """The replica's response, once its headers are in. Raises FirstByteTimeout
        past --upstream-first-byte-timeout, ReplicaLost when the replica leaves its
        pool first (a frozen replica accepts connections and never answers; only its
        failed health checks tell), or what the connection raised. The abandoned call
        is cancelled, which closes its connection (the server aborts the request)."""
        lost = ep.watch_lost()
        call = asyncio.ensure_future(self.client.send(req, stream=True))
        try:
            await asyncio.wait({call, lost}, timeout=self.cfg.upstream_first_byte_timeout,
                               return_when=asyncio.FIRST_COMPLETED)
        except BaseException:
            await _discard(call)
            raise
        finally:
            ep.unwatch(lost)
            lost.cancel()
        if call.done():
            return call.result()
        await _discard(call)
        if lost.done() and not lost.cancelled():
            raise ReplicaLost()
        raise FirstByteTimeout()

    async def _is_draining(self, upstream: httpx.Response) -> bool:
        """Whether this 503 is the replica's refusal while it shuts down (reads the
        small error body, bounded by --upstream-idle-timeout; a body that does not come
        reads as any other 503)."""
        try:
            await asyncio.wait_for(upstream.aread(), self.cfg.upstream_idle_timeout)
        except (*STREAM_ERRORS, asyncio.TimeoutError):
            return bool(upstream.headers.get(DRAINING_HEADER))
        return is_draining(upstream)

    async def _respond(self, model: ModelState, res: Reservation, upstream: httpx.Response,
                       rid: str, timing: str) -> Response:
        """Relay an SSE stream chunk by chunk; read any other answer whole (so a body
        that breaks off can still become a proper 502)."""
        extra = {"x-request-id": rid, "server-timing": timing}
        if self.cfg.endpoint_header:
            extra[ENDPOINT_HEADER] = res.endpoint.name
        headers = response_headers(upstream, extra)
        t_start = time.perf_counter()

        def done(outcome: str) -> None:
            self.dispatcher.release(res)
            self.metrics.requests.labels(model.name, str(upstream.status_code)).inc()
            log.info("request %s: %d from %s, %s after %.3fs", rid, upstream.status_code,
                     res.endpoint.name, outcome, time.perf_counter() - t_start)

        idle = self.cfg.upstream_idle_timeout
        if upstream.headers.get("content-type", "").startswith("text/event-stream"):
            return RelayResponse(upstream, headers, done, rid, idle)
        outcome = "client_gone"
        try:
            body = await read_body(upstream, idle)
            outcome = "ok"
        except STREAM_ERRORS as e:
            outcome = "upstream_broken"
            raise APIError(502, f"the replica's response broke off: {type(e).__name__}") from None
        except asyncio.TimeoutError:
            outcome = "upstream_timeout"
            raise APIError(504, f"the replica sent its headers, then nothing for {idle:g} s "
                                f"(--upstream-idle-timeout)") from None
        finally:
            done(outcome)
            await upstream.aclose()
        resp = Response(body, status_code=upstream.status_code)
        resp.raw_headers = [*headers, (b"content-length", str(len(body)).encode())]
        return resp

    # -- other endpoints ------------------------------------------------------------------------
    def models_body(self) -> dict:
        cards = []
        for m in self.models.values():
            if not (m.has_ready() or m.spec.scale_from_zero):
                continue
            lens = [p.max_model_len for p in m.pools.values() if p.max_model_len]
            cards.append({"id": m.name, "object": "model", "created": int(time.time()),
                          "owned_by": "pagefleet", "root": m.spec.root or m.name,
                          "parent": None, "max_model_len": max(lens) if lens else None,
                          "permission": []})
        return {"object": "list", "data": cards}


async def _discard(call: asyncio.Future) -> None:
    """Cancel an upstream call we no longer want, or close the response it got."""
    if not call.done():
        call.cancel()
    try:
        response = await call
    except BaseException:  # noqa: BLE001 - cancelled or failed: nothing to close
        return
    await response.aclose()


def _why(e: BaseException) -> str:
    """How a failed attempt is named in the log line."""
    if isinstance(e, FirstByteTimeout):
        return "no response headers within --upstream-first-byte-timeout"
    if isinstance(e, ReplicaLost):
        return "left its pool for failed health checks"
    return type(e).__name__


async def _until_disconnect(request: Request, work) -> Response:
    """Run `work` unless the client goes away first (a queued request then leaves the
    queue; an upstream call is closed, which aborts it on the server)."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(wait_disconnect(request.receive))
    try:
        done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        task.cancel()
        watcher.cancel()
        raise
    if task in done:
        watcher.cancel()
        return task.result()
    task.cancel()
    with contextlib.suppress(BaseException):
        result = await task
        if isinstance(result, RelayResponse):   # finished just as the client left
            result.on_done("client_gone")
            await result.upstream.aclose()
    log.info("request %s: client disconnected before the response", request_id(request))
    return Response(status_code=499)


class KeyCheckMiddleware:
    """The API key and the rate limit of a generation request, checked from its headers
    before its body is read (`BodyLimitMiddleware` runs inside this one): a client with
    no valid key, or over its rate, is refused without the gateway first buffering up to
    --max-request-body-bytes for it, as the server checks its key (api/auth.py). The
    key's name goes to the handler in the request's state."""

    def __init__(self, app, gateway: Gateway, paths: frozenset[str]) -> None:
        self.app = app
        self.gateway = gateway
        self.paths = paths

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["method"] != "POST" or scope["path"] not in self.paths:
            return await self.app(scope, receive, send)
        request = Request(scope)
        try:
            request.state.key_name = self.gateway.check_key(request)
        except APIError as e:
            rid = request_id(request)
            log.log(logging.WARNING if e.status == 429 else logging.INFO,
                    "request %s: %d %s", rid, e.status, e.message)
            self.gateway.metrics.requests.labels("", str(e.status)).inc()
            return await error_response(e, rid)(scope, receive, send)
        await self.app(scope, receive, send)


def build_app(gateway: Gateway) -> Starlette:
    def endpoint(kind: str, path: str) -> Callable:
        async def handler(request: Request) -> Response:
            rid = request_id(request)
            raw = await request.body()
            try:
                return await _until_disconnect(request, gateway.generate(kind, path, request, raw))
            except APIError as e:
                level = logging.WARNING if e.status in (429, 502, 503) else logging.INFO
                log.log(level, "request %s: %d %s", rid, e.status, e.message)
                model = _model_label(gateway, raw)
                gateway.metrics.requests.labels(model, str(e.status)).inc()
                return error_response(e, rid)
        return handler

    async def models(request: Request) -> Response:
        rid = request_id(request)
        try:
            gateway.authenticate(request)       # /v1/* needs a key with --api-keys-file
        except APIError as e:
            return error_response(e, rid)
        return json_response(gateway.models_body(), headers={"x-request-id": rid})

    async def health(request: Request) -> Response:
        ready = {m.name: sum(len(p.ready_endpoints()) for p in m.pools.values())
                 for m in gateway.models.values()}
        return json_response({"status": "ok", "ready_endpoints": ready})

    async def metrics(request: Request) -> Response:
        return Response(gateway.metrics.render(),
                        media_type="text/plain; version=0.0.4; charset=utf-8")

    async def http_error(request: Request, exc: HTTPException) -> Response:
        msg = "Not Found" if exc.status_code == 404 else str(exc.detail)
        return error_response(APIError(exc.status_code, msg), request_id(request))

    async def unexpected(request: Request, exc: Exception) -> Response:
        log.exception("request %s failed", request_id(request))
        return error_response(APIError(500, f"internal error: {type(exc).__name__}"),
                              request_id(request))

    @contextlib.asynccontextmanager
    async def lifespan(app):
        await gateway.start()
        log.info("gateway ready: %d model(s): %s", len(gateway.models),
                 ", ".join(gateway.models) or "-")
        try:
            yield
        finally:
            await gateway.stop()

    generation = {"/v1/chat/completions": "chat", "/v1/completions": "completion",
                  "/v1/responses": "responses"}
    routes = [
        *(Route(path, endpoint(kind, path), methods=["POST"]) for path, kind in generation.items()),
        Route("/v1/models", models, methods=["GET"]),
        Route("/health", health, methods=["GET"]),
        Route("/metrics", metrics, methods=["GET"]),
    ]
    app = Starlette(routes=routes, lifespan=lifespan,
                    exception_handlers={HTTPException: http_error, Exception: unexpected})
    app.state.gateway = gateway
    # The body cap runs before any handler reads (and tokenizes) a body: one oversized
    # body used to cost the gateway seconds of CPU and gigabytes of memory per request.
    app.add_middleware(BodyLimitMiddleware, max_bytes=gateway.cfg.max_request_body_bytes,
                       timeout=gateway.cfg.request_body_timeout)
    # ... and the key check before the body cap (the last added runs first)
    app.add_middleware(KeyCheckMiddleware, gateway=gateway, paths=frozenset(generation))
    app.add_middleware(RequestIdMiddleware)
    return app


def _model_label(gateway: Gateway, raw: bytes) -> str:
    """The metric label for a refused request: a known model's name, else ''."""
    try:
        name = json.loads(raw).get("model")
    except Exception:  # noqa: BLE001 - malformed bodies have no model
        return ""
    return name if isinstance(name, str) and name in gateway.models else ""
