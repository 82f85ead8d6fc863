"""Fused Triton kernels (cosyvoice2.kernels) against their PyTorch reference on the CPU, through Triton's
interpreter: `python -m scripts.gpu_kernel_check` (the same check the GPU run uses) in a subprocess, because the
interpreter must be switched on before triton is first imported. bf16 is left to the GPU run (the interpreter truncates fp32 to
bf16 instead of rounding)."""

from __future__ import annotations

import importlib
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO_ROOT = Path(__file__).resolve().parents[2]
SCRIPT = "scripts.gpu_kernel_check"


def test_interpreted_kernels_match_reference_alone_and_in_the_model() -> None:
    pytest.importorskip("triton")
    result = subprocess.run([sys.executable, "-m", SCRIPT, "--device", "cpu"], capture_output=True, text=True,
                            env={**os.environ, "TRITON_INTERPRET": "1"}, cwd=REPO_ROOT, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    lines = result.stdout.splitlines()
    # fp32, fp16: 2 shapes x 3 outputs (add_rms_norm's norm and sum, silu_mul) + the model
    assert sum(" ok" in line for line in lines) == 2 * (2 * 3 + 1)
    assert any(line.strip().startswith("LLM body") for line in lines)


def test_check_flags_a_difference_of_one_percent() -> None:
    script = importlib.import_module(SCRIPT)
    expected = torch.linspace(-4, 4, 50)
    assert not script.mismatch("same", expected.clone(), expected)
    assert script.mismatch("off by 1%", expected * 1.01, expected)
    assert script.mismatch("not exact", expected + 1e-6, expected, exact=True)
