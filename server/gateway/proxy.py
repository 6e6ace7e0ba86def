"""The upstream call: connect, retry elsewhere before the first byte, relay the answer.

Retry rule: a request whose connection to a replica fails before any response byte
(refused, reset, closed before the status line: the replica died or is restarting) is
sent to another replica, up to `max_attempts` replicas; no generation reached the
client, so running it again is safe. Once the status line has arrived nothing is
retried: a non-streamed body that breaks becomes a 502, a stream that breaks ends with
an SSE `error` event and `data: [DONE]`, as the server itself ends a failed stream.

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

from pagefleet.server.api.errors import APIError, error_body

log = logging.getLogger("pagefleet.gateway")

# Failures that happen before the replica sent a status line (httpx raises them from
# send(), which returns once the response headers are read).
BEFORE_FIRST_BYTE = (httpx.ConnectError, httpx.ConnectTimeout, httpx.RemoteProtocolError,
                     httpx.ReadError, httpx.WriteError, httpx.WriteTimeout, httpx.PoolTimeout)
STREAM_ERRORS = (httpx.ReadError, httpx.RemoteProtocolError, httpx.ReadTimeout)
HOP_HEADERS = {"content-length", "transfer-encoding", "connection", "keep-alive", "date",
               "server", "x-request-id"}


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
                 on_done: Callable[[str], None], rid: str) -> None:
        self.upstream = upstream
        self.headers = headers
        self.on_done = on_done
        self.rid = rid
        self.status_code = upstream.status_code

    async def _relay(self, send) -> str:
        tail = b"\n\n"
        try:
            async for chunk in self.upstream.aiter_raw():
                if chunk:
                    tail = (tail + chunk)[-2:]
                    await send({"type": "http.response.body", "body": chunk, "more_body": True})
        except STREAM_ERRORS as e:
            log.warning("request %s: the replica's stream broke after it started: %s",
                        self.rid, type(e).__name__)
            sep = b"" if tail == b"\n\n" else b"\n\n"
            await send({"type": "http.response.body", "more_body": False,
                        "body": sep + sse_error_event(502, "the replica's stream broke off "
                                                           "mid-response")})
            return "upstream_broken"
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


def connection_error(rid: str, attempts: int, last: BaseException) -> APIError:
    return APIError(502, f"could not reach a replica for the request after {attempts} "
                         f"attempt(s): {type(last).__name__}")
