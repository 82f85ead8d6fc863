"""The engine profile tools run end to end on the tiny models (on the CPU: no kernels, each operator's CPU time)."""

from __future__ import annotations

import subprocess
import sys

import pytest


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


@pytest.mark.parametrize("extra", [[], ["--with-token2wav"]], ids=["llm", "beside-token2wav"])
def test_llm_step_paths_times_every_layer_of_the_served_path(extra):
    """One row per layer (bare decoder, on the worker's stream, under the scheduler), each with the measured steps of
    every request but the first (warm-up): 2 x 12 decoded tokens; also beside an idle token2wav service."""
    out = subprocess.run(
        [sys.executable, "-m", "enginebench.llm_step_paths", "--tiny", "--requests", "3", "--tokens", "12", *extra],
        capture_output=True, text=True, timeout=600, check=True,
    ).stdout
    rows = {line.split("|")[1].strip(): line.split("|")[2:] for line in out.splitlines() if line.startswith("| ")}
    for path in ("bare", "stream", "thread", "scheduler"):
        steps, p50 = int(rows[path][0]), float(rows[path][1])
        assert steps >= 2 * 12 and p50 > 0, (path, rows[path])


def test_llm_step_paths_loads_the_llm_as_the_served_engine_does(tmp_path):
    """`--model-dir`: the LLM from a model directory (here the tiny one), its stop ids disabled as in benchmark
    mode; every request still decodes its tokens."""
    from cosyvoice2.testing import write_tiny_model  # noqa: PLC0415 - the tiny writer only here

    model_dir = write_tiny_model(tmp_path / "tiny", seed=1)
    out = subprocess.run(
        [sys.executable, "-m", "enginebench.llm_step_paths", "--tiny", "--requests", "2", "--tokens", "10",
         "--model-dir", str(model_dir)],
        capture_output=True, text=True, timeout=600, check=True,
    ).stdout
    assert f"LLM loaded from {model_dir}" in out
    rows = {line.split("|")[1].strip(): line.split("|")[2:] for line in out.splitlines() if line.startswith("| ")}
    assert int(rows["scheduler"][0]) >= 10, rows


def test_the_token2wav_policy_model_compares_settings_under_the_same_arrivals():
    """A row per (rate, starving_calls), every setting offered the same streams; at a rate this low nothing
    stalls."""
    out = subprocess.run(
        [sys.executable, "-m", "enginebench.t2w_policy_sim", "--rates", "4", "--seconds", "10", "--seeds", "2",
         "--starving-calls", "1", "3", "--step-beside", "1.5"],
        capture_output=True, text=True, timeout=300, check=True,
    ).stdout
    rows = [line.split(" | ") for line in out.splitlines() if line.startswith("| 4 | ")]
    assert [row[1] for row in rows] == ["1", "3"]
    assert len({row[2] for row in rows}) == 1 and int(rows[0][2].split(" / ")[0]) > 20  # the same streams for all
    assert all(row[3] == "0 / 0" for row in rows)


def test_the_token2wav_policy_model_runs_closed_loop_clients_too():
    """Closed loop: each of 4 clients starts its next stream when its last one ends, so a 10 s run holds several
    streams per client, every one answered."""
    out = subprocess.run(
        [sys.executable, "-m", "enginebench.t2w_policy_sim", "--closed", "4", "--seconds", "10", "--seeds", "1",
         "--starving-calls", "1"],
        capture_output=True, text=True, timeout=300, check=True,
    ).stdout
    rows = [line.split(" | ") for line in out.splitlines() if line.startswith("| 4 | ")]
    assert len(rows) == 1 and rows[0][1] == "1" and int(rows[0][2]) > 2 * 4 and float(rows[0][6]) > 0


def test_the_token2wav_policy_model_runs_a_level_like_stack_bench():
    """`--ramp 0 --per-client 2`: every client starts at once and runs two streams, as a stack-bench level of 2
    requests per client, whatever `--seconds` says."""
    out = subprocess.run(
        [sys.executable, "-m", "enginebench.t2w_policy_sim", "--closed", "8", "--ramp", "0", "--per-client", "2",
         "--seconds", "1", "--seeds", "2", "--starving-calls", "3", "--max-rows", "4"],
        capture_output=True, text=True, timeout=300, check=True,
    ).stdout
    rows = [line.split(" | ") for line in out.splitlines() if line.startswith("| 8 | ")]
    assert len(rows) == 1 and rows[0][2] == "16 / 16", rows
