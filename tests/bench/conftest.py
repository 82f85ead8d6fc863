"""Shared helpers of the benchmark tests."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.bench.wavfiles import write_wav


@pytest.fixture
def voices_dir(tmp_path: Path) -> Path:
    """Two voices in the gateway's layout: <name>.wav + <name>.txt."""
    directory = tmp_path / "voices"
    directory.mkdir()
    write_wav(directory / "anna.wav", 1.0, freq=200.0)
    (directory / "anna.txt").write_text("Anna speaks.\n", encoding="utf-8")
    write_wav(directory / "bo.wav", 0.5, rate=16_000, channels=1, freq=300.0)
    (directory / "bo.txt").write_text("博说话。", encoding="utf-8")
    return directory
