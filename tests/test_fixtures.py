"""The parity oracles are part of the repository: the tests that use them skip only when a directory is absent,
so this test makes a missing or truncated copy an error instead of a silent skip."""

from __future__ import annotations

import json

import numpy as np
import pytest

from tests.conftest import FIXTURES_DIR

#: Each oracle: its micro model's files the parity tests load, besides README.md, harness_config.json and the dump.
ORACLES = {
    "parity": ["llm.pt", "flow.pt", "hift.pt"],
    "parity_cv3": ["llm.pt", "flow.pt", "hift.pt", "cosyvoice3.yaml"],
    "parity_dit": ["flow.pt", "flow.yaml", "hift.pt"],
    "parity_spark": ["config.yaml", "BiCodec", "LLM", "wav2vec2-large-xlsr-53"],
}


@pytest.mark.parametrize("name", sorted(ORACLES))
def test_oracle_is_complete(name: str) -> None:
    oracle = FIXTURES_DIR / name
    assert (oracle / "README.md").is_file()
    micro = oracle / "micro"
    assert json.loads((micro / "harness_config.json").read_text())
    for entry in ORACLES[name]:
        assert (micro / entry).exists(), micro / entry
    with np.load(oracle / "micro_dump_seed1234.npz") as arrays:
        assert len(arrays.files) > 10 and all(arrays[key].size for key in arrays.files[:3])
