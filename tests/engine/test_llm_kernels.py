"""Fused Triton kernels (speech_lm.kernels) against their PyTorch reference on the CPU, through Triton's
interpreter: the comparisons of tests/gpu/test_kernels.py (the GPU run) in a subprocess, because the interpreter must
be switched on before triton is first imported. bf16 is left to the GPU run (the interpreter truncates fp32 to
bf16 instead of rounding)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.gpu.test_kernels import compare

REPO_ROOT = Path(__file__).resolve().parents[2]
INTERPRETED = ("import dataclasses, json; from tests.gpu.test_kernels import interpreted_results; "
               "print(json.dumps([dataclasses.asdict(r) for r in interpreted_results()]))")


def test_interpreted_kernels_match_reference_alone_and_in_the_model() -> None:
    pytest.importorskip("triton")
    result = subprocess.run([sys.executable, "-c", INTERPRETED], capture_output=True, text=True,
                            env={**os.environ, "TRITON_INTERPRET": "1"}, cwd=REPO_ROOT, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    results = json.loads(result.stdout.splitlines()[-1])
    assert [r["name"] for r in results if not r["matches"]] == []
    # fp32, fp16: 2 shapes x 3 outputs (add_rms_norm's norm and sum, silu_mul) + the model + 7 copy_runs layouts + 6
    # row layouts; a UNet flow call in fp32 (its packed rows' gathers and scatters through the row kernels)
    assert len(results) == 2 * (2 * 3 + 1 + 7 + 6) + 1
    assert sum(r["name"].startswith("UNet flow call") for r in results) == 1
    assert sum(r["name"].startswith("LLM body") for r in results) == 2


def test_the_comparison_flags_a_difference_of_one_percent() -> None:
    expected = torch.linspace(-4, 4, 50)
    assert compare("same", expected.clone(), expected).matches
    assert not compare("off by 1%", expected * 1.01, expected).matches
    assert not compare("not exact", expected + 1e-6, expected, exact=True).matches
