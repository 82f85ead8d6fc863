from __future__ import annotations

import uuid

from fastapi import APIRouter, Request
from fastapi.responses import Response, StreamingResponse
from starlette.types import Receive, Scope, Send

from gateway.dependencies import SpeechServiceDep
from gateway.errors import ApiError
from gateway.schemas import SpeechRequest
from gateway.services.speech import SpeechStream

router = APIRouter()


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


@router.post("/v1/audio/speech")
async def create_speech(body: SpeechRequest, request: Request, service: SpeechServiceDep) -> Response:
    request_id = request.headers.get("x-request-id") or f"req_{uuid.uuid4().hex}"
    request.state.response_format = body.response_format
    headers = {"x-request-id": request_id}
    result = await service.create_speech(body, request_id)
    if isinstance(result, SpeechStream):
        return SpeechStreamingResponse(result, headers)
    return Response(result.content, media_type=result.media_type, headers=headers)
