from __future__ import annotations

from fastapi import APIRouter, Request
from starlette.datastructures import FormData, UploadFile

from gateway.dependencies import SettingsDep, VoiceLibraryDep
from gateway.errors import InvalidRequest
from gateway.multipart import read_multipart
from gateway.schemas import VoiceDeleted, VoiceInfo, VoiceList, VoiceResource
from gateway.services.voice_library import AUDIO_PARAM, VoiceUpload
from gateway.services.voices import Voice

router = APIRouter()

#: Room for the text fields and the multipart framing around the audio file.
FORM_OVERHEAD_BYTES = 64 * 1024

_UPLOAD_FORM = {
    "requestBody": {
        "required": True,
        "content": {
            "multipart/form-data": {
                "schema": {
                    "type": "object",
                    "required": ["name", "audio_sample"],
                    "properties": {
                        "name": {"type": "string", "maxLength": 64},
                        "audio_sample": {"type": "string", "format": "binary"},
                        "transcript": {
                            "type": "string",
                            "description": "Exact words spoken (alias: ref_text); optional, closer cloning.",
                        },
                        "consent": {"type": "string", "description": "OpenAI consent id; stored, not verified."},
                    },
                }
            }
        },
    }
}


def _resource(voice: Voice) -> VoiceResource:
    return VoiceResource(id=voice.id, name=voice.name, created_at=voice.created_at)


def _text(form: FormData, field: str) -> str | None:
    value = form.get(field)
    if isinstance(value, UploadFile):
        raise InvalidRequest(f"'{field}' must be a text field, not a file.", param=field, code="invalid_type")
    return value


def _upload(form: FormData) -> VoiceUpload:
    transcript, ref_text = _text(form, "transcript"), _text(form, "ref_text")
    if transcript and ref_text and transcript.strip() != ref_text.strip():
        raise InvalidRequest("'ref_text' is an alias of 'transcript'; send one of them.", param="ref_text")
    audio = form.get(AUDIO_PARAM)
    if audio is not None and not isinstance(audio, UploadFile):
        raise InvalidRequest(f"'{AUDIO_PARAM}' must be a file.", param=AUDIO_PARAM, code="invalid_type")
    return VoiceUpload(
        name=_text(form, "name"),
        transcript=transcript or ref_text,
        consent=_text(form, "consent"),
        audio=None if audio is None else audio.file,
        audio_bytes=0 if audio is None else audio.size or 0,
    )


@router.post("/v1/audio/voices", openapi_extra=_UPLOAD_FORM)
async def create_voice(request: Request, settings: SettingsDep, library: VoiceLibraryDep) -> VoiceResource:
    """OpenAI's voice upload (multipart: ``name``, ``audio_sample``, ``transcript``/``ref_text``, ``consent``)."""
    with library.counting_rejections():
        form = await read_multipart(
            request, max_body_bytes=settings.max_voice_upload_bytes + FORM_OVERHEAD_BYTES, file_param=AUDIO_PARAM
        )
        try:
            voice = await library.create(_upload(form))
        finally:
            await form.close()
    return _resource(voice)


@router.get("/v1/audio/voices")
async def list_voices(library: VoiceLibraryDep) -> VoiceList:
    """The Kokoro/Open WebUI listing shape: ``{"voices": [{"id", "name"}]}`` (shipped, then uploaded)."""
    return VoiceList(voices=[VoiceInfo(id=v.id, name=v.name) for v in library.voices])


@router.get("/v1/audio/voices/{voice_id}")
async def get_voice(voice_id: str, library: VoiceLibraryDep) -> VoiceResource:
    return _resource(library.get(voice_id))


@router.delete("/v1/audio/voices/{voice_id}")
async def delete_voice(voice_id: str, library: VoiceLibraryDep) -> VoiceDeleted:
    """Uploaded voices only (shipped ones: 403 ``voice_not_deletable``)."""
    return VoiceDeleted(id=(await library.delete(voice_id)).id)
