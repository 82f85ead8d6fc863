from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import Awaitable
from typing import TypeVar

from fastapi import APIRouter, Request
from fastapi.responses import Response, StreamingResponse
from starlette.types import Receive, Scope, Send

from gateway.dependencies import SpeechServiceDep
from gateway.errors import ApiError, ClientGone
from gateway.schemas import SpeechRequest
from gateway.services.speech import SpeechStream

router = APIRouter()

T = TypeVar("T")


class SpeechStreamingResponse(StreamingResponse):
    """Closes the speech stream however the response ends (done, client gone, error), so the
    Triton request is cancelled and the in-flight slot returned even if the body never ran."""

    def __init__(self, stream: SpeechStream, headers: dict[str, str]) -> None:
        super().__init__(stream, media_type=stream.media_type, headers=headers)
        self._stream = stream

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        except ApiError:
            # Failed after the 200 went out (already logged by the service). Returning without the
            # final body message makes the server drop the connection, so the client sees a broken
            # transfer instead of a short file that looks complete.
            pass
        finally:
            await self._stream.aclose()


async def _disconnected(request: Request) -> None:
    """Returns when the client closes the connection (the body was read already: only
    ``http.disconnect`` can come)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def unless_disconnected(request: Request, work: Awaitable[T]) -> T:
    """``await work``, cancelled as soon as the client goes away (then ClientGone): a request whose
    answer nobody will read must not keep its in-flight slot and the pipeline busy."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, ApiError):
                await task
    if task.cancelled():
        raise ClientGone
    return task.result()


@router.post("/v1/audio/speech")
async def create_speech(body: SpeechRequest, request: Request, service: SpeechServiceDep) -> Response:
    request_id = request.headers.get("x-request-id") or f"req_{uuid.uuid4().hex}"
    request.state.response_format = body.response_format
    headers = {"x-request-id": request_id}
    # Covers a whole `stream: false` synthesis and the wait for a stream's first chunk.
    result = await unless_disconnected(request, service.create_speech(body, request_id))
    if isinstance(result, SpeechStream):
        return SpeechStreamingResponse(result, headers)
    return Response(result.content, media_type=result.media_type, headers=headers)
