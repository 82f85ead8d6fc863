"""The engine profile tools run end to end on the tiny models (on the CPU: no kernels, each operator's CPU time)."""

from __future__ import annotations

import subprocess
import sys


def test_cosyvoice3_token2wav_profile_lists_calls_and_operators():
    out = subprocess.run(
        [sys.executable, "-m", "enginebench.cosyvoice3_token2wav", "--tiny", "--device", "cpu", "--dtype", "fp32",
         "--streams", "1", "--chunks", "0", "1", "--repeats", "1", "--top", "3"],
        capture_output=True, text=True, timeout=600, check=True,
    ).stdout
    assert "voice prompt cache" in out
    rows = [line for line in out.splitlines() if line.startswith(("chunk 0 ", "chunk 1 ")) and " x 1 " in line]
    assert len(rows) == 2
    for row in rows:
        assert float(row.split("|")[1]) > 0  # a wall time was measured
    assert out.count(" ms ") >= 2 * 3  # three operators under each call


def test_sm_share_says_it_needs_a_gpu():
    done = subprocess.run([sys.executable, "-m", "enginebench.sm_share", "--device", "cpu"], capture_output=True,
                          text=True, timeout=300)
    assert done.returncode != 0 and "needs a CUDA device" in done.stderr
