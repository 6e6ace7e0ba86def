"""OpenAI-shaped errors: `{"error": {"message", "type", "param", "code"}}`.

`type` follows vLLM's server (the exception class name a client library would raise,
e.g. "BadRequestError"), `code` is the HTTP status. Every failure a client can cause
maps to a 4xx here: a 500 means a bug in pagefleet, never bad input.
"""

from __future__ import annotations

import json
import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import Response

from pagefleet.server.engine.async_engine import (
    EngineUnavailableError,
    QueueFullError,
    ServerDrainingError,
)
from pagefleet.server.engine.engine import RequestRejected
from pagefleet.server.engine.sampling_params import SamplingParamsError

log = logging.getLogger("pagefleet.api")

ERROR_TYPES = {
    400: "BadRequestError",
    401: "AuthenticationError",
    403: "PermissionDeniedError",
    404: "NotFoundError",
    405: "MethodNotAllowedError",
    408: "RequestTimeoutError",
    413: "RequestTooLargeError",
    415: "UnsupportedMediaTypeError",
    422: "UnprocessableEntityError",
    429: "RateLimitError",
    500: "InternalServerError",
    502: "BadGatewayError",
    503: "ServiceUnavailableError",
    504: "GatewayTimeoutError",
}
RETRY_AFTER_SECONDS = 1
# Set (value "1") on /health and on the 503 of a request refused while the server drains
# for shutdown: /health itself stays 200 then (a liveness probe must not cut the drain
# short), so this is how a load balancer such as `pagefleet gateway` tells a draining
# replica from a live one and sends the request elsewhere.
DRAINING_HEADER = "X-Pagefleet-Draining"


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param = status, message, param
        self.headers = headers or {}


def bad_request(message: str, param: str | None = None) -> APIError:
    return APIError(400, message, param)


def error_body(status: int, message: str, param: str | None = None) -> dict:
    return {"error": {"message": message, "type": ERROR_TYPES.get(status, "APIError"),
                      "param": param, "code": status}}


def error_response(err: APIError) -> Response:
    return Response(json.dumps(error_body(err.status, err.message, err.param)),
                    status_code=err.status, media_type="application/json",
                    headers=err.headers)


def to_api_error(exc: BaseException) -> APIError:
    """Map engine and validation exceptions onto HTTP errors (pure)."""
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, QueueFullError):
        return APIError(429, str(exc), None, {"Retry-After": str(RETRY_AFTER_SECONDS)})
    if isinstance(exc, EngineUnavailableError):
        # A 503 the client may retry (queue timeout, draining) says when, as the 429 does.
        headers = {"Retry-After": str(RETRY_AFTER_SECONDS)} if exc.status == 503 else None
        if isinstance(exc, ServerDrainingError):
            headers = {**(headers or {}), DRAINING_HEADER: "1"}
        return APIError(exc.status, str(exc), None, headers)
    if isinstance(exc, SamplingParamsError):
        return APIError(400, str(exc), exc.param)
    if isinstance(exc, RequestRejected):
        return APIError(400, str(exc), exc.param)
    if isinstance(exc, ValidationError):
        return validation_error(exc.errors())
    return APIError(500, f"internal error: {type(exc).__name__}")


def validation_error(errors: list[dict]) -> APIError:
    """A 400 naming the first offending field (pydantic/FastAPI error list)."""
    if not errors:
        return bad_request("invalid request")
    first = errors[0]
    loc = [str(p) for p in first.get("loc", ()) if p not in ("body",)]
    # Drop pydantic's union-branch names (e.g. 'str', 'list[int]') from the location.
    loc = [p for p in loc if not (p[:1].islower() and ("[" in p or p in
                                                        ("str", "int", "float", "bool")))]
    param = ".".join(loc) or None
    if first.get("type") == "json_invalid":
        return bad_request(f"malformed JSON body: {first.get('msg', '')}", None)
    msg = first.get("msg", "invalid value")
    if first.get("type") == "value_error":   # our own validators' words, without pydantic's
        msg = msg.removeprefix("Value error, ")
    return bad_request(f"{param}: {msg}" if param else msg, param)


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> Response:
        return error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError) -> Response:
        return error_response(validation_error(list(exc.errors())))

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> Response:
        err = APIError(exc.status_code, str(exc.detail))
        return error_response(err)

    @app.exception_handler(Exception)
    async def _any(request: Request, exc: Exception) -> Response:
        err = to_api_error(exc)
        if err.status >= 500:
            log.exception("request %s failed", getattr(request.state, "request_id", "-"))
        return error_response(err)
