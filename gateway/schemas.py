"""Request and response bodies of the OpenAI audio API (plus our documented extensions)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

ResponseFormat = Literal["mp3", "opus", "aac", "flac", "wav", "pcm"]
StreamFormat = Literal["audio", "sse"]

MAX_INPUT_CHARS = 4096


class VoiceRef(BaseModel):
    """OpenAI's custom-voice form of ``voice``: ``{"id": "voice_..."}``."""

    model_config = ConfigDict(extra="forbid")
    id: str = Field(min_length=1)


class SpeechRequest(BaseModel):
    """``POST /v1/audio/speech``. Unknown fields are ignored (clients send peer extensions through
    ``extra_body``), except ``sample_rate``, which the service checks because ignoring it would hand
    the client audio at a rate it did not ask for."""

    model_config = ConfigDict(extra="allow")

    model: str = Field(min_length=1)
    input: str = Field(min_length=1, max_length=MAX_INPUT_CHARS)
    voice: str | VoiceRef
    instructions: str | None = Field(None, max_length=MAX_INPUT_CHARS)
    response_format: ResponseFormat = "mp3"
    speed: float = Field(1.0, ge=0.25, le=4.0, allow_inf_nan=False)  # NaN compares false with both bounds
    stream_format: StreamFormat = "audio"
    # Extensions ---------------------------------------------------------------------------------
    seed: int | None = Field(None, ge=0, le=2**64 - 1, description="Sampling seed (reproducible output).")
    stream: bool | None = Field(
        None, description="Relay audio as it is produced (default from settings); false = one complete file."
    )
    captions: bool = Field(
        False, description="With stream_format=sse: a speech.caption event (text, start, end) per segment."
    )

    @property
    def voice_key(self) -> str:
        return self.voice.id if isinstance(self.voice, VoiceRef) else self.voice


class Usage(BaseModel):
    input_tokens: int
    output_tokens: int
    total_tokens: int


class VoiceInfo(BaseModel):
    id: str
    name: str


class VoiceList(BaseModel):
    voices: list[VoiceInfo]


class VoiceResource(BaseModel):
    """OpenAI's ``VoiceResource`` (the answer of ``POST /v1/audio/voices``)."""

    object: Literal["audio.voice"] = "audio.voice"
    id: str
    name: str
    created_at: int


class VoiceDeleted(BaseModel):
    id: str
    object: Literal["audio.voice.deleted"] = "audio.voice.deleted"
    deleted: bool = True


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class AudioModel(BaseModel):
    id: str
    name: str


class AudioModelList(BaseModel):
    """``GET /v1/audio/models``: the speech models in the shape Open WebUI fills its model menu from."""

    models: list[AudioModel]


class Caption(BaseModel):
    """One spoken segment and where it sits in the returned audio (seconds, after ``speed``)."""

    index: int
    text: str  # the segment as spoken: CosyVoice2's normalized text (e.g. numbers spelled out)
    start: float
    end: float


class CaptionedSpeech(BaseModel):
    """``POST /v1/audio/speech/captioned``: the complete audio file and its captions in one JSON body."""

    object: Literal["audio.speech.captioned"] = "audio.speech.captioned"
    audio: str  # base64 of the file in `response_format`
    response_format: ResponseFormat
    sample_rate: int
    duration: float  # seconds of audio; equals the last caption's end
    captions: list[Caption]
    usage: Usage
