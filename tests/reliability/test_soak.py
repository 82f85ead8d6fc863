"""CI-sized soak against the local stack on the tiny model: concurrent streams, none lost or truncated,
nothing left in flight, memory growth bounded. The long run: `python -m tests.reliability.soak --minutes N`; its
--full-size path (the rendered stack stack-bench starts, on a GPU) runs here on the tiny model."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time

import pytest

from tests.reliability.soak import MIB, STOP_RESERVE_S, STRAGGLER_S, fit_run, memory_summary, missing_samples, soak
from tests.reliability.soak import main as soak_main
from triton_repo.server import REPO_ROOT, free_port

#: The first test here starts the shared stack (up to START_TIMEOUT_S) before its own work.
pytestmark = [pytest.mark.triton, pytest.mark.timeout(1200)]

CONCURRENCY = 6
REQUESTS = 24
#: Generous bounds: a leak of per-request state (audio buffers, gRPC streams) grows far beyond them.
GATEWAY_GROWTH_BYTES = 64 * 2**20
TRITON_GROWTH_BYTES = 256 * 2**20


def test_concurrent_streams_are_all_whole_and_leave_nothing_behind(tiny_stack):
    asyncio.run(soak(tiny_stack.url, concurrency=CONCURRENCY, requests=CONCURRENCY))  # warm every code path
    gateway_before, triton_before = tiny_stack.gateway_rss(), tiny_stack.triton_rss()
    report = asyncio.run(soak(tiny_stack.url, concurrency=CONCURRENCY, requests=REQUESTS, seed=1))
    print(f"soak: {report}")
    assert report.requests == REQUESTS and report.refused_429 == 0
    assert (report.lost, report.truncated) == (0, 0), report.failures
    assert report.ok == REQUESTS and report.audio_seconds > 0
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and (
        tiny_stack.gateway_metric("tts_in_flight_requests") or tiny_stack.triton_active_requests()
    ):
        time.sleep(0.2)
    assert tiny_stack.gateway_metric("tts_in_flight_requests") == 0
    assert tiny_stack.triton_active_requests() == 0
    gateway_growth = tiny_stack.gateway_rss() - gateway_before
    triton_growth = tiny_stack.triton_rss() - triton_before
    print(f"memory growth: gateway {gateway_growth / 2**20:.1f} MiB, triton {triton_growth / 2**20:.1f} MiB")
    assert gateway_growth < GATEWAY_GROWTH_BYTES and triton_growth < TRITON_GROWTH_BYTES


# The --full-size path (the stack stack-bench starts), on the tiny model instead of released-size weights.

SAMPLE_KEYS = ("gateway_rss", "triton_rss")


def _sample(phase: str, gateway: int = 100 * MIB, triton: int = 900 * MIB, processes: int = 3,
            gpu: list[int] | None = None) -> dict:  # fmt: skip
    return {"phase": phase, "t_s": 0.0, "requests": 0, "gateway_rss": gateway, "triton_rss": triton,
            "triton_processes": processes, "gpu_used": gpu}  # fmt: skip


def test_missing_memory_samples_are_named():
    whole = [_sample("started"), _sample("warm"), _sample("slice"), _sample("end")]
    assert missing_samples(whole, gpu_expected=False) == []
    assert missing_samples(whole, gpu_expected=True) == [f"{p} sample at 0.0 s: no GPU memory reading"
                                                         for p in ("started", "warm", "slice", "end")]  # fmt: skip
    no_gateway = [*whole[:2], _sample("slice", gateway=0), whole[3]]
    assert missing_samples(no_gateway, gpu_expected=False) == [
        "slice sample at 0.0 s: no gateway RSS (process not found)"
    ]
    no_triton = [*whole[:3], _sample("end", triton=0, processes=0)]
    assert missing_samples(no_triton, gpu_expected=False) == [
        "end sample at 0.0 s: no tritonserver RSS (process not found)"
    ]
    stub_gone = [*whole[:2], _sample("slice", processes=2), whole[3]]
    assert "a python stub is missing" in missing_samples(stub_gone, gpu_expected=False)[0]
    assert "memory samples after warm-up" in missing_samples(whole[:2], gpu_expected=False)[0]


def test_memory_summary_measures_growth_from_the_warm_sample():
    samples = [
        _sample("started", gateway=50 * MIB),
        _sample("warm", gateway=100 * MIB, gpu=[MIB, 3 * MIB]),
        _sample("slice", gateway=130 * MIB, gpu=[MIB, 5 * MIB]),
        _sample("end", gateway=120 * MIB, gpu=[MIB, 4 * MIB]),
    ]
    summary = memory_summary(samples)
    expected = {"after_start_up": 50.0, "start": 100.0, "end": 120.0, "max": 130.0, "growth": 20.0}
    assert summary["gateway_rss"] == expected
    assert summary["gpu_used"] == {"after_start_up": None, "start": 4.0, "end": 5.0, "max": 6.0, "growth": 1.0}
    assert memory_summary([_sample("warm"), _sample("end")])["gpu_used"] is None


def test_a_wall_budget_shortens_the_run_to_what_fits():
    tail = STOP_RESERVE_S + STRAGGLER_S
    assert fit_run(600.0, None, 100.0) == (600.0, False)
    assert fit_run(300.0, 100.0 + 590.0, 100.0) == (300.0, False)  # 590 s left: a 300 s run and its tail fit
    assert fit_run(600.0, 100.0 + 590.0, 100.0) == (590.0 - tail, True)
    assert fit_run(600.0, 100.0 + 10.0, 100.0) == (0.0, True)


def test_a_lost_response_makes_the_soak_fail():
    # Nothing listens there: every request is lost, and the exit status says so.
    assert soak_main(["--url", f"http://127.0.0.1:{free_port()}", "--minutes", "0.005", "--concurrency", "1"]) == 1


def test_full_size_options_need_full_size():
    with pytest.raises(SystemExit):
        soak_main(["--device", "cuda"])
    with pytest.raises(SystemExit):
        soak_main(["--full-size", "--url", "http://127.0.0.1:1"])


def test_the_full_size_path_soaks_the_rendered_stack_and_samples_every_process(tmp_path):
    from cosyvoice2.testing import write_tiny_model

    model = write_tiny_model(tmp_path / "tiny")
    report_path = tmp_path / "report.json"
    command = [sys.executable, "-m", "tests.reliability.soak", "--full-size", "--model-dir", str(model),
               "--device", "cpu", "--dtype", "fp32", "--max-batch", "4", "--benchmark-speech-ratio", "2",
               "--concurrency", "3", "--minutes", "0.4", "--slice-s", "6", "--wall-budget", "500",
               "--work", str(tmp_path / "work"), "--report", str(report_path)]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, timeout=560, cwd=REPO_ROOT)  # noqa: S603
    print(done.stdout[-3000:])
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    figures = json.loads(report_path.read_text())
    assert figures["problems"] == []
    totals = figures["totals"]
    assert totals["requests"] > 6 and totals["ok"] == totals["requests"]
    assert (totals["lost"], totals["truncated"], totals["unfinished"], totals["refused_429"]) == (0, 0, 0, 0)
    assert figures["gateway_in_flight_after"] == 0 and figures["pipeline_active_after"] == 0
    # Every process is in every sample: start-up, after warm-up, each slice, the end.
    samples = figures["samples"]
    phases = [s["phase"] for s in samples]
    assert phases[:2] == ["started", "warm"] and phases[-1] == "end" and phases.count("slice") >= 2
    assert missing_samples(samples, gpu_expected=False) == []
    assert all(s["gateway_rss"] > 10 * MIB and s["triton_rss"] > 100 * MIB for s in samples)
    assert all(s["triton_processes"] >= 2 and s["gpu_used"] is None for s in samples)  # tritonserver + stubs; CPU
    memory = figures["memory"]
    for key in SAMPLE_KEYS:
        assert memory[key]["start"] == round(samples[1][key] / MIB, 1)
        assert memory[key]["end"] == round(samples[-1][key] / MIB, 1)
    assert memory["gpu_used"] is None and figures["gpu_source"] is None
    # Start-up is its own figure, and the budget left the asked run whole.
    timings = figures["timings"]
    assert 0 < timings["triton_ready_s"] < timings["startup_s"] < timings["total_s"] < 500
    assert not figures["shortened"] and figures["measured_s"] >= 24
    assert f"start-up {timings['startup_s']:.1f} s" in done.stdout
    assert "| tritonserver RSS (with stubs) |" in done.stdout and "verdict: PASS" in done.stdout


def test_a_stack_that_does_not_start_fails_the_soak_with_a_report(tmp_path):
    empty = tmp_path / "no-weights"
    empty.mkdir()
    report_path = tmp_path / "report.json"
    command = [sys.executable, "-m", "tests.reliability.soak", "--full-size", "--model-dir", str(empty),
               "--device", "cpu", "--dtype", "fp32", "--benchmark-speech-ratio", "2", "--work", str(tmp_path / "work"),
               "--report", str(report_path)]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, timeout=120, cwd=REPO_ROOT)  # noqa: S603
    assert done.returncode == 1, done.stdout[-3000:] + done.stderr[-3000:]
    figures = json.loads(report_path.read_text())
    assert len(figures["problems"]) == 1 and "lacks llm.pt" in figures["problems"][0]
    assert figures["samples"] == [] and figures["totals"]["requests"] == 0
    assert "verdict: FAIL: RenderError" in done.stdout
