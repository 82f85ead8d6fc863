"""OpenAI's `instructions` and voices without a transcript, through the real gateway and a real tritonserver:
what the pipeline receives decides CosyVoice2's mode (instruct, cross-lingual, zero-shot; docs/gateway.md)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from tests.gateway.test_gateway_catalog import write_audio
from tests.gateway.voice_clips import make_clip, upload

pytestmark = pytest.mark.triton

#: Long enough for two segments; every sentence carries the stand-in's tag so each segment's request is found.
TWO_SEGMENTS = " ".join(
    f"zqinstructed sentence number {word} keeps going on for quite a while, with many words in it."
    for word in ("one", "two", "three", "four")
)


@pytest.fixture(scope="module")
def modes_gateway(standin_backend, gateway_factory, tmp_path_factory):
    """Shipped voices: `told` with a transcript, `untold` without a .txt next to it."""
    voices = tmp_path_factory.mktemp("voices")
    t = np.arange(3 * 16_000) / 16_000
    tone = (np.sin(2 * np.pi * 220 * t) * 12000).astype(np.int16)[None, :]
    for name in ("told", "untold"):
        write_audio(voices / f"{name}.wav", tone, 16_000, "pcm_s16le", "mono")
    (voices / "told.txt").write_text("The words of the told voice.")
    return gateway_factory(standin_backend.server.grpc_url, voices_dir=voices, voice_aliases={"alloy": "told"})


def test_instructions_reach_every_segment_request(modes_gateway, standin_backend):
    client = modes_gateway.client()
    audio = client.audio.speech.create(
        model="gpt-4o-mini-tts", voice="alloy", input=TWO_SEGMENTS,
        instructions="  Speak like a cheerful pirate.  ", response_format="wav",
    )  # fmt: skip
    assert audio.content[:4] == b"RIFF"
    records = standin_backend.requests_tagged("zqinstructed")
    assert len(records) == 2  # one per segment, each with the same instruction
    assert [r["instruction_text"] for r in records] == ["Speak like a cheerful pirate."] * 2
    assert {r["reference_text"] for r in records} == {"The words of the told voice."}  # the voice's timbre
    # usage counts what the LLM read in instruct mode: the instruction instead of the transcript
    assert [r["input_tokens"] for r in records] == [len(r["target_text"].split()) + 5 for r in records]


@pytest.mark.parametrize("instructions", [None, "", "   "])
def test_no_or_blank_instructions_send_no_instruction(modes_gateway, standin_backend, instructions):
    tag = f"zqplain{'abc'[[None, '', '   '].index(instructions)]}"
    extra = {} if instructions is None else {"instructions": instructions}
    modes_gateway.client().audio.speech.create(model="tts-1", voice="told", input=f"{tag} Hello.", **extra)
    [record] = standin_backend.requests_tagged(tag)
    assert record["instruction_text"] is None and record["reference_text"] == "The words of the told voice."


def test_a_shipped_voice_without_transcript_is_listed_and_spoken_cross_lingually(modes_gateway, standin_backend):
    with modes_gateway.http() as http:
        names = {v["name"] for v in http.get("/v1/audio/voices").json()["voices"]}
    assert {"told", "untold"} <= names
    modes_gateway.client().audio.speech.create(model="tts-1", voice="untold", input="zquntold Hello there.")
    [record] = standin_backend.requests_tagged("zquntold")
    assert record["reference_text"] == "" and record["reference_wav_len"] == 3 * 16_000


def test_an_upload_without_transcript_is_accepted_and_spoken_cross_lingually(modes_gateway, standin_backend):
    with modes_gateway.http() as http:
        response = upload(http, name="no words", audio=make_clip("flac", 2.0), transcript=None)
        assert response.status_code == 200, response.text
        voice_id = response.json()["id"]
        # the same clip with a transcript is another voice (zero-shot), not a duplicate
        told = upload(http, name="with words", audio=make_clip("flac", 2.0), transcript="Some words.")
        assert told.status_code == 200 and told.json()["id"] != voice_id
    metadata = json.loads((modes_gateway.settings.uploaded_voices_dir / f"{voice_id}.json").read_text())
    assert metadata["transcript"] == ""
    warmups = [r for r in standin_backend.requests() if r["voice_id"] == voice_id and r["outcome"] == "prepared"]
    assert len(warmups) == 1 and warmups[0]["reference_text"] == ""
    modes_gateway.client().audio.speech.create(model="tts-1", voice="no words", input="zqnowords Hi.")
    [record] = standin_backend.requests_tagged("zqnowords")
    assert record["voice_id"] == voice_id and record["reference_text"] == "" and record["voice_cached"] is True
