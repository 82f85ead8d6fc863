"""Voices and models: the registry (no Triton needed) and the listing endpoints."""

from __future__ import annotations

import av
import numpy as np
import pytest

from gateway.errors import UnknownVoice
from gateway.services.voices import VoiceRegistry
from triton_repo.server import REPO_ROOT
from tests.gateway.conftest import IsolatedSettings


def write_audio(path, samples: np.ndarray, rate: int, codec: str, layout: str) -> None:
    with av.open(str(path), "w") as container:
        stream = container.add_stream(codec, rate=rate, layout=layout)
        frame = av.AudioFrame.from_ndarray(samples, format="s16p", layout=layout)
        frame.sample_rate = rate
        container.mux(stream.encode(frame))
        container.mux(stream.encode(None))


def test_any_format_is_converted_once_to_16k_mono(tmp_path):
    rate, seconds = 44_100, 1.5
    t = np.arange(int(rate * seconds)) / rate
    tone = (np.sin(2 * np.pi * 440 * t) * 16000).astype(np.int16)
    write_audio(tmp_path / "stereo.flac", np.stack([tone, tone]), rate, "flac", "stereo")
    (tmp_path / "stereo.txt").write_text("A stereo voice.\n")
    (tmp_path / "broken.wav").write_bytes(b"")  # not audio: skipped
    write_audio(tmp_path / "untold.wav", tone[None, :], rate, "pcm_s16le", "mono")  # no .txt: no transcript
    registry = VoiceRegistry.from_directory(tmp_path)
    voice, untold = registry.voices
    assert voice.name == "stereo" and voice.transcript == "A stereo voice."
    assert (untold.name, untold.transcript) == ("untold", "")
    assert voice.samples.dtype == np.float32 and voice.samples.ndim == 1
    assert voice.samples.size == pytest.approx(16_000 * seconds, abs=64)
    spectrum = np.abs(np.fft.rfft(voice.samples))
    assert np.fft.rfftfreq(voice.samples.size, 1 / 16_000)[spectrum.argmax()] == pytest.approx(440, abs=2)


def test_voice_id_is_a_content_hash_of_audio_and_transcript(tmp_path):
    t = np.arange(16_000) / 16_000
    tone = (np.sin(2 * np.pi * 300 * t) * 12000).astype(np.int16)[None, :]
    for name, text in (("a", "Same words."), ("b", "Same words."), ("c", "Other words.")):
        write_audio(tmp_path / f"{name}.wav", tone, 16_000, "pcm_s16le", "mono")
        (tmp_path / f"{name}.txt").write_text(text)
    registry = VoiceRegistry.from_directory(tmp_path, aliases={"alloy": "c"})
    ids = {v.name: v.id for v in registry.voices}
    assert ids["a"] == ids["b"] != ids["c"]
    assert registry.resolve("alloy").name == "c"
    assert registry.resolve(ids["c"]).name == "c"
    with pytest.raises(UnknownVoice):
        registry.resolve("d")


def test_shipped_voices_cover_every_openai_voice_name():
    registry = VoiceRegistry.from_directory(REPO_ROOT / "ref_audios", IsolatedSettings().voice_aliases)
    assert len(registry.voices) >= 3
    for voice in registry.voices:
        assert 3.0 <= voice.seconds <= 8.0
    for name in ("alloy", "ash", "ballad", "coral", "echo", "fable", "onyx", "nova", "sage", "shimmer", "verse"):
        assert registry.resolve(name) in registry.voices


@pytest.mark.triton
def test_voices_and_models_endpoints(gateway):
    client = gateway.client()
    voices = client.get("/audio/voices", cast_to=object)["voices"]
    assert sorted(v["name"] for v in voices) == ["amy", "ben", "clara", "dave"]
    assert all(v["id"].startswith("voice_") for v in voices)
    models = client.models.list()
    assert [m.id for m in models] == ["tts-1", "tts-1-hd", "gpt-4o-mini-tts", "cosyvoice2"]
    assert client.models.retrieve("tts-1-hd").owned_by
    with pytest.raises(Exception) as caught:
        client.models.retrieve("whisper-1")
    assert caught.value.status_code == 404 and caught.value.code == "model_not_found"
