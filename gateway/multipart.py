"""Reading a multipart/form-data body with a hard byte limit enforced while it arrives.

FastAPI's ``Form``/``UploadFile`` parameters read the whole body before the route runs; here the
stream is counted as it is parsed and reading stops at the limit, so an oversized upload costs at
most ``max_body_bytes`` (and a declared ``Content-Length`` above it is refused without reading).
"""

from __future__ import annotations

from collections.abc import AsyncIterator

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


async def _limited(stream: AsyncIterator[bytes], max_body_bytes: int, param: str) -> AsyncIterator[bytes]:
    received = 0
    async for chunk in stream:
        received += len(chunk)
        if received > max_body_bytes:
            raise _too_large(max_body_bytes, param)
        yield chunk


async def read_multipart(request: Request, *, max_body_bytes: int, file_param: str) -> FormData:
    """The form of a multipart request with at most one file; ``file_too_large`` (param
    ``file_param``) when the body exceeds ``max_body_bytes``. Close the returned form when done."""
    content_type = request.headers.get("content-type", "")
    if not content_type.lower().startswith("multipart/form-data"):
        raise InvalidRequest("Send the upload as multipart/form-data.", code="invalid_content_type")
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > max_body_bytes:
        raise _too_large(max_body_bytes, file_param)
    parser = MultiPartParser(
        request.headers,
        _limited(request.stream(), max_body_bytes, file_param),  # type: ignore[arg-type]
        max_files=1,
        max_fields=MAX_FIELDS,
        max_part_size=MAX_FIELD_BYTES,
    )
    try:
        return await parser.parse()
    except MultiPartException as exc:
        raise InvalidRequest(f"Invalid multipart form: {exc.message}", code="invalid_multipart") from exc
