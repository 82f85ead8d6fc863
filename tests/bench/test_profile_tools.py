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


def test_llm_step_paths_times_every_layer_of_the_served_path():
    """One row per layer (bare decoder, on the worker's stream, under the scheduler), each with the measured steps of
    every request but the first (warm-up): 2 x 12 decoded tokens."""
    out = subprocess.run(
        [sys.executable, "-m", "enginebench.llm_step_paths", "--tiny", "--requests", "3", "--tokens", "12"],
        capture_output=True, text=True, timeout=600, check=True,
    ).stdout
    rows = {line.split("|")[1].strip(): line.split("|")[2:] for line in out.splitlines() if line.startswith("| ")}
    for path in ("bare", "stream", "scheduler"):
        steps, p50 = int(rows[path][0]), float(rows[path][1])
        assert steps >= 2 * 12 and p50 > 0, (path, rows[path])
