"""FastAPI app factory: wires the engine bridge, endpoints, auth, metrics and errors.

`build_app(served, server_cfg)` takes a started engine (`ServedEngine`: the core
process, ready, plus the tokenizer; the slow part, done by `serve.run_serve` or a test)
and returns an ASGI app whose lifespan connects to the core and runs a warm-up request
before the server binds its port: a server that answers at all is ready. Endpoint
bodies live in `serving.py`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from importlib.metadata import PackageNotFoundError, version

from fastapi import FastAPI, Request
from starlette.responses import Response

from starlette.requests import ClientDisconnect

from pagefleet.server.api import protocol as P
from pagefleet.server.api.auth import APIKeyMiddleware
from pagefleet.server.api.body_limit import BodyLimitMiddleware
from pagefleet.server.api.errors import (
    DRAINING_HEADER,
    APIError,
    error_response,
    install_error_handlers,
    to_api_error,
)
from pagefleet.server.api.http_metrics import HTTPMetricsMiddleware
from pagefleet.server.api.metrics import MetricsListener, ServerMetrics
from pagefleet.server.api.request_id import RequestIdMiddleware
from pagefleet.server.api.responses import ResponsesServing
from pagefleet.server.api.responses_protocol import ResponsesRequest
from pagefleet.server.api.serving import OpenAIServing, cancel_on_disconnect
from pagefleet.server.api.stats_log import log_stats_forever
from pagefleet.server.config import ServerConfig
from pagefleet.server.engine.async_engine import AsyncEngine
from pagefleet.server.engine.sampling_params import SamplingParams
from pagefleet.server.models.config import resolve_generation_defaults

log = logging.getLogger("pagefleet.api")


def pagefleet_version() -> str:
    try:
        return version("pagefleet")
    except PackageNotFoundError:  # pragma: no cover - running from a bare checkout
        return "0.0.0+unknown"


async def warm_up(async_engine: AsyncEngine, tokenizer) -> None:
    """One short greedy request through the whole path (tokenizer, engine, sampler,
    detokenizer) so the first user request does not pay for lazy initialisation."""
    ids = tokenizer.encode("warm up") or [0]
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, output_kind="delta")
    async for _ in async_engine.generate("warmup-0", ids, params):
        pass
    # Its prefix-cache lookup and tokens stay out of the metrics, as the core's own
    # warm-up does (one call at startup, nothing per step).
    await async_engine.reset_counters()


def build_app(served, server_cfg: ServerConfig, *,
              served_model_name: str | None = None, model_root: str | None = None,
              api_key: str | None = None, chat_template: str | None = None) -> FastAPI:
    engine_cfg = served.config
    names = served_model_name or server_cfg.served_model_name or engine_cfg.model or \
        str(served.model_dir)
    names = [names] if isinstance(names, str) else list(names)
    name = names[0]
    defaults = resolve_generation_defaults(server_cfg.generation_config, served.model_dir,
                                           server_cfg.override_generation_config)
    async_engine = AsyncEngine(served.core, served.ready, served.tokenizer,
                               max_num_queued_requests=server_cfg.max_num_queued_requests,
                               queue_timeout=server_cfg.queue_timeout,
                               max_logprobs=engine_cfg.max_logprobs)
    metrics = ServerMetrics(name, async_engine, block_size=served.ready.block_size,
                            num_blocks=served.ready.num_blocks,
                            enable_prefix_caching=engine_cfg.enable_prefix_caching,
                            cache_dtype=engine_cfg.kv_cache_dtype,
                            gpu_memory_utilization=engine_cfg.gpu_memory_utilization,
                            max_model_len=served.max_model_len)
    serving = OpenAIServing(async_engine, served, served_model_name=name,
                            served_model_aliases=tuple(names[1:]),
                            tool_call_parser=server_cfg.tool_call_parser,
                            enable_auto_tool_choice=server_cfg.enable_auto_tool_choice,
                            reasoning_parser=server_cfg.reasoning_parser,
                            enable_prompt_tokens_details=server_cfg.enable_prompt_tokens_details,
                            response_role=server_cfg.response_role, defaults=defaults,
                            model_root=model_root or str(served.model_dir),
                            chat_template=chat_template,
                            trust_request_chat_template=server_cfg.trust_request_chat_template,
                            scheduling_policy=engine_cfg.scheduling_policy,
                            enable_log_requests=server_cfg.enable_log_requests,
                            max_log_len=server_cfg.max_log_len)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        await async_engine.start()
        await warm_up(async_engine, served.tokenizer)
        async_engine.listener = MetricsListener(metrics)   # warm-up stays out of metrics
        stats_task = asyncio.create_task(
            log_stats_forever(async_engine, metrics, server_cfg.log_stats_interval))
        log.info("ready: serving %r (max_model_len %d)", name, served.max_model_len)
        try:
            yield
        finally:
            stats_task.cancel()
            await async_engine.stop()

    # /openapi.json, /docs and /redoc are served (as vLLM does), outside the API key
    # like /health, unless --disable-fastapi-docs (vLLM's flag) turns them off.
    # Handlers read their bodies themselves (one parse, our error shapes), so each
    # route declares its request model for the schema.
    docs = not server_cfg.disable_fastapi_docs
    app = FastAPI(title="pagefleet", version=pagefleet_version(), lifespan=lifespan,
                  docs_url="/docs" if docs else None, redoc_url="/redoc" if docs else None,
                  openapi_url="/openapi.json" if docs else None)
    app.state.async_engine = async_engine
    app.state.metrics = metrics
    app.state.serving = serving
    responses = ResponsesServing(serving)
    install_error_handlers(app)
    # Innermost first: the body cap runs after the key check (no body is read for a
    # 401), then the request id (401s and 413s carry it too), the request counter
    # outermost.
    app.add_middleware(BodyLimitMiddleware, max_bytes=server_cfg.max_request_body_bytes,
                       timeout=server_cfg.request_body_timeout,
                       closing=async_engine.closing)
    if api_key:
        app.add_middleware(APIKeyMiddleware, api_key=api_key)
    app.add_middleware(RequestIdMiddleware)
    # Outermost: the 401s and 413s above are counted too.
    app.add_middleware(HTTPMetricsMiddleware, counter=metrics.http_requests,
                       routes=app.router.routes)

    def rid_of(request: Request) -> str:
        return request.state.request_id

    async def run(request: Request, handler) -> Response:
        try:
            body = await request.body()
        except ClientDisconnect:
            log.debug("request %s: client disconnected before its body was read",
                      rid_of(request))
            return Response(status_code=499)
        try:
            return await cancel_on_disconnect(request, handler(body, rid_of(request)))
        except APIError as e:
            _log_rejection(rid_of(request), e)
            return error_response(e)
        except Exception as e:  # noqa: BLE001 - engine errors -> OpenAI-shaped errors
            err = to_api_error(e)
            if err.status >= 500 and not isinstance(e, RuntimeError):
                log.exception("request %s failed", rid_of(request))
            _log_rejection(rid_of(request), err)
            return error_response(err)

    @app.post("/v1/completions", openapi_extra=body_schema(P.CompletionRequest))
    async def completions(request: Request) -> Response:
        return await run(request, serving.completions)

    @app.post("/v1/chat/completions", openapi_extra=body_schema(P.ChatCompletionRequest))
    async def chat(request: Request) -> Response:
        return await run(request, serving.chat)

    @app.post("/v1/responses", openapi_extra=body_schema(ResponsesRequest))
    async def responses_create(request: Request) -> Response:
        return await run(request, responses.create)

    @app.get("/v1/responses/{response_id}")
    async def responses_retrieve(response_id: str) -> Response:
        # Nothing is stored (see responses_protocol): always the OpenAI-shaped 404.
        return error_response(responses.not_found(response_id))

    @app.get("/v1/models")
    async def models() -> Response:
        return serving.models()

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str) -> Response:
        try:
            return serving.model(model_id)
        except APIError as e:
            return error_response(e)

    @app.post("/tokenize", openapi_extra=body_schema(P.TokenizeRequest))
    async def tokenize(request: Request) -> Response:
        return await run(request, serving.tokenize)

    @app.post("/detokenize", openapi_extra=body_schema(P.DetokenizeRequest))
    async def detokenize(request: Request) -> Response:
        return await run(request, serving.detokenize)

    @app.api_route("/health", methods=["GET", "HEAD"])
    async def health() -> Response:
        # Alive engine loop -> 200, also while draining: a liveness probe failing during
        # the drain would get the pod killed before its in-flight requests finish. The
        # draining header tells load balancers (the gateway) to send no new requests.
        headers = {DRAINING_HEADER: "1"} if async_engine.is_draining else None
        return Response(status_code=200 if async_engine.is_alive else 503, headers=headers)

    @app.api_route("/ping", methods=["GET", "POST"])
    async def ping() -> Response:
        """SageMaker's health check, served by vLLM too: /health's answer."""
        return Response(status_code=200 if async_engine.is_alive else 503)

    @app.get("/version")
    async def version_() -> Response:
        return Response(f'{{"version": "{pagefleet_version()}"}}', media_type="application/json")

    @app.get("/metrics")
    async def metrics_() -> Response:
        return Response(metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    install_openapi(app)
    return app


_SCHEMA_DEFS: dict[str, dict] = {}


def body_schema(model: type) -> dict:
    """An OpenAPI request body for a route that parses its own body with `model`; its
    nested models go to components/schemas (see `install_openapi`)."""
    schema = model.model_json_schema(ref_template="#/components/schemas/{model}")
    _SCHEMA_DEFS.update(schema.pop("$defs", {}))
    return {"requestBody": {"required": True,
                            "content": {"application/json": {"schema": schema}}}}


def install_openapi(app: FastAPI) -> None:
    from fastapi.openapi.utils import get_openapi

    def openapi() -> dict:
        if app.openapi_schema is None:
            spec = get_openapi(title=app.title, version=app.version, routes=app.routes)
            spec.setdefault("components", {}).setdefault("schemas", {}).update(_SCHEMA_DEFS)
            app.openapi_schema = spec
        return app.openapi_schema

    app.openapi = openapi


def _log_rejection(rid: str, err: APIError) -> None:
    level = logging.WARNING if err.status in (429, 503) or err.status >= 500 else logging.INFO
    log.log(level, "request %s: %d %s", rid, err.status, err.message)
