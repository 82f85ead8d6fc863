"""Engine test fixtures: one tiny random CosyVoice2 model directory per session (official layout).

Other areas (Triton, build, benchmark) build theirs the same way: `cosyvoice2.testing.write_tiny_model(dir)`.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from cosyvoice2.testing import write_tiny_model

    return write_tiny_model(tmp_path_factory.mktemp("tiny_cosyvoice2"), seed=0)


@pytest.fixture(scope="session")
def tiny_engine(tiny_model_dir: Path):
    import cosyvoice2

    return cosyvoice2.load(tiny_model_dir)


def reference_wav(seconds: float, seed: int, sample_rate: int = 16000) -> np.ndarray:
    """A voiced-looking test signal: a gliding tone plus a little noise."""
    rng = np.random.default_rng(seed)
    t = np.arange(int(seconds * sample_rate)) / sample_rate
    tone = 0.3 * np.sin(2 * np.pi * (150 + 40 * seed) * t * (1 + 0.1 * t))
    return (tone + 0.03 * rng.standard_normal(t.size)).astype(np.float32)


@pytest.fixture(scope="session")
def tiny_prompt(tiny_engine):
    """3 s prompt: 75 speech tokens, already on the 25-token grid."""
    return tiny_engine.prepare_voice(reference_wav(3.0, seed=0), 16000, "Hello world.")


@pytest.fixture(scope="session")
def tiny_prompt_unaligned(tiny_engine):
    """1.6 s prompt at 24 kHz: 40 speech tokens, so the first hop carries a 10-token pad."""
    return tiny_engine.prepare_voice(reference_wav(1.6, seed=1, sample_rate=24000), 24000, "Hi there.")
