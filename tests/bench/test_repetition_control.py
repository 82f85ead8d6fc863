"""The repetition-control measurement (benchmarks/enginebench/repetition_control.py): TensorRT-LLM's penalty semantics, and
a short run on the micro parity LLM."""

from __future__ import annotations

import pytest
import torch

from enginebench.repetition_control import apply_repetition_penalty, main
from tests.conftest import FIXTURES_DIR

MICRO = FIXTURES_DIR / "parity" / "micro"


def test_the_penalty_shrinks_seen_positive_logits_and_grows_seen_negative_ones():
    logits = torch.tensor([2.0, -2.0, 3.0, -1.0])
    out = apply_repetition_penalty(logits, torch.tensor([0, 1]), 2.0)
    assert out.tolist() == [1.0, -4.0, 3.0, -1.0]  # unseen ids untouched
    assert logits.tolist() == [2.0, -2.0, 3.0, -1.0]


@pytest.mark.skipif(not (MICRO / "llm.pt").exists(), reason="parity data absent")
def test_a_short_measurement_on_the_micro_llm():
    lines: list[str] = []
    results = main(["--model-dir", str(MICRO), "--runs", "2", "--text-tokens", "2", "--prompt-tokens", "8"], lines.append)
    assert set(results) == {"ras", "topk_topp", "penalty", "penalty+guard"} and len(lines) == 2 + 4
    assert results["ras"]["back_to_back"] == 0 and results["ras"]["longest_run"] == 1  # RAS never repeats at once
    for policy in results.values():
        assert 0 < policy["tokens_per_run"] <= 40
