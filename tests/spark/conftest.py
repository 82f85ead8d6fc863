"""Spark-TTS engine fixtures: the shared micro model (released layout, random weights) and the upstream
runtime's outputs for it (``parity_spark``; its README gives the inputs and tolerances quoted in docs/spark.md)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.conftest import FIXTURES_DIR

PARITY_DIR = FIXTURES_DIR / "parity_spark"
MICRO_DIR = PARITY_DIR / "micro"
DUMP_FILE = PARITY_DIR / "micro_dump_seed1234.npz"

needs_parity_data = pytest.mark.skipif(not DUMP_FILE.exists(), reason="parity data absent")


def max_abs(a, b) -> float:
    a = np.asarray(a.detach().cpu() if isinstance(a, torch.Tensor) else a, dtype=np.float64)
    b = np.asarray(b.detach().cpu() if isinstance(b, torch.Tensor) else b, dtype=np.float64)
    assert a.shape == b.shape, (a.shape, b.shape)
    return float(np.abs(a - b).max())


@pytest.fixture(scope="session")
def dump() -> dict[str, np.ndarray]:
    with np.load(DUMP_FILE) as arrays:
        return {k: arrays[k] for k in arrays.files}


@pytest.fixture(scope="session")
def engine():
    from spark_tts.engine import SparkTTS

    torch.set_grad_enabled(False)
    return SparkTTS.load(MICRO_DIR)


@pytest.fixture(scope="session")
def reference(dump) -> np.ndarray:
    """The request's valid reference samples (the buffer's tail is filler the runtime must drop)."""
    return dump["in_reference_wav"][0, : int(dump["in_reference_wav_len"][0, 0])]
