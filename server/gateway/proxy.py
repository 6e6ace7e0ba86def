"""The upstream call: connect, retry elsewhere before the first byte, relay the answer.

Retry rule: a request is sent to another replica, up to `max_attempts` replicas, when
no response byte came from the one it was on: its connection failed (refused, reset,
closed before the status line: the replica died or is restarting), its headers did
not come within --upstream-first-byte-timeout, the replica left its pool for failed
health checks while the request waited for them (a frozen process still accepts
connections, so only the checks notice), or it answered the draining 503 (it is
shutting down; see `is_draining`). No generation reached the client, so running it
again is safe. Once the status line has arrived nothing is retried: a non-streamed
body that breaks becomes a 502, a stream that breaks ends with an SSE `error` event
and `data: [DONE]`, as the server itself ends a failed stream; a replica silent for
--upstream-idle-timeout once its answer started counts as broken (504).

Streaming is a byte relay: each chunk read from the replica is written to the client
as it arrives, unchanged, so the client sees exactly the server's SSE stream. A client
that goes away closes the upstream connection, which makes the server abort the
request and free its KV blocks.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Callable

import httpx

from pagefleet.server.api.errors import DRAINING_HEADER, APIError, error_body

log = logging.getLogger("pagefleet.gateway")

# Failures that happen before the replica sent a status line (httpx raises them from
# send(), which returns once the response headers are read).
BEFORE_FIRST_BYTE = (httpx.ConnectError, httpx.ConnectTimeout, httpx.RemoteProtocolError,
                     httpx.ReadError, httpx.WriteError, httpx.WriteTimeout, httpx.PoolTimeout)
STREAM_ERRORS = (httpx.ReadError, httpx.RemoteProtocolError, httpx.ReadTimeout)
HOP_HEADERS = {"content-length", "transfer-encoding", "connection", "keep-alive", "date",
               "server", "x-request-id"}
# What a pagefleet server says when it refuses a request because it drains for shutdown
# (servers from before DRAINING_HEADER say only this).
DRAINING_MESSAGE = "the server is shutting down"


class FirstByteTimeout(Exception):
    """The replica sent no response headers within --upstream-first-byte-timeout."""


class ReplicaLost(Exception):
    """The replica left its pool (failed health checks) before it sent the headers."""


# Everything after which a request may go to another replica: nothing was relayed.
RETRYABLE = (*BEFORE_FIRST_BYTE, FirstByteTimeout, ReplicaLost)


def is_draining(upstream: httpx.Response) -> bool:
    """Whether a 503 (body already read) is a replica's refusal because it is shutting
    down: its DRAINING_HEADER, or, from older servers, the drain error's message."""
    if upstream.status_code != 503:
        return False
    if upstream.headers.get(DRAINING_HEADER):
        return True
    try:
        msg = json.loads(upstream.content)["error"]["message"]
    except Exception:  # noqa: BLE001 - any other 503 is the replica's answer
        return False
    return isinstance(msg, str) and msg.startswith(DRAINING_MESSAGE)


async def next_chunk(it, idle_timeout: float):
    """The iterator's next chunk within `idle_timeout` seconds (TimeoutError past it;
    StopAsyncIteration at the end). A timeout scope, not `wait_for`: no task per chunk."""
    async with asyncio.timeout(idle_timeout):
        return await it.__anext__()


async def read_body(upstream: httpx.Response, idle_timeout: float) -> bytes:
    """A non-streamed answer's whole body, each read within `idle_timeout` seconds
    (TimeoutError past it): a replica that freezes after its headers does not hold the
    request for ever."""
    parts: list[bytes] = []
    it = upstream.aiter_bytes()
    while True:
        try:
            parts.append(await next_chunk(it, idle_timeout))
        except StopAsyncIteration:
            return b"".join(parts)


def upstream_headers(rid: str, client_auth: str | None, pool_key: str | None) -> dict[str, str]:
    h = {"content-type": "application/json", "x-request-id": rid, "accept": "*/*"}
    if pool_key:
        h["authorization"] = f"Bearer {pool_key}"
    elif client_auth:
        h["authorization"] = client_auth
    return h


def response_headers(upstream: httpx.Response, extra: dict[str, str]) -> list[tuple[bytes, bytes]]:
    out = [(k.lower().encode("latin-1"), v.encode("latin-1"))
           for k, v in upstream.headers.items() if k.lower() not in HOP_HEADERS]
    out += [(k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in extra.items()]
    return out


def sse_error_event(status: int, message: str) -> bytes:
    return (f"data: {json.dumps(error_body(status, message), separators=(',', ':'))}\n\n"
            "data: [DONE]\n\n").encode()


async def wait_disconnect(receive) -> None:
    while True:
        msg = await receive()
        if msg["type"] == "http.disconnect":
            return


class RelayResponse:
    """An ASGI response that relays an upstream stream chunk by chunk.

    `on_done(outcome)` runs exactly once: 'ok', 'client_gone' or 'upstream_broken'.
    """

    def __init__(self, upstream: httpx.Response, headers: list[tuple[bytes, bytes]],
                 on_done: Callable[[str], None], rid: str, idle_timeout: float) -> None:
        self.upstream = upstream
        self.headers = headers
        self.on_done = on_done
        self.rid = rid
        self.idle_timeout = idle_timeout
        self.status_code = upstream.status_code

    async def _relay(self, send) -> str:
        """Relay chunks until the end; a replica that breaks the stream or goes silent
        for `idle_timeout` (frozen, or its host gone without a reset) ends it with the
        SSE error event, as the server ends a failed stream."""
        tail = b"\n\n"
        it = self.upstream.aiter_raw()
        try:
            while True:
                try:
                    chunk = await next_chunk(it, self.idle_timeout)
                except StopAsyncIteration:
                    break
                if chunk:
                    tail = (tail + chunk)[-2:]
                    await send({"type": "http.response.body", "body": chunk, "more_body": True})
        except (*STREAM_ERRORS, asyncio.TimeoutError) as e:
            if isinstance(e, asyncio.TimeoutError):
                outcome, status = "upstream_timeout", 504
                why = (f"the replica sent nothing for {self.idle_timeout:g} s mid-response "
                       f"(--upstream-idle-timeout)")
            else:
                outcome, status = "upstream_broken", 502
                why = "the replica's stream broke off mid-response"
            log.warning("request %s: %s: %s", self.rid, why, type(e).__name__)
            sep = b"" if tail == b"\n\n" else b"\n\n"
            await send({"type": "http.response.body", "more_body": False,
                        "body": sep + sse_error_event(status, why)})
            return outcome
        await send({"type": "http.response.body", "body": b"", "more_body": False})
        return "ok"

    async def __call__(self, scope, receive, send) -> None:
        outcome = "client_gone"
        try:
            await send({"type": "http.response.start", "status": self.status_code,
                        "headers": self.headers})
            relay = asyncio.ensure_future(self._relay(send))
            watcher = asyncio.ensure_future(wait_disconnect(receive))
            try:
                done, _ = await asyncio.wait({relay, watcher},
                                             return_when=asyncio.FIRST_COMPLETED)
            finally:
                for t in (relay, watcher):
                    if not t.done():
                        t.cancel()
            if relay in done:
                outcome = relay.result()
            else:
                log.info("request %s: client disconnected mid-stream; closing upstream",
                         self.rid)
                try:
                    await relay
                except BaseException:  # noqa: BLE001 - cancelled on purpose
                    pass
        except OSError:
            outcome = "client_gone"
        finally:
            self.on_done(outcome)
            await self.upstream.aclose()


def connection_error(rid: str, attempts: int, last: BaseException,
                     first_byte_timeout: float) -> APIError:
    """The error after the last attempt failed before any byte: 504 when the replica
    took too long to answer, 502 when it could not be reached or dropped out."""
    if isinstance(last, FirstByteTimeout):
        return APIError(504, f"no replica answered the request within "
                             f"{first_byte_timeout:g} s (--upstream-first-byte-timeout) "
                             f"after {attempts} attempt(s)")
    if isinstance(last, ReplicaLost):
        return APIError(502, f"the replica serving the request failed its health checks "
                             f"before it answered, after {attempts} attempt(s)")
    return APIError(502, f"could not reach a replica for the request after {attempts} "
                         f"attempt(s): {type(last).__name__}")
