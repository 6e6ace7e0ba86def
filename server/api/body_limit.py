"""Request bodies: capped, read once, and a client that hangs up mid-body is quiet.

A pure ASGI middleware between the auth check and the app: a body over
`--max-request-body-bytes` gets a 413 as soon as its `Content-Length` (or, when
chunked, its bytes so far) says so, before any parsing; an accepted body is handed to
the app as one message, after which `receive()` reaches the client again (the
handlers watch it for a disconnect while they stream). A client that disconnects
before its body is complete costs one debug line, not a traceback.
"""

from __future__ import annotations

import json
import logging

from pagefleet.server.api.errors import error_body

log = logging.getLogger("pagefleet.api")


class BodyLimitMiddleware:
    def __init__(self, app, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def _reject(self, send, scope) -> None:
        msg = (f"the request body is larger than the server accepts "
               f"(--max-request-body-bytes {self.max_bytes})")
        log.info("request %s: 413 %s", scope.get("state", {}).get("request_id", "-"), msg)
        body = json.dumps(error_body(413, msg)).encode()
        await send({"type": "http.response.start", "status": 413,
                    "headers": [(b"content-type", b"application/json"),
                                (b"content-length", str(len(body)).encode()),
                                (b"connection", b"close")]})
        await send({"type": "http.response.body", "body": body})

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["method"] in ("GET", "HEAD", "OPTIONS"):
            return await self.app(scope, receive, send)
        for name, value in scope["headers"]:
            if name == b"content-length":
                try:
                    if int(value) > self.max_bytes:
                        return await self._reject(send, scope)
                except ValueError:
                    pass
                break
        chunks: list[bytes] = []
        size = 0
        while True:
            msg = await receive()
            if msg["type"] == "http.disconnect":
                log.debug("request %s: client disconnected before its body was complete",
                          scope.get("state", {}).get("request_id", "-"))
                return
            part = msg.get("body", b"")
            size += len(part)
            if size > self.max_bytes:
                return await self._reject(send, scope)
            chunks.append(part)
            if not msg.get("more_body", False):
                break
        body = b"".join(chunks)
        replayed = False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        await self.app(scope, replay, send)
