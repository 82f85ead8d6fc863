"""Sentence captions: opt-in speech.caption SSE events and the captioned JSON route, through the real gateway.

The stand-in's segment waveforms have known lengths, so caption times can be checked against the audio
itself: every caption ends exactly where its segment's samples end, and the last one where the audio ends.
"""

from __future__ import annotations

import base64
import json

import numpy as np
import pytest

from tests.gateway.audio_checks import decode

pytestmark = pytest.mark.triton

RATE = 24_000
#: Three segments: each sentence (~260 bytes) is long enough that the segmenter keeps them apart and short
#: enough (under the 300-byte segment bound) that it does not split them.
_FILLER = " ".join(["and then the story continues with more and more words"] * 4)
TEXT = " ".join(
    f"zqcap{tag} this sentence about the number {word} {_FILLER}." for tag, word in (("a", "one"), ("b", "two"), ("c", "three"))
)


def sse_events(gateway, **body) -> list[dict]:
    payload = {"model": "tts-1", "voice": "alloy", "input": TEXT, "stream_format": "sse", **body}
    with gateway.http() as http:
        with http.stream("POST", "/v1/audio/speech", json=payload) as response:
            assert response.status_code == 200
            lines = [line for line in response.iter_lines() if line.startswith("data: ")]
    return [json.loads(line[len("data: "):]) for line in lines]


def segment_records(backend, tag_prefix: str) -> list[dict]:
    """The stand-in's records of the segments tagged with `tag_prefix`, in the order they were served."""
    return [r for r in backend.requests() if r["tag"] and r["tag"].startswith(tag_prefix)]


def test_sse_captions_follow_their_segment_audio_with_exact_times(gateway, standin_backend):
    events = sse_events(gateway, response_format="pcm", captions=True, input=TEXT.replace("zqcap", "zqsse"))
    captions = [e for e in events if e["type"] == "speech.caption"]
    records = segment_records(standin_backend, "zqsse")
    assert len(captions) == len(records) == 3
    assert [c["index"] for c in captions] == [0, 1, 2]
    assert [c["text"] for c in captions] == [r["target_text"].strip() for r in records]
    ends = np.cumsum([r["samples"] for r in records]) / RATE
    assert [c["end"] for c in captions] == pytest.approx(list(ends), abs=1e-9)
    assert [c["start"] for c in captions] == pytest.approx([0.0, *ends[:-1]], abs=1e-9)
    # each caption arrives once its segment's audio is out (pcm is relayed unbuffered) and before the next one's
    pcm_bytes = 0
    for event in events:
        if event["type"] == "speech.audio.delta":
            pcm_bytes += len(base64.b64decode(event["audio"]))
        elif event["type"] == "speech.caption":
            assert pcm_bytes == round(event["end"] * RATE) * 2
    assert pcm_bytes / 2 / RATE == pytest.approx(captions[-1]["end"], abs=1e-9)  # timings add up to the audio
    assert events[-1]["type"] == "speech.audio.done"


def test_without_the_opt_in_the_stream_is_openais(gateway):
    events = sse_events(gateway, input="zqnocaptions One short line.")
    assert {e["type"] for e in events} == {"speech.audio.delta", "speech.audio.done"}


def test_captioned_route_returns_the_file_and_captions_that_add_up_to_it(gateway, standin_backend):
    payload = {"model": "tts-1", "voice": "alloy", "input": TEXT, "response_format": "wav"}
    with gateway.http() as http:
        response = http.post("/v1/audio/speech/captioned", json=payload)
        assert response.status_code == 200, response.text
        body = response.json()
        fast = http.post("/v1/audio/speech/captioned", json={**payload, "speed": 2.0}).json()
    assert body["object"] == "audio.speech.captioned" and body["sample_rate"] == RATE
    samples, rate = decode(base64.b64decode(body["audio"]), "wav")
    assert rate == RATE and samples.size / RATE == pytest.approx(body["duration"], abs=1e-9)
    captions = body["captions"]
    records = segment_records(standin_backend, "zqcap")[:3]  # the first request's segments
    assert [c["text"] for c in captions] == [r["target_text"].strip() for r in records]
    assert captions[-1]["end"] == pytest.approx(body["duration"], abs=1e-9)
    assert all(a["end"] == b["start"] for a, b in zip(captions, captions[1:]))
    assert all(r["model"] == "cosyvoice2" for r in records)  # the offline model: one complete file
    assert body["usage"]["output_tokens"] > 0
    # with speed the times are on the sped-up timeline, and the audio really has that length
    assert [c["end"] for c in fast["captions"]] == pytest.approx([c["end"] / 2 for c in captions], abs=1e-9)
    fast_samples, _ = decode(base64.b64decode(fast["audio"]), "wav")
    assert fast_samples.size / RATE == pytest.approx(fast["duration"], rel=0.01)


def test_captioned_route_errors_are_openai_shaped(gateway):
    with gateway.http() as http:
        response = http.post("/v1/audio/speech/captioned", json={"model": "tts-1", "voice": "nobody", "input": "Hi."})
        assert response.status_code == 400 and response.json()["error"]["code"] == "voice_not_found"
        # the route ignores the streaming options (it always answers one JSON document)
        ok = http.post("/v1/audio/speech/captioned",
                       json={"model": "tts-1", "voice": "amy", "input": "Hi.", "stream_format": "sse", "captions": True})
        assert ok.status_code == 200 and len(ok.json()["captions"]) == 1


def test_captions_without_sse_are_refused_not_ignored(gateway):
    with gateway.http() as http:
        response = http.post("/v1/audio/speech", json={"model": "tts-1", "voice": "amy", "input": "Hi.", "captions": True})
    assert response.status_code == 400
    error = response.json()["error"]
    assert (error["param"], error["code"]) == ("captions", "unsupported_value") and "captioned" in error["message"]
