"""The one settings object of the gateway (environment variables with the ``TTS_`` prefix)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Annotated, Literal

from pydantic import Field, SecretStr, field_validator, model_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

import pipeline_contract as contract
from gateway.demo import DEMO_MODEL_ID

#: The voices shipped with the project (`ref_audios/` at the repository root); also tts-bench's default.
SHIPPED_VOICES_DIR = Path(__file__).resolve().parent.parent / "ref_audios"

#: OpenAI's voice names; each maps to one of the shipped reference voices unless configured.
OPENAI_VOICE_NAMES = (
    "alloy", "ash", "ballad", "coral", "echo", "fable", "onyx",
    "nova", "sage", "shimmer", "verse", "marin", "cedar",
)  # fmt: skip
_DEFAULT_VOICE_ALIASES = {
    "alloy": "amy", "ash": "ben", "ballad": "ben", "coral": "clara", "echo": "ben", "fable": "clara",
    "onyx": "dave", "nova": "amy", "sage": "clara", "shimmer": "amy", "verse": "dave", "marin": "clara",
    "cedar": "dave",
}  # fmt: skip

CommaList = Annotated[list[str], NoDecode]


def default_uploaded_voices_dir() -> Path:
    """``$XDG_DATA_HOME/cosyvoice-serve/voices``: user data lives outside the source tree."""
    data_home = os.environ.get("XDG_DATA_HOME") or Path.home() / ".local" / "share"
    return Path(data_home) / "cosyvoice-serve" / "voices"


class Settings(BaseSettings):
    """Every knob of the gateway. Lists accept JSON or comma-separated values in the environment."""

    model_config = SettingsConfigDict(env_prefix="TTS_", env_file=".env", extra="ignore")

    host: str = Field("127.0.0.1", description="Address the HTTP server binds to.")
    port: int = Field(8080, ge=0, le=65535, description="HTTP port of the gateway.")
    log_level: Literal["debug", "info", "warning", "error"] = "info"

    triton_url: str = Field(
        "127.0.0.1:8001",
        description="Triton gRPC endpoint: host:port, or several replicas (ipv4:host:port,host:port; "
        "dns:///name:port, e.g. a Kubernetes headless Service).",
    )
    triton_balance: Literal["round-robin", "least-busy"] = Field(
        "round-robin",
        description="How requests spread over several Triton replicas: gRPC's round robin, or least-busy: each "
        "request to the replica with the fewest of this gateway's requests in flight (a dns:/// name is resolved "
        "again every 10 s; an unreachable replica sits out 2 s).",
    )
    offline_model: str = Field(contract.OFFLINE_MODEL, description="Triton model for whole-segment requests.")
    streaming_model: str = Field(contract.STREAMING_MODEL, description="Decoupled Triton model for streaming.")
    served_models: CommaList = Field(
        default_factory=lambda: ["tts-1", "tts-1-hd", "gpt-4o-mini-tts", "cosyvoice2"],
        description="Model ids accepted in `model` and listed by /v1/models (all run the same pipeline).",
    )
    spark_models: CommaList = Field(
        default_factory=lambda: ["spark-tts"],
        description="Model ids that run Spark-TTS; accepted and listed by /v1/models while Triton has it loaded.",
    )
    spark_offline_model: str = Field(contract.SPARK_OFFLINE_MODEL, description="Spark-TTS whole-segment model.")
    spark_streaming_model: str = Field(contract.SPARK_STREAMING_MODEL, description="Spark-TTS streaming model.")
    cosyvoice3_models: CommaList = Field(
        default_factory=lambda: ["cosyvoice3"],
        description="Model ids that run CosyVoice3; accepted and listed by /v1/models while Triton has it loaded.",
    )
    cosyvoice3_offline_model: str = Field(
        contract.COSYVOICE3_OFFLINE_MODEL, description="CosyVoice3 whole-segment model."
    )
    cosyvoice3_streaming_model: str = Field(
        contract.COSYVOICE3_STREAMING_MODEL, description="CosyVoice3 streaming model."
    )

    known_voices_per_model: int = Field(
        1024,
        ge=0,
        description="Voices remembered per Triton model pair as sent to it with their audio: their later requests "
        "carry only the voice id (docs/pipeline-contract.md#voices-by-id). 0: every request carries the audio.",
    )

    voices_dir: Path = Field(SHIPPED_VOICES_DIR, description="Reference voices: <name>.<audio> + <name>.txt.")
    voice_aliases: dict[str, str] = Field(
        default_factory=lambda: dict(_DEFAULT_VOICE_ALIASES),
        description="OpenAI voice name -> reference voice name (JSON object).",
    )
    uploaded_voices_dir: Path = Field(
        default_factory=default_uploaded_voices_dir, description="Where voices uploaded through the API are kept."
    )
    max_voice_upload_bytes: int = Field(10 * 2**20, ge=1024, description="Largest accepted voice upload file.")
    voice_warmup_timeout_s: float = Field(
        30.0, gt=0, description="Deadline of the voice-prompt computation through Triton at upload."
    )

    api_keys: Annotated[list[SecretStr], NoDecode] = Field(default_factory=list, description="Accepted Bearer keys; empty = no auth.")
    max_in_flight: int = Field(16, ge=1, description="Concurrent speech requests; more get 429.")
    retry_after_s: int = Field(1, ge=1, description="Retry-After seconds sent with 429 and 503.")
    request_timeout_s: float = Field(300.0, gt=0, description="Deadline of one Triton request (one segment).")
    ready_timeout_s: float = Field(2.0, gt=0, description="Deadline of the Triton checks behind /ready.")
    max_request_bytes: int = Field(
        1 * 2**20,
        ge=64 * 1024,
        description="Largest request body on /v1/* (voice uploads have their own limit); larger ones get 413.",
    )
    max_segment_tokens: int = Field(
        contract.MAX_SEGMENT_TOKENS,
        ge=16,
        description="Pipeline's target-text token limit per segment; text is cut so every segment fits.",
    )
    drain_grace_s: float = Field(
        30.0, ge=0, description="On SIGTERM: how long requests in flight may finish (new ones get 503) before exit."
    )
    stream_by_default: bool = Field(
        True, description="Default of the `stream` extension: relay audio as it is produced (streaming model)."
    )

    demo: bool = Field(
        False,
        description="Demo mode (`make demo`: the pipeline runs random weights): label every response "
        "(X-Demo-Model header), list the demo model id first, print a banner.",
    )

    @model_validator(mode="after")
    def _list_the_demo_model(self) -> Settings:
        # The demo id leads every model list, so a client's model menu says what it is talking to.
        if self.demo and DEMO_MODEL_ID not in self.served_models:
            self.served_models = [DEMO_MODEL_ID, *self.served_models]
        return self

    @field_validator("served_models", "spark_models", "cosyvoice3_models", "api_keys", mode="before")
    @classmethod
    def _split_comma_list(cls, value: object) -> object:
        if isinstance(value, str):
            value = value.strip()
            if value.startswith("["):
                return json.loads(value)
            return [item.strip() for item in value.split(",") if item.strip()]
        return value
