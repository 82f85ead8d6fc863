"""One exception hierarchy, rendered by one handler as OpenAI's ``{"error": {...}}`` body."""

from __future__ import annotations

import logging
import re
from typing import Any, ClassVar

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.requests import ClientDisconnect
from starlette.exceptions import HTTPException as StarletteHTTPException

logger = logging.getLogger(__name__)

#: The status logged and counted for a request whose client left before the answer (nginx's convention).
CLIENT_CLOSED_REQUEST = 499


class ApiError(Exception):
    """An error with its HTTP status and OpenAI ``type``/``code``/``param``."""

    status: ClassVar[int] = 500
    type: ClassVar[str] = "server_error"
    default_code: ClassVar[str | None] = None
    #: Seconds for ``Retry-After``; set on transient errors (429/503).
    retry_after: int | None = None

    def __init__(self, message: str, *, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code if code is not None else self.default_code

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def headers(self) -> dict[str, str]:
        if self.retry_after is not None:
            return {"Retry-After": str(self.retry_after)}
        if self.status >= 500:
            # The SDK retries 5xx by default; a request that failed in the model fails again.
            return {"x-should-retry": "false"}
        return {}


class InvalidRequest(ApiError):
    status = 400
    type = "invalid_request_error"
    default_code = "invalid_value"


class Unauthorized(ApiError):
    status = 401
    type = "invalid_request_error"
    default_code = "invalid_api_key"

    def headers(self) -> dict[str, str]:
        return {"WWW-Authenticate": "Bearer"}  # RFC 9110: a 401 names the scheme it wants


class PayloadTooLarge(ApiError):
    status = 413
    type = "invalid_request_error"
    default_code = "request_too_large"


class NotFound(ApiError):
    status = 404
    type = "invalid_request_error"
    default_code = "not_found"


class ModelNotFound(NotFound):
    default_code = "model_not_found"


class VoiceNotFound(NotFound):
    """A voice resource (``/v1/audio/voices/{id}``) that does not exist: the path names something absent."""

    default_code = "voice_not_found"


class UnknownVoice(InvalidRequest):
    """A request body whose ``voice`` names no voice: a 400 like OpenAI's answer to an unsupported voice.

    Not a 404: the route exists and works, the request is what is wrong. Routers in front of several
    deployments (LiteLLM) take a 404 for a broken deployment and stop sending it anyone's traffic for a
    while, so one client's typo would take the model down for every client behind the router."""

    default_code = "voice_not_found"


class Forbidden(ApiError):
    status = 403
    type = "invalid_request_error"
    default_code = "permission_denied"


class Conflict(ApiError):
    status = 409
    type = "invalid_request_error"
    default_code = "conflict"


class _Transient(ApiError):
    def __init__(self, message: str, *, retry_after: int, code: str | None = None) -> None:
        super().__init__(message, code=code)
        self.retry_after = retry_after


class TooManyRequests(_Transient):
    """The gateway's own in-flight limit is reached."""

    status = 429
    type = "rate_limit_error"
    default_code = "rate_limit_exceeded"


class BackendUnavailable(_Transient):
    """Triton is unreachable or the pipeline models are not ready."""

    status = 503
    type = "server_error"
    default_code = "backend_unavailable"


class ShuttingDown(_Transient):
    """The gateway is draining before it exits: requests in flight finish, new ones go elsewhere."""

    status = 503
    type = "server_error"
    default_code = "shutting_down"


class ClientGone(Exception):
    """The client closed the connection before the answer was ready: nobody is left to answer."""


class BackendOverloaded(_Transient):
    """The pipeline refused the request (``[overloaded]``)."""

    status = 503
    type = "server_error"
    default_code = "backend_overloaded"


class SynthesisTimeout(ApiError):
    status = 504
    type = "server_error"
    default_code = "timeout"


class SynthesisFailed(ApiError):
    status = 500
    type = "server_error"
    default_code = "synthesis_failed"


def error_response(error: ApiError) -> JSONResponse:
    return JSONResponse(error.body(), status_code=error.status, headers=error.headers())


# pydantic error type -> OpenAI error code
_VALIDATION_CODES = {
    "missing": "missing_required_parameter",
    "string_too_long": "string_above_max_length",
    "string_too_short": "string_below_min_length",
    "string_type": "invalid_type",
    "float_type": "invalid_type",
    "float_parsing": "invalid_type",
    "int_type": "invalid_type",
    "int_parsing": "invalid_type",
    "bool_type": "invalid_type",
    "bool_parsing": "invalid_type",
    "model_type": "invalid_type",
    "dict_type": "invalid_type",
    "extra_forbidden": "unknown_parameter",
}


def unparsable_json() -> InvalidRequest:
    """A body that is not JSON at all (malformed, not UTF-8, nested too deep to read): one answer for all."""
    return InvalidRequest(
        "We could not parse the JSON body of your request. Send valid JSON (UTF-8).", code="invalid_json"
    )


#: What a field takes, for a value of the wrong type where the schema's own words would name internal types.
_FIELD_FORMS = {"voice": 'a voice name or id (a string), or an object {"id": "<voice id>"}'}


def _is_type_tag(part: object) -> bool:
    """A union member's type name that pydantic adds to an error location (voice -> "str", "VoiceRef"): our
    field names are lower_snake_case, type names are a builtin's name or CamelCase."""
    return isinstance(part, str) and (part in {"str", "int", "float", "bool", "dict", "list"} or part[:1].isupper())


def validation_error(exc: RequestValidationError) -> InvalidRequest:
    """The first problem of a request validation failure, as one OpenAI error."""
    errors = exc.errors()
    if not errors:
        return InvalidRequest("Invalid request.")
    first = errors[0]
    if len(errors) > 1:
        # A union field (voice) reports one error per member: prefer one that is not a bare type mismatch.
        same_field = [e for e in errors if e.get("loc", ())[:2] == first.get("loc", ())[:2]]
        first = next((e for e in same_field if not e.get("type", "").endswith("_type")), first)
    if first.get("type") == "json_invalid":
        return unparsable_json()
    loc = [str(part) for part in first.get("loc", ()) if part != "body" and not _is_type_tag(part)]
    param = loc[0] if loc else None
    if param is None:
        return InvalidRequest("The request body must be a JSON object.", code="invalid_type")
    kind = first.get("type", "")
    if kind.endswith("_type") and param in _FIELD_FORMS and len(loc) == 1:
        message = f"Invalid type for '{param}': give {_FIELD_FORMS[param]}."
    else:
        message = f"Invalid value for '{'.'.join(loc)}': {first.get('msg', 'invalid')}."
    return InvalidRequest(message, param=param, code=_VALIDATION_CODES.get(kind, "invalid_value"))


def _path_pattern(template: str) -> str:
    """An OpenAPI path template as a regular expression: each ``{parameter}`` is one path segment."""
    parts = re.split(r"(\{[^/}]+\})", template)
    return "".join("[^/]+" if part.startswith("{") else re.escape(part) for part in parts)


def unknown_route(request: Request, status: int) -> ApiError:
    """404/405 that say what exists: OpenAI's "Invalid URL (METHOD path)", and the right path or method when the
    request only missed the `/v1` prefix or used another method."""
    method, path = request.method, request.url.path
    # The API's routes as its OpenAPI document lists them (built once and cached by FastAPI).
    routes = {
        (route_method.upper(), route_path)
        for route_path, operations in request.app.openapi().get("paths", {}).items()
        for route_method in operations
    }
    def matches(template: str, candidate: str) -> bool:
        return re.fullmatch(_path_pattern(template), candidate) is not None

    message = f"Invalid URL ({method} {path})."
    if status == 405:
        allowed = sorted(m for m, p in routes if matches(p, path))
        return InvalidRequest(
            f"{message} {path} takes {' or '.join(allowed)}, not {method}.", code="method_not_allowed"
        )
    prefixed = "/v1" + path
    methods = sorted(m for m, p in routes if matches(p, prefixed))
    if not path.startswith("/v1/") and methods:
        message += f" The API is under /v1: {' or '.join(methods)} {prefixed}."
    return NotFound(message)


def install_error_handlers(app: FastAPI) -> None:
    async def on_api_error(_: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, ApiError)
        return error_response(exc)

    async def on_validation_error(_: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, RequestValidationError)
        return error_response(validation_error(exc))

    async def on_http_error(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, StarletteHTTPException)
        error: ApiError
        if exc.status_code in (404, 405):
            error = unknown_route(request, exc.status_code)
        elif exc.status_code == 400:
            error = unparsable_json()  # FastAPI's only 400: a JSON body it could not read (not UTF-8, too deep)
        else:
            error = InvalidRequest(str(exc.detail))
        return JSONResponse(error.body(), status_code=exc.status_code, headers=getattr(exc, "headers", None))

    async def on_client_gone(request: Request, exc: Exception) -> Response:
        # Not a server error: the client aborted (e.g. an upload cut short). One quiet line, no traceback.
        logger.info("client disconnected before the answer: %s %s", request.method, request.url.path)
        return Response(status_code=CLIENT_CLOSED_REQUEST)

    async def on_unexpected(_: Request, exc: Exception) -> JSONResponse:
        logger.exception("unhandled error", exc_info=exc)
        return error_response(SynthesisFailed("Internal server error.", code="internal_error"))

    app.add_exception_handler(ApiError, on_api_error)
    app.add_exception_handler(RequestValidationError, on_validation_error)
    app.add_exception_handler(StarletteHTTPException, on_http_error)
    app.add_exception_handler(ClientGone, on_client_gone)
    app.add_exception_handler(ClientDisconnect, on_client_gone)
    app.add_exception_handler(Exception, on_unexpected)

