"""Audio through the whole stack: OpenAI SDK -> gateway -> tritonserver -> stand-in model."""

from __future__ import annotations

import asyncio
import base64
import json
import wave
import io

import pytest

from tests.gateway.conftest import async_wait_for
from tests.gateway.audio_checks import decodable_seconds, decode, dominant_frequency, duration
from tests.gateway.standin_model.standin import frequency_for

pytestmark = pytest.mark.triton

FORMATS = ["mp3", "opus", "aac", "flac", "wav", "pcm"]
#: Encoder priming/padding a decoder may add (mp3: one frame, aac: 1024 samples + frame rounding).
PADDING_S = 0.12
SENTENCE = "The quick brown fox jumps over the lazy dog near the quiet river bank"


def tag_for(*parts: str) -> str:
    """A stand-in tag word (letters only, so normalization keeps it)."""
    word = "zq" + "".join(parts)
    return "".join(ch for ch in word.replace("3", "three").lower() if ch.isalpha())


def produced_seconds(standin_backend, tag: str) -> float:
    records = standin_backend.requests_tagged(tag)
    assert records and all(r["outcome"] == "done" for r in records), records
    return sum(r["samples"] for r in records) / 24_000


@pytest.mark.parametrize("response_format", FORMATS)
def test_create_returns_one_decodable_file_with_the_produced_duration(gateway, standin_backend, response_format):
    tag = tag_for("create", response_format)
    response = gateway.client().audio.speech.create(
        model="tts-1", voice="alloy", input=f"{tag} {SENTENCE}.", response_format=response_format
    )
    content_types = {
        "mp3": "audio/mpeg", "opus": "audio/opus", "aac": "audio/aac",
        "flac": "audio/flac", "wav": "audio/wav", "pcm": "audio/pcm",
    }  # fmt: skip
    assert response.response.headers["content-type"] == content_types[response_format]
    expected = produced_seconds(standin_backend, tag)
    assert expected > 1.0
    assert expected - 0.01 <= duration(response.content, response_format) <= expected + PADDING_S


@pytest.mark.parametrize("response_format", FORMATS)
async def test_streaming_response_delivers_audio_while_the_model_is_still_producing(
    gateway, standin_backend, response_format
):
    tag = tag_for("hold", response_format)
    client = gateway.async_client()
    received = b""
    async with client.audio.speech.with_streaming_response.create(
        model="gpt-4o-mini-tts", voice="nova", input=f"{tag} holdstream {SENTENCE}.", response_format=response_format
    ) as response:
        chunks = response.iter_bytes()

        async def read_until_audio() -> None:
            nonlocal received
            async for part in chunks:
                received += part
                if decodable_seconds(received, response_format) >= 0.2:
                    return
            raise AssertionError("stream ended before any audio")

        # The stand-in sent its first chunk and now holds the rest until released.
        await asyncio.wait_for(read_until_audio(), timeout=20)
        assert standin_backend.requests_tagged(tag) == []  # the model has not finished...
        holding = standin_backend.marker(tag, "holding")
        assert await async_wait_for(holding.exists, timeout=10)  # ...and cannot until released
        standin_backend.release(tag)
        async for part in chunks:
            received += part
    expected = produced_seconds(standin_backend, tag)
    assert expected - 0.01 <= duration(received, response_format) <= expected + PADDING_S


def test_streamed_wav_has_one_header_with_unknown_sizes(gateway):
    with gateway.client().audio.speech.with_streaming_response.create(
        model="tts-1", voice="alloy", input=SENTENCE, response_format="wav"
    ) as response:
        data = response.read()
    assert data[:4] == b"RIFF" and data[8:16] == b"WAVEfmt "
    assert data[4:8] == b"\xff\xff\xff\xff" and data[40:44] == b"\xff\xff\xff\xff"
    assert data.count(b"RIFF") == 1


def test_complete_file_mode_writes_exact_wav_sizes(gateway, standin_backend):
    tag = tag_for("complete")
    response = gateway.client().audio.speech.create(
        model="tts-1", voice="alloy", input=f"{tag} {SENTENCE}.", response_format="wav", extra_body={"stream": False}
    )
    with wave.open(io.BytesIO(response.content)) as wav:
        frames = wav.getnframes()
        assert (wav.getframerate(), wav.getnchannels(), wav.getsampwidth()) == (24_000, 1, 2)
    assert frames / 24_000 == pytest.approx(produced_seconds(standin_backend, tag), abs=1e-6)
    assert standin_backend.requests_tagged(tag)[0]["model"] == "cosyvoice2"  # the offline model
    assert int(response.response.headers["content-length"]) == len(response.content)
    assert response.response.headers["x-request-id"].startswith("req_")


def _sse_events(lines: list[str]) -> list[dict]:
    return [json.loads(line[len("data: "):]) for line in lines if line.startswith("data: ")]


@pytest.mark.parametrize("response_format", ["mp3", "wav"])
def test_sse_deltas_form_one_file_and_done_carries_the_model_usage(gateway, standin_backend, response_format):
    tag = tag_for("sse", response_format)
    with gateway.client().audio.speech.with_streaming_response.create(
        model="gpt-4o-mini-tts", voice="coral", input=f"{tag} {SENTENCE}.", response_format=response_format,
        stream_format="sse",
    ) as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        events = _sse_events(list(response.iter_lines()))
    assert [e["type"] for e in events[:-1]] == ["speech.audio.delta"] * (len(events) - 1)
    assert len(events) >= 3
    done = events[-1]
    assert done["type"] == "speech.audio.done"
    records = standin_backend.requests_tagged(tag)
    input_tokens = sum(r["input_tokens"] for r in records)
    output_tokens = sum(r["output_tokens"] for r in records)
    assert output_tokens > 0
    assert done["usage"] == {
        "input_tokens": input_tokens, "output_tokens": output_tokens, "total_tokens": input_tokens + output_tokens
    }
    audio = b"".join(base64.b64decode(e["audio"]) for e in events[:-1])
    expected = produced_seconds(standin_backend, tag)
    assert expected - 0.01 <= duration(audio, response_format) <= expected + PADDING_S


def test_sse_failure_after_the_first_event_becomes_an_error_event(gateway):
    with gateway.client().audio.speech.with_streaming_response.create(
        model="gpt-4o-mini-tts", voice="coral", input=f"failmid {SENTENCE}.", response_format="pcm",
        stream_format="sse",
    ) as response:
        assert response.status_code == 200
        events = _sse_events(list(response.iter_lines()))
    assert events[0]["type"] == "speech.audio.delta"
    assert events[-1]["type"] == "error"
    assert set(events[-1]["error"]) == {"message", "type", "param", "code"}
    assert events[-1]["error"]["code"] == "synthesis_failed"
    assert all(e["type"] != "speech.audio.done" for e in events)


def test_audio_failure_after_the_first_bytes_is_not_a_clean_end_of_file(gateway):
    import httpx  # noqa: PLC0415

    with gateway.http() as http, pytest.raises(httpx.HTTPError):
        with http.stream(
            "POST", "/v1/audio/speech",
            json={"model": "tts-1", "voice": "alloy", "input": f"failmid {SENTENCE}.", "response_format": "pcm"},
        ) as response:
            assert response.status_code == 200
            for _ in response.iter_bytes():
                pass


@pytest.mark.parametrize("speed", [2.0, 0.25, 4.0])
def test_speed_changes_duration_but_not_pitch(gateway, standin_backend, speed):
    tag = tag_for("speed", str(speed).replace(".", "p").replace("2", "two").replace("4", "four").replace("0", "o"))
    text = f"{tag} {SENTENCE} and back again."
    response = gateway.client().audio.speech.create(
        model="tts-1", voice="alloy", input=text, response_format="wav", speed=speed
    )
    produced = produced_seconds(standin_backend, tag)
    samples, rate = decode(response.content, "wav")
    assert samples.size / rate == pytest.approx(produced / speed, rel=0.10)
    segment_text = standin_backend.requests_tagged(tag)[0]["target_text"]
    assert dominant_frequency(samples, rate) == pytest.approx(frequency_for(segment_text), abs=8)


def test_long_input_is_spoken_as_ordered_segments_in_one_continuous_file(gateway, standin_backend):
    sentences = [
        f"zqlong sentence number {word} talks about a different subject than the ones before it, on purpose."
        for word in ("one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten",
                     "eleven", "twelve", "thirteen", "fourteen")
    ]  # fmt: skip
    response = gateway.client().audio.speech.create(
        model="tts-1", voice="echo", input=" ".join(sentences), response_format="flac"
    )
    records = standin_backend.requests_tagged("zqlong")
    assert len(records) >= 3
    spoken = " ".join(r["target_text"] for r in records)
    positions = [spoken.find(f"number {s.split()[3]} ") for s in sentences]
    assert -1 not in positions and positions == sorted(positions)
    samples, rate = decode(response.content, "flac")
    assert samples.size == sum(r["samples"] for r in records)
    start = 0
    for record in records:
        part = samples[start : start + record["samples"]]
        start += record["samples"]
        assert dominant_frequency(part, rate) == pytest.approx(frequency_for(record["target_text"]), abs=8)


async def test_concurrent_requests_each_get_their_own_audio(gateway, standin_backend):
    client = gateway.async_client()
    words = ["alpha", "bravo", "charlie", "delta", "echo", "foxtrot", "golf", "hotel"]
    texts = {tag_for("conc", w): f"{tag_for('conc', w)} {w} " * (3 + i) for i, w in enumerate(words)}
    responses = await asyncio.gather(
        *(client.audio.speech.create(model="tts-1", voice="alloy", input=t, response_format="wav") for t in texts.values())
    )
    for tag, response in zip(texts, responses, strict=True):
        samples, rate = decode(response.content, "wav")
        assert samples.size / rate == pytest.approx(produced_seconds(standin_backend, tag), abs=1e-6)
        segment_text = standin_backend.requests_tagged(tag)[0]["target_text"]
        assert dominant_frequency(samples, rate) == pytest.approx(frequency_for(segment_text), abs=8)
    assert await async_wait_for(lambda: gateway.metric("tts_in_flight_requests") == 0, timeout=30)
