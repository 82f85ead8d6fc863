"""The gateway's stateful resampler: chunked conversion equals whole-waveform conversion, exact lengths, and the
signal survives (a tone stays the same tone)."""

from __future__ import annotations

import numpy as np
import pytest

from gateway.services.resampling import StreamResampler


def _convert(chunks, source=16_000, target=24_000):
    resampler = StreamResampler(source, target)
    return np.concatenate([*(resampler.push(c) for c in chunks), resampler.finish()])


def _tone(seconds=1.0, rate=16_000, hz=440.0):
    return (0.5 * np.sin(2 * np.pi * hz * np.arange(int(seconds * rate)) / rate)).astype(np.float32)


def test_chunked_conversion_equals_the_whole_one_without_clicks():
    x = _tone(2.0) * np.linspace(0, 1, 32_000, dtype=np.float32)  # not periodic in the chunk sizes
    whole = _convert([x])
    assert whole.size == 48_000
    for cuts in ([333, 5000], list(range(1000, 32_000, 1600)), [1, 2, 3, 31_999]):
        chunks = np.split(x, cuts)
        np.testing.assert_allclose(_convert(chunks), whole, atol=1e-6)


def test_a_tone_keeps_its_pitch_and_level():
    out = _convert([_tone()])
    t = np.arange(out.size) / 24_000
    reference = 0.5 * np.sin(2 * np.pi * 440.0 * t)
    assert out.size == 24_000 and np.abs(out[200:-200] - reference[200:-200]).max() < 1e-3


def test_empty_chunks_and_bad_rates():
    resampler = StreamResampler(16_000, 24_000)
    assert resampler.push(np.zeros(0, np.float32)).size == 0
    with pytest.raises(ValueError):
        StreamResampler(0, 24_000)
