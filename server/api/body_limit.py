"""Request bodies: capped, read once, on a deadline, and a client that hangs up
mid-body is quiet.

A pure ASGI middleware between the auth check and the app: a body over
`--max-request-body-bytes` gets a 413 as soon as its `Content-Length` (or, when
chunked, its bytes so far) says so, before any parsing; an accepted body is handed to
the app as one message, after which `receive()` reaches the client again (the
handlers watch it for a disconnect while they stream). A client that disconnects
before its body is complete costs one debug line, not a traceback.

A rejected body is drained, not abandoned: closing a socket that still holds unread
request bytes makes the kernel answer with a TCP reset, and a client that was still
uploading (most HTTP clients send the whole body before they read) then loses the 413
it was sent and sees "connection reset" instead. So the 413 goes out at once, whole,
and the connection stays open reading and discarding the rest of the body for up to
`LINGER_S` (nginx's lingering close does the same) before it closes.

A body must arrive whole within `--request-body-timeout` seconds of the request's
headers, or the request gets a 408 and its connection is closed: without a deadline a
client that sends headers and part of a body (slowloris) holds a connection and a task
for ever, and enough of them exhaust the process's file descriptors. The deadline is
for the whole body, not between reads, so trickling a byte at a time does not extend
it. When the server starts its shutdown drain (`closing`), bodies still arriving are
answered with a 503 at once: the request would be refused as a late arrival anyway,
and a read still pending when uvicorn's graceful timeout cancels it was logged as a
CancelledError traceback. (Headers are read by uvicorn, which has no deadline for
them: that is the reverse proxy's job, see docs/server.md, Flags.)
"""

from __future__ import annotations

import asyncio
import json
import logging
import time

from pagefleet.server.api.errors import DRAINING_HEADER, RETRY_AFTER_SECONDS, error_body

log = logging.getLogger("pagefleet.api")

# How long a rejected upload may keep its connection while its remaining bytes are
# read and dropped; a client slower than this gets the close (and maybe the reset).
LINGER_S = 10.0

# What the next body message turned out to be when it was not a message.
TIMED_OUT, CLOSING = "timed out", "closing"


def body_refusal(why: str, timeout: float) -> tuple[int, str]:
    """(status, message) for a body that did not arrive: too slow, or the server is
    shutting down."""
    if why == TIMED_OUT:
        return 408, (f"the request body did not arrive within {timeout:g} s of its headers "
                     f"(--request-body-timeout)")
    return 503, "the server is shutting down and accepts no new requests"


class BodyLimitMiddleware:
    def __init__(self, app, max_bytes: int, timeout: float = 60.0,
                 closing: asyncio.Event | None = None) -> None:
        self.app = app
        self.max_bytes = max_bytes
        self.timeout = timeout
        self.closing = closing

    async def _next(self, receive, deadline: float) -> dict | str:
        """The next ASGI message, or TIMED_OUT past `deadline` (loop time), or CLOSING
        once `closing` is set. A message already received wins over both (both tasks
        finish their first step before `wait` returns), so a body that is all here is
        still served while the server drains. A pending `receive()` is safe to cancel:
        uvicorn takes nothing off the connection until it returns."""
        left = deadline - asyncio.get_running_loop().time()
        if left <= 0:
            return TIMED_OUT
        msg = asyncio.ensure_future(receive())
        waiters = {msg}
        if self.closing is not None:
            waiters.add(asyncio.ensure_future(self.closing.wait()))
        try:
            await asyncio.wait(waiters, timeout=left, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for w in waiters:
                if not w.done():
                    w.cancel()
        if msg.done() and not msg.cancelled():
            return msg.result()
        return CLOSING if self.closing is not None and self.closing.is_set() else TIMED_OUT

    async def _refuse(self, send, scope, why: str) -> None:
        status, msg = body_refusal(why, self.timeout)
        log.info("request %s: %d %s", scope.get("state", {}).get("request_id", "-"), status, msg)
        body = json.dumps(error_body(status, msg)).encode()
        headers = [(b"content-type", b"application/json"),
                   (b"content-length", str(len(body)).encode()), (b"connection", b"close")]
        if status == 503:     # as every 503: another replica can take it
            headers.append((b"retry-after", str(RETRY_AFTER_SECONDS).encode()))
            headers.append((DRAINING_HEADER.lower().encode(), b"1"))
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": body})

    async def _reject(self, send, scope, receive, body_done: bool) -> None:
        msg = (f"the request body is larger than the server accepts "
               f"(--max-request-body-bytes {self.max_bytes})")
        log.info("request %s: 413 %s", scope.get("state", {}).get("request_id", "-"), msg)
        body = json.dumps(error_body(413, msg)).encode()
        await send({"type": "http.response.start", "status": 413,
                    "headers": [(b"content-type", b"application/json"),
                                (b"content-length", str(len(body)).encode()),
                                (b"connection", b"close")]})
        await send({"type": "http.response.body", "body": body, "more_body": True})
        if not body_done and not _expects_continue(scope):
            await _drain(receive)
        await send({"type": "http.response.body", "body": b""})

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["method"] in ("GET", "HEAD", "OPTIONS"):
            return await self.app(scope, receive, send)
        for name, value in scope["headers"]:
            if name == b"content-length":
                try:
                    if int(value) > self.max_bytes:
                        return await self._reject(send, scope, receive, body_done=False)
                except ValueError:
                    pass
                break
        chunks: list[bytes] = []
        size = 0
        deadline = asyncio.get_running_loop().time() + self.timeout
        while True:
            msg = await self._next(receive, deadline)
            if isinstance(msg, str):
                return await self._refuse(send, scope, msg)
            if msg["type"] == "http.disconnect":
                log.debug("request %s: client disconnected before its body was complete",
                          scope.get("state", {}).get("request_id", "-"))
                return
            part = msg.get("body", b"")
            size += len(part)
            if size > self.max_bytes:
                return await self._reject(send, scope, receive,
                                          body_done=not msg.get("more_body", False))
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


def _expects_continue(scope) -> bool:
    """A client that sent `Expect: 100-continue` waits for our go before it uploads;
    reading would invite the body we are refusing."""
    return any(n == b"expect" and v.lower() == b"100-continue" for n, v in scope["headers"])


async def _drain(receive) -> None:
    """Read and drop the rest of a refused body until it ends, the client leaves or
    `LINGER_S` passes."""
    deadline = time.monotonic() + LINGER_S
    try:
        while (left := deadline - time.monotonic()) > 0:
            msg = await asyncio.wait_for(receive(), left)
            if msg["type"] == "http.disconnect" or not msg.get("more_body", False):
                return
    except asyncio.TimeoutError:
        log.debug("a refused upload was still sending after %.0f s; closing", LINGER_S)
