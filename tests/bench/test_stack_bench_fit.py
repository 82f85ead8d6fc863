"""`stack-bench --variant`: the stacks start and warm up one at a time, each one's GPU memory footprint is read, a
stack that would not fit is refused before it starts, and a failed warm-up stops the invocation before the measured
levels. `stackbench.cli.run` as it is, with the servers, the GPUs, the warm-up requests and the measured runs faked
(the real stacks on the CPU: test_stack_bench_run.py)."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

import stackbench.cli as sb
from stackbench import launch

GIB = 2**30
TOTAL = 139 * GIB  # an H200
IDLE = GIB // 2  # in use before any stack: the driver's own
STARTED = 26 * GIB  # what a server's start adds on its GPU
WARMED = 26 * GIB  # what a stack's warm-up adds on each of its GPUs (half per warm-up level)
FOOTPRINT = STARTED + WARMED
WARM_UP_REQUESTS = 128  # --server-warmup 48 at the largest level's concurrency, 64: two per worker


class FakeGpus:
    """GPUs of TOTAL bytes whose memory in use grows as the fake servers start and their stack warms up; read
    through GpuMemory's interface."""

    source = "fake"

    def __init__(self, count: int) -> None:
        self.in_use = [IDLE] * count
        self.indices = list(range(count))
        self.warming: list[int] = []  # the GPUs of the stack started last

    def used(self) -> list[int]:
        return list(self.in_use)

    def total(self) -> list[int]:
        return [TOTAL] * len(self.in_use)


class Fakes:
    """What the run did, in order: ("start", stack work directory, GPU), ("warm", variant directory, warm-up level),
    ("measure", variant name, run)."""

    def __init__(self, gpus: FakeGpus | None, failing: dict[str, int], out_of_memory: bool) -> None:
        self.gpus, self.failing, self.out_of_memory = gpus, failing, out_of_memory
        self.events: list[tuple[Any, ...]] = []
        self.warming_logs: list[Path] = []  # the server logs of the stack started last

    def start_triton(self, bench: launch.BenchStack) -> None:
        devices = [int(server.extra_env.get("CUDA_VISIBLE_DEVICES", "0")) for server in bench.servers]
        for server, device in zip(bench.servers, devices, strict=True):
            assert server.log_path is not None
            server.log_path.write_text("Started GRPCInferenceService at 0.0.0.0:0\n")
            self.events.append(("start", bench.work.relative_to(bench.work.parents[1]).as_posix(), device))
            if self.gpus is not None:
                self.gpus.in_use[device] += STARTED
        self.warming_logs = bench.server_logs
        if self.gpus is not None:
            self.gpus.warming = devices

    def run_level(self, scenario: sb.Scenario, concurrency: int, url: str, json_path: Path, requests: int | None,
                  timeout: float, warmup: int, pipeline: str | None = None) -> dict[str, Any]:  # fmt: skip
        variant_dir = json_path.parent.parent
        self.events.append(("warm", variant_dir.name, scenario.name))
        if self.gpus is not None:
            for device in self.gpus.warming:
                self.gpus.in_use[device] += WARMED // len(sb.WARMUP)
        errors = self.failing.get(f"{variant_dir.name}/{scenario.name}", 0)
        if errors and self.out_of_memory:  # what the engine process of the stack warming up writes in its log
            with open(self.warming_logs[0], "a") as log:
                log.write("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB.\n")
        return {"errors": errors, "requests": max(requests or 0, 2 * concurrency)}


@pytest.fixture
def fake_run(monkeypatch, tmp_path):
    """Run `stack-bench ARGS` on fake stacks: ``fake_run(gpus, *args, failing={...}, out_of_memory=...)`` returns
    (the Fakes, the results directory, the SystemExit or None)."""
    monkeypatch.setenv("PATH", str(tmp_path / "bin"))  # no nvidia-smi and no pynvml: the sampler reads nothing
    monkeypatch.setitem(sys.modules, "pynvml", None)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.setattr(sb, "render_stack", lambda *, work, render_args, **_: (
        SimpleNamespace(max_batch=4, render_args=" ".join(render_args)), work / "repo"))
    monkeypatch.setattr(launch.TritonServer, "cleanup", lambda server: None)

    def run(gpus: FakeGpus | None, *args: str, failing: dict[str, int] | None = None,
            out_of_memory: bool = False) -> tuple[Fakes, Path, SystemExit | None]:
        fakes = Fakes(gpus, failing or {}, out_of_memory)
        monkeypatch.setattr(launch.BenchStack, "start_triton", lambda bench, ready_timeout=0.0:
                            fakes.start_triton(bench))  # fmt: skip
        monkeypatch.setattr(sb, "run_level", fakes.run_level)
        monkeypatch.setattr(sb.VariantRun, "measure", lambda variant_run, number: fakes.events.append(
            ("measure", variant_run.variant.name, number)))
        if gpus is not None:
            monkeypatch.setattr(sb, "GpuMemory", lambda environ=None, indices=None: gpus)
        work = tmp_path / "work"
        argv = ["--work", str(work), "--model-dir", str(tmp_path / "model"), "--device", "cpu", "--dtype", "fp32",
                "--only", "triton-stream", "--stream-levels", "1,64", "--repeat", "2", "--render-arg", "first_hop=5",
                *args]  # fmt: skip
        stopped = None
        try:
            sb.run(argv)
        except SystemExit as exc:
            stopped = exc
        (out,) = (work / "results").iterdir()
        return fakes, out, stopped

    return run


def _footprints(out: Path) -> dict[str, Any]:
    index = json.loads((out / "results.json").read_text())
    from_documents = {v["name"]: json.loads((out / v["results"] / "results.json").read_text())
                      ["gpu_memory_footprint_bytes"] for v in index["variants"]}  # fmt: skip
    assert from_documents == {v["name"]: v["gpu_memory_footprint_bytes"] for v in index["variants"]}
    return from_documents


def _warm_ups(variant_dir: str) -> list[tuple[str, str, str]]:
    return [("warm", variant_dir, warm.name) for warm in sb.WARMUP]


def test_a_stack_that_would_not_fit_is_refused_before_it_starts(fake_run, capsys):
    """One H200 and three settings of 52 GiB each: two fit, the third is refused before it starts, and no level is
    measured."""
    fakes, out, stopped = fake_run(FakeGpus(1), "--variant", "first_hop=6", "--variant", "first_hop=7")
    assert stopped is not None
    assert fakes.events == [("start", "variants/0", 0), *_warm_ups("0-base"),
                            ("start", "variants/1", 0), *_warm_ups("1-first_hop6")]
    free, needed = TOTAL - IDLE - 2 * FOOTPRINT, FOOTPRINT * sb.FIT_MARGIN
    assert free < needed  # the case this test is about
    message = str(stopped.code)
    assert message.startswith("stack-bench: the stack of 'first_hop=7' would not fit on GPU 0: ")
    assert f"{free / GIB:.1f} GiB of {TOTAL / GIB:.1f} GiB free" in message
    assert f"the 2 stack(s) up took {FOOTPRINT / GIB:.1f}, {FOOTPRINT / GIB:.1f} GiB there" in message
    assert f"one more needs {needed / GIB:.1f} GiB" in message
    assert "2 stack(s) fit: measure fewer --variant settings per invocation, or fewer levels" in message
    assert _footprints(out) == {"base": [FOOTPRINT], "first_hop=6": [FOOTPRINT], "first_hop=7": None}
    printed = capsys.readouterr().out
    assert f"GPU memory footprint of the stack of 'base' (its start and warm-up): {FOOTPRINT / GIB:.1f} GiB" in printed
    assert "not checking" not in printed


def test_stacks_that_fit_start_and_warm_up_one_at_a_time_then_interleave(fake_run):
    """Two GPUs, two servers per stack (--replicas 2), a least-busy variant on the base's stack: each stack warms
    up once, by its first variant, before the next one starts; every variant has its stack's footprint per GPU and
    its target, and the runs interleave."""
    fakes, out, stopped = fake_run(FakeGpus(2), "--replicas", "2", "--variant", "balance=least-busy",
                                   "--variant", "first_hop=6")
    assert stopped is None
    names = ["base", "balance=least-busy", "first_hop=6"]
    assert fakes.events == [
        ("start", "variants/0", 0), ("start", "variants/0", 1), *_warm_ups("0-base"),
        ("start", "variants/1", 0), ("start", "variants/1", 1), *_warm_ups("2-first_hop6"),
        *(("measure", name, number) for number in (1, 2) for name in names),
    ]
    assert _footprints(out) == dict.fromkeys(names, [FOOTPRINT, FOOTPRINT])
    documents = {name: json.loads((out / directory / "results.json").read_text())
                 for name, directory in zip(names, ["0-base", "1-balanceleast-busy", "2-first_hop6"], strict=True)}
    for document in documents.values():
        assert re.fullmatch(r"ipv4:127\.0\.0\.1:\d+,127\.0\.0\.1:\d+", document["grpc_target"])
        assert document["server_ready_s"] is not None
    assert documents["base"]["grpc_target"] == documents["balance=least-busy"]["grpc_target"]  # one stack


def test_without_a_memory_reading_every_stack_starts_unchecked(fake_run, capsys):
    fakes, out, stopped = fake_run(None, "--variant", "first_hop=6", "--variant", "first_hop=7")
    assert stopped is None
    assert [e[1] for e in fakes.events if e[0] == "start"] == ["variants/0", "variants/1", "variants/2"]
    assert [e[1:] for e in fakes.events if e[0] == "measure"][:3] == [("base", 1), ("first_hop=6", 1),
                                                                       ("first_hop=7", 1)]
    assert _footprints(out) == dict.fromkeys(["base", "first_hop=6", "first_hop=7"], None)
    printed = capsys.readouterr().out
    assert printed.count("not checking that every setting's stack fits in GPU memory") == 1
    assert "GPU memory footprint" not in printed


@pytest.mark.parametrize("out_of_memory", [True, False])
def test_a_warm_up_with_errors_stops_before_the_measured_levels(fake_run, out_of_memory):
    fakes, out, stopped = fake_run(FakeGpus(1), "--variant", "first_hop=6",
                                   failing={"1-first_hop6/warmup-stream": 118}, out_of_memory=out_of_memory)
    assert stopped is not None
    assert fakes.events == [("start", "variants/0", 0), *_warm_ups("0-base"),
                            ("start", "variants/1", 0), ("warm", "1-first_hop6", "warmup-stream")]  # at once
    message = str(stopped.code)
    assert message.startswith(f"stack-bench: setting 'first_hop=6': 118 of {WARM_UP_REQUESTS} warmup-stream "
                              "requests failed")
    assert ("the GPU ran out of memory: measure fewer --variant settings" in message) == out_of_memory
    assert message.endswith("stopping before the measured levels (server log tail saved)")
    assert "Started GRPCInferenceService" in (out / "1-first_hop6" / "tritonserver_tail.log").read_text()
