"""Reading a multipart/form-data body with a hard byte limit enforced while it arrives.

FastAPI's ``Form``/``UploadFile`` parameters read the whole body before the route runs; here the
stream is counted as it is parsed and reading stops at the limit, so an oversized upload costs at
most ``max_body_bytes`` (and a declared ``Content-Length`` above it is refused without reading).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from email.message import Message as EmailMessage

from fastapi import Request
from starlette.datastructures import FormData
from starlette.formparsers import MultiPartException, MultiPartParser

from gateway.errors import InvalidRequest

#: Text fields are short; this caps each of them (a file part is only bounded by the body limit).
MAX_FIELD_BYTES = 16 * 1024
MAX_FIELDS = 16


def _too_large(max_body_bytes: int, param: str) -> InvalidRequest:
    return InvalidRequest(
        f"The upload is larger than the limit of {max_body_bytes} bytes.", param=param, code="file_too_large"
    )


class _Body:
    """The body as it streams to the parser: counted against the limit, and watched for the closing delimiter
    (``--<boundary>--``). The parser takes a body that stops early for a complete one with fewer parts, so a
    cut-off upload would be refused for a part it did send ("needs a 'name'") or stored with half its audio."""

    def __init__(self, stream: AsyncIterator[bytes], boundary: bytes, max_body_bytes: int, param: str) -> None:
        self._stream = stream
        self._closing = b"--" + boundary + b"--"
        self._max_body_bytes = max_body_bytes
        self._param = param
        self.complete = False

    async def chunks(self) -> AsyncIterator[bytes]:
        received = 0
        tail = b""  # the delimiter may straddle two chunks
        async for chunk in self._stream:
            received += len(chunk)
            if received > self._max_body_bytes:
                raise _too_large(self._max_body_bytes, self._param)
            window = tail + chunk
            self.complete = self.complete or self._closing in window
            tail = window[-len(self._closing) :]
            yield chunk


def _boundary(content_type: str) -> bytes:
    message = EmailMessage()
    message["content-type"] = content_type
    return (message.get_param("boundary") or "").encode("latin-1")  # type: ignore[union-attr]


async def read_multipart(request: Request, *, max_body_bytes: int, file_param: str) -> FormData:
    """The form of a multipart request with at most one file; ``file_too_large`` (param
    ``file_param``) when the body exceeds ``max_body_bytes``. Close the returned form when done."""
    content_type = request.headers.get("content-type", "")
    if not content_type.lower().startswith("multipart/form-data"):
        raise InvalidRequest("Send the upload as multipart/form-data.", code="invalid_content_type")
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > max_body_bytes:
        raise _too_large(max_body_bytes, file_param)
    boundary = _boundary(content_type)
    if not boundary:
        raise InvalidRequest("The multipart/form-data content type names no boundary.", code="invalid_multipart")
    body = _Body(request.stream(), boundary, max_body_bytes, file_param)
    parser = MultiPartParser(
        request.headers,
        body.chunks(),  # type: ignore[arg-type]
        max_files=1,
        max_fields=MAX_FIELDS,
        max_part_size=MAX_FIELD_BYTES,
    )
    try:
        form = await parser.parse()
    except MultiPartException as exc:
        raise InvalidRequest(f"Invalid multipart form: {exc.message}", code="invalid_multipart") from exc
    if not body.complete:
        await form.close()
        raise InvalidRequest(
            "The multipart body ended before its closing boundary: the upload was cut off. Send it again.",
            code="invalid_multipart",
        )
    return form
