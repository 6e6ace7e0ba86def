"""API key check for /v1/*, as vLLM does it: `Authorization: Bearer KEY`.

A pure ASGI middleware (not BaseHTTPMiddleware, which buffers streaming responses).
/health, /metrics, /version, /tokenize and /detokenize stay open so probes and
scrapers need no secret. The comparison is constant-time (`hmac.compare_digest` on
bytes) so response timing does not leak how much of a guessed key was right.
"""

from __future__ import annotations

import hmac
import json

from pagefleet.server.api.errors import error_body

PROTECTED_PREFIX = "/v1"


def key_matches(header: bytes | None, key: bytes) -> bool:
    """True when an Authorization header value carries the key (pure, constant-time)."""
    if not header:
        return False
    scheme, _, token = header.partition(b" ")
    if scheme.lower() != b"bearer":
        return False
    return hmac.compare_digest(token.strip(), key)


class APIKeyMiddleware:
    def __init__(self, app, api_key: str) -> None:
        self.app = app
        self.key = api_key.encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["method"] == "OPTIONS" or not (
                scope["path"] == PROTECTED_PREFIX or scope["path"].startswith(PROTECTED_PREFIX + "/")):
            return await self.app(scope, receive, send)
        header = None
        for name, value in scope["headers"]:
            if name == b"authorization":
                header = value
                break
        if key_matches(header, self.key):
            return await self.app(scope, receive, send)
        body = json.dumps(error_body(401, "Unauthorized: a valid 'Authorization: Bearer <key>' "
                                          "header is required")).encode()
        await send({"type": "http.response.start", "status": 401,
                    "headers": [(b"content-type", b"application/json"),
                                (b"content-length", str(len(body)).encode()),
                                (b"www-authenticate", b"Bearer")]})
        await send({"type": "http.response.body", "body": body})
