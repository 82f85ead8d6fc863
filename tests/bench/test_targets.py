"""Per-piece audio durations of gateway responses, on streams made by the gateway's own encoders."""

import numpy as np
import pytest

from gateway.services.audio_encoding import create_encoder
from pipeline_contract import OUTPUT_SAMPLE_RATE
from ttsbench.targets import encoded_chunk_seconds, encoded_seconds

CHUNK_S = 0.2
CHUNKS = 10


def _streamed(response_format: str) -> list[bytes]:
    """The body pieces of one streamed response: what the encoder handed out after each pipeline chunk."""
    encoder = create_encoder(response_format, streaming=True)
    n = int(CHUNK_S * OUTPUT_SAMPLE_RATE)
    t = np.arange(CHUNKS * n) / OUTPUT_SAMPLE_RATE
    audio = (0.2 * np.sin(2 * np.pi * 220 * t)).astype(np.float32)
    pieces = [encoder.encode(audio[i * n : (i + 1) * n]) for i in range(CHUNKS)]
    pieces[-1] += encoder.finish()
    return pieces


def test_pcm_pieces_are_their_samples():
    pieces = [b"\0\0" * 2400, b"\0" * 3, b"\0\0" * 4800 + b"\0"]  # network reads may split a sample
    assert encoded_chunk_seconds(pieces, "pcm") == pytest.approx([0.1, 1.5 / 24_000, 0.2 + 0.5 / 24_000])
    assert encoded_chunk_seconds([], "pcm") == []


@pytest.mark.parametrize("response_format", ["mp3", "opus", "aac", "flac", "wav"])
def test_container_pieces_are_credited_as_they_become_playable(response_format):
    pieces = _streamed(response_format)
    seconds = encoded_chunk_seconds(pieces, response_format)
    assert len(seconds) == len(pieces)
    assert sum(seconds) == pytest.approx(encoded_seconds(b"".join(pieces), response_format))
    assert sum(seconds) == pytest.approx(CHUNKS * CHUNK_S, abs=0.1)  # codec padding at most
    # After each piece, the playable audio trails what was sent by at most the encoder's buffering.
    credited = np.cumsum(seconds)
    sent = CHUNK_S * np.arange(1, CHUNKS + 1)
    assert np.all(credited <= sent + 0.07), (credited, sent)
    assert np.all(credited[:-1] >= sent[:-1] - 0.15), (credited, sent)


def test_a_piece_that_completes_no_packet_carries_no_audio():
    pieces = _streamed("flac")
    whole = b"".join(pieces)
    split = [whole[:10], whole[10:]]  # 10 bytes: inside the stream header
    assert encoded_chunk_seconds(split, "flac") == pytest.approx([0.0, encoded_seconds(whole, "flac")])


async def test_triton_pieces_last_at_the_rate_the_responses_state():  # async: the target opens a gRPC client
    import pipeline_contract as contract
    from ttsbench.targets import TritonTarget

    target = TritonTarget("127.0.0.1:1", streaming=True, pipeline="spark-tts")
    assert target.model == contract.SPARK_STREAMING_MODEL and target.mode == "triton-spark-tts/streaming"
    pieces = [target._audio(contract.SpeechChunk(np.zeros(n, np.float32), 1, 1, False, sample_rate=16_000))
              for n in (0, 3200, 1600)]
    assert target.chunk_seconds(pieces[1:]) == pytest.approx([0.2, 0.1])  # 16 kHz, not CosyVoice2's 24 kHz
    with pytest.raises(contract.ContractViolation, match="24000 Hz after 16000 Hz"):
        target._audio(contract.SpeechChunk(np.zeros(10, np.float32), 1, 1, False, sample_rate=24_000))
    assert TritonTarget("127.0.0.1:1", streaming=False).model == contract.OFFLINE_MODEL
