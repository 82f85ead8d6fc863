"""The checks every ``/v1/*`` request passes before routing reads its body, and the drain state.

``RequestGuard`` is a pure ASGI middleware, outermost, so its order is the order a client sees:

1. draining (SIGTERM received): 503 ``shutting_down`` with ``Retry-After``;
2. API key (when keys are configured): 401 with ``WWW-Authenticate: Bearer``, before any byte of the
   body is read or parsed, so a bad body without a key is a 401, never a 400;
3. body size (every route except the voice upload, which streams its own larger limit): a declared
   ``Content-Length`` above ``TTS_MAX_REQUEST_BYTES`` is a 413 without reading; a chunked body is
   counted as it arrives and refused as soon as it passes the limit;
4. JSON routes: a body declared as something other than JSON is a 400 ``invalid_content_type``.

``Drain`` counts the ``/v1/*`` requests in flight, so the server can wait for them when it stops.
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Sequence
from email.message import Message as EmailMessage

from pydantic import SecretStr
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from gateway.errors import ApiError, InvalidRequest, PayloadTooLarge, ShuttingDown, Unauthorized, error_response

API_PREFIX = "/v1/"
#: Routes that read their own (multipart, streamed, separately limited) body.
STREAMED_BODY_ROUTES = frozenset({("POST", "/v1/audio/voices")})
#: Routes whose body is a JSON object.
JSON_ROUTES = frozenset({("POST", "/v1/audio/speech")})


class Drain:
    """In-flight ``/v1/*`` requests and whether the server is draining (no new work accepted)."""

    def __init__(self) -> None:
        self.in_flight = 0
        self.started_at: float | None = None

    @property
    def draining(self) -> bool:
        return self.started_at is not None

    def begin(self) -> None:
        if self.started_at is None:
            self.started_at = time.monotonic()

    def enter(self) -> None:
        self.in_flight += 1

    def leave(self) -> None:
        self.in_flight -= 1

    def finished(self, grace_s: float) -> bool:
        """Draining and either idle or out of grace time."""
        if self.started_at is None:
            return False
        return self.in_flight == 0 or time.monotonic() - self.started_at >= grace_s


def check_api_key(authorization: str, keys: Sequence[SecretStr]) -> None:
    """Bearer auth (constant-time comparison); nothing to check when no keys are configured."""
    if not keys:
        return
    scheme, _, token = authorization.partition(" ")
    token = token.strip()
    if scheme.lower() != "bearer" or not token:
        raise Unauthorized("You didn't provide an API key. Send it in the Authorization header as 'Bearer <key>'.")
    if not any(secrets.compare_digest(token.encode(), key.get_secret_value().encode()) for key in keys):
        raise Unauthorized("Incorrect API key provided.")


def _is_json(content_type: str) -> bool:
    message = EmailMessage()
    message["content-type"] = content_type
    subtype = message.get_content_subtype()
    return message.get_content_maintype() == "application" and (subtype == "json" or subtype.endswith("+json"))


class RequestGuard:
    def __init__(
        self, app: ASGIApp, *, drain: Drain, api_keys: Sequence[SecretStr], max_body_bytes: int, retry_after_s: int
    ) -> None:
        self._app = app
        self._drain = drain
        self._api_keys = list(api_keys)
        self._max_body_bytes = max_body_bytes
        self._retry_after_s = retry_after_s

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not scope["path"].startswith(API_PREFIX):
            await self._app(scope, receive, send)
            return
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        route = (scope["method"], scope["path"].rstrip("/"))
        try:
            if self._drain.draining:
                raise ShuttingDown(
                    "The server is shutting down; retry on another replica.", retry_after=self._retry_after_s
                )
            check_api_key(headers.get("authorization", ""), self._api_keys)
            if route not in STREAMED_BODY_ROUTES:
                receive = await self._buffered_body(headers, receive)
            if route in JSON_ROUTES and not _is_json(headers.get("content-type", "")):
                raise InvalidRequest(
                    "Send the request body as JSON with 'Content-Type: application/json'.",
                    code="invalid_content_type",
                )
        except ApiError as error:
            await error_response(error)(scope, receive, send)
            return
        except _Disconnected:
            return  # nobody to answer
        self._drain.enter()
        try:
            await self._app(scope, receive, send)
        finally:
            self._drain.leave()

    async def _buffered_body(self, headers: dict[str, str], receive: Receive) -> Receive:
        """Read the whole body (at most the limit) and hand it on; later receives go to the server
        (so the route still sees a disconnect)."""
        declared = headers.get("content-length", "")
        if declared.isdigit() and int(declared) > self._max_body_bytes:
            raise self._too_large()
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                raise _Disconnected
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self._max_body_bytes:
                raise self._too_large()
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        replay: list[Message] = [{"type": "http.request", "body": b"".join(chunks), "more_body": False}]

        async def replayed() -> Message:
            return replay.pop() if replay else await receive()

        return replayed

    def _too_large(self) -> PayloadTooLarge:
        return PayloadTooLarge(f"The request body is larger than the limit of {self._max_body_bytes} bytes.")


class _Disconnected(Exception):
    pass
