"""Prometheus metrics of one app instance (own registry, so several apps can live in one process)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram


class GatewayMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter(
            "tts_requests",
            "Speech requests by HTTP status and response format.",
            ["status", "format"],
            registry=self.registry,
        )
        self.stream_failures = Counter(
            "tts_stream_failures",
            "Speech responses that failed after the 200 was sent.",
            ["format"],
            registry=self.registry,
        )
        self.time_to_first_byte = Histogram(
            "tts_time_to_first_byte_seconds",
            "From request to the first audio chunk from the pipeline.",
            buckets=(0.025, 0.05, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1, 1.5, 2, 3, 5, 10),
            registry=self.registry,
        )
        self.real_time_factor = Histogram(
            "tts_real_time_factor",
            "Synthesis wall time divided by audio duration, per request.",
            buckets=(0.02, 0.05, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1, 1.5, 2, 5),
            registry=self.registry,
        )
        self.audio_seconds = Counter(
            "tts_audio_seconds", "Seconds of audio produced.", registry=self.registry
        )
        self.in_flight = Gauge("tts_in_flight_requests", "Speech requests in progress.", registry=self.registry)
        self.voice_uploads = Counter("tts_voice_uploads", "Voices uploaded and stored.", registry=self.registry)
        self.voice_upload_rejections = Counter(
            "tts_voice_upload_rejections",
            "Refused voice uploads by error code.",
            ["code"],
            registry=self.registry,
        )
        self.voice_warmups = Counter(
            "tts_voice_warmups",
            "Voice-prompt computations through Triton at upload, by outcome (ok, failed).",
            ["outcome"],
            registry=self.registry,
        )
        self.voice_deletions = Counter("tts_voice_deletions", "Uploaded voices deleted.", registry=self.registry)
        # How each request to Triton (one per segment, and each voice warm-up) carried its voice: by id alone,
        # with the reference audio, or with it again after the pipeline answered [unknown_voice].
        self.pipeline_requests = Counter(
            "tts_pipeline_requests",
            "Requests sent to Triton, by how the voice travelled (by_id, with_audio, resent_with_audio).",
            ["voice"],
            registry=self.registry,
        )
        self.pipeline_request_bytes = Counter(
            "tts_pipeline_request_bytes",
            "Tensor bytes of the requests sent to Triton, by how the voice travelled.",
            ["voice"],
            registry=self.registry,
        )
