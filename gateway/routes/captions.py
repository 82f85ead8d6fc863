"""``POST /v1/audio/speech/captioned``: speech plus per-segment captions in one JSON answer.

A separate route, so ``/v1/audio/speech`` keeps OpenAI's exact answer for every client; streaming
captions are the opt-in ``captions`` field with ``stream_format=sse`` (docs/gateway.md#captions).
"""

from __future__ import annotations

import uuid

from fastapi import APIRouter, Request, Response

from gateway.dependencies import SpeechServiceDep
from gateway.schemas import CaptionedSpeech, SpeechRequest

router = APIRouter()


@router.post("/v1/audio/speech/captioned")
async def create_captioned_speech(
    body: SpeechRequest, request: Request, response: Response, service: SpeechServiceDep
) -> CaptionedSpeech:
    request_id = request.headers.get("x-request-id") or f"req_{uuid.uuid4().hex}"
    response.headers["x-request-id"] = request_id
    return await service.create_captioned(body, request_id)
