"""Give every request an id and echo it in `X-Request-Id` on every response.

The client's own `X-Request-Id` wins (so a gateway's trace id follows the request into
our logs); otherwise a random one is made. Handlers read it from
`request.state.request_id`; every log line about a request names it. Pure ASGI, so it
also covers 401s from the auth middleware inside it and streamed responses.
"""

from __future__ import annotations

import re
import uuid

HEADER = b"x-request-id"
_SAFE = re.compile(r"[^A-Za-z0-9._:/=+@-]")


def clean_request_id(value: str, limit: int = 128) -> str:
    """A client-sent id made safe for logs and headers (pure)."""
    return _SAFE.sub("_", value)[:limit]


def new_request_id() -> str:
    return uuid.uuid4().hex


class RequestIdMiddleware:
    def __init__(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        rid = None
        for name, value in scope["headers"]:
            if name == HEADER:
                rid = clean_request_id(value.decode("latin-1"))
                break
        rid = rid or new_request_id()
        scope.setdefault("state", {})["request_id"] = rid
        raw = rid.encode()

        async def send_with_id(message):
            if message["type"] == "http.response.start":
                headers = [(k, v) for k, v in message.get("headers", []) if k.lower() != HEADER]
                headers.append((b"x-request-id", raw))
                message = {**message, "headers": headers}
            await send(message)

        await self.app(scope, receive, send_with_id)
