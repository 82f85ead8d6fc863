"""Encoder details that the end-to-end tests do not pin down."""

from __future__ import annotations

import math
import struct

import numpy as np
import pytest

from gateway.services.audio_encoding import atempo_stages, create_encoder, wav_header


@pytest.mark.parametrize("speed", [0.25, 0.3, 0.5, 1.0, 1.7, 2.0, 3.9, 4.0])
def test_atempo_stages_stay_in_range_and_multiply_to_the_speed(speed):
    stages = atempo_stages(speed)
    assert all(0.5 <= s <= 2.0 for s in stages)
    assert math.prod(stages) == pytest.approx(speed)


def test_wav_header_sizes():
    riff, riff_size, _, _, _, fmt, channels, rate, byte_rate, align, bits, _, data_size = struct.unpack(
        "<4sI4s4sIHHIIHH4sI", wav_header(480)
    )
    assert (riff, riff_size, data_size) == (b"RIFF", 36 + 480, 480)
    assert (fmt, channels, rate, byte_rate, align, bits) == (1, 1, 24_000, 48_000, 2, 16)
    assert struct.unpack("<I", wav_header(None)[4:8])[0] == 0xFFFFFFFF


def test_pcm_is_clipped_s16le():
    encoder = create_encoder("pcm", streaming=True)
    out = encoder.encode(np.array([0.0, 0.5, 1.5, -2.0], np.float32)) + encoder.finish()
    assert np.frombuffer(out, "<i2").tolist() == [0, 16384, 32767, -32767]
