"""`stack-bench` (package `stackbench`): its documented options, the per-level measures, the real-time rule, the GPU
sampler and the results directories (pure parts; the whole run is in test_stack_bench_run.py)."""

from __future__ import annotations

import argparse
import os
import re
import stat
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

import pytest

import pipeline_contract as contract
import stackbench.cli as sb
from stackbench import launch
from triton_repo.server import REPO_ROOT


def test_docstring_lists_exactly_the_parser_options():
    section = sb.__doc__.split("\nOptions:\n", 1)[1]
    documented = re.findall(r"^  (--[a-z][a-z0-9-]*)", section, re.M)
    assert len(documented) == len(set(documented)), "an option is documented twice"
    parser_options = {o for a in sb.build_parser()._actions for o in a.option_strings if o.startswith("--")}
    assert set(documented) == parser_options - {"--help"}


def test_documented_defaults_match_the_parser():
    section = sb.__doc__.split("\nOptions:\n", 1)[1]
    defaults = vars(sb.build_parser().parse_args([]))
    for option, default in re.findall(r"^  (--[a-z][a-z0-9-]*) .*\(default ([^);]+)\)", section, re.M):
        value = defaults[option[2:].replace("-", "_")]
        if value is None:  # a derived default (WORK/results): described, not a value
            continue
        shown = ",".join(map(str, value)) if isinstance(value, list) else str(value)
        if isinstance(value, float):
            shown = f"{value:g}"
        if isinstance(value, Path):
            shown = str(value.relative_to(REPO_ROOT))
        assert shown == default, option


def _row(c, run=1, p90=0.3, stalled=0, errors=0, scenario="triton-stream", **extra):
    return {"scenario": scenario, "concurrency": c, "run": run, "first_chunk_p90": p90, "stalled_streams": stalled,
            "errors": errors, "requests": 8, **extra}


def test_realtime_streams_is_the_highest_level_that_meets_the_rule_in_every_run():
    rows = [_row(1), _row(4), _row(16, p90=0.45), _row(32, p90=0.7), _row(64, p90=0.9)]
    assert sb.realtime_streams(rows) == 16
    assert sb.realtime_streams(rows + [_row(16, run=2, stalled=1)]) == 4  # one stalled stream in run 2
    assert sb.realtime_streams(rows + [_row(4, run=2, errors=1), _row(16, run=2, p90=0.501)]) == 1
    assert sb.realtime_streams([_row(1, p90=0.5)]) == 1  # the bound itself is real time
    assert sb.realtime_streams([_row(1, p90=0.6)]) == 0
    assert sb.realtime_streams([_row(1, p90=None)]) == 0  # no first chunk measured
    assert sb.realtime_streams([_row(1, scenario="triton-offline")]) is None


def test_level_row_takes_the_measures_from_the_tts_bench_level():
    level = {"requests": 8, "errors": 1, "first_chunk": {"p50": 0.2, "p90": 0.3, "p99": 0.4}, "total": {"p50": 1.0},
             "stalls": {"streams": 7, "stalled": 2, "stalled_share": 2 / 7, "total": 0.5, "p50": 0.0, "p90": 0.2,
                        "max": 0.3, "events": 3, "by_piece": {"2": 2, "4": 1}},
             "audio_seconds_per_second": 12.5, "aggregate_rtf": 0.08}
    scenario = sb.SCENARIOS[0]
    row = sb.level_row(scenario, 16, 2, level, 0.75, {"llm_step_ms": 2.0})
    assert (row["scenario"], row["concurrency"], row["run"]) == ("triton-stream", 16, 2)
    assert (row["first_chunk_p50"], row["first_chunk_p90"], row["first_chunk_p99"]) == (0.2, 0.3, 0.4)
    assert (row["stalled_streams"], row["stall_p90"], row["stall_max"]) == (2, 0.2, 0.3)
    assert row["stalls_by_chunk"] == {2: 2, 4: 1}  # the JSON document's keys as chunk numbers
    assert row["gpu_busy"] == 0.75 and row["audio_seconds_per_second"] == 12.5
    offline = sb.level_row(sb.SCENARIOS[1], 32, 1, {**level, "stalls": None}, None, {})  # one piece: the whole file
    assert offline["total_p50"] == 1.0 and offline["first_chunk_p50"] is None and offline["first_chunk_p90"] is None and offline["stalled_streams"] is None and offline["gpu_busy"] is None


def test_spread_cell_shows_every_run_and_the_range():
    assert sb.spread_cell([0.2], 1000.0, "{:.0f}") == "200"
    assert sb.spread_cell([0.21, 0.19, 0.2], 1000.0, "{:.0f}") == "210 / 190 / 200 (190–210)"
    assert sb.spread_cell([None, 0.5], 100.0, "{:.0f}") == "n/a / 50 (50–50)"
    assert sb.spread_cell([None], 100.0, "{:.0f}") == "n/a"


def test_summary_has_a_row_per_scenario_and_level_with_all_runs():
    rows = [
        _row(1, run=1, total_p50=1.0, first_chunk_p50=0.2, first_chunk_p99=0.4, stalled_share=0.0, stall_p90=0.0, stall_max=0.0,
             audio_seconds_per_second=10.0, gpu_busy=0.5, stages={"llm_step_ms": 2.25}),
        _row(1, run=2, stalled=2, total_p50=1.1, first_chunk_p50=0.22, first_chunk_p99=0.41, stalled_share=0.25, stall_p90=0.01,
             stall_max=0.02, audio_seconds_per_second=11.0, gpu_busy=None, stages={"llm_step_ms": 2.5}),
    ]
    text = sb.summary_markdown(rows, "title", sb.realtime_streams(rows), "dit (var/stackbench/dit)")
    assert "token2wav: **dit (var/stackbench/dit)**" in text.splitlines()[:4]
    spark = sb.summary_markdown(rows, "title", sb.realtime_streams(rows), None, sb.SPARK_PIPELINE)
    assert "pipeline: **spark-tts**" in spark.splitlines()[2] and "token2wav: **" not in spark  # its own vocoder
    cv3 = sb.summary_markdown(rows, "title", sb.realtime_streams(rows), None, sb.COSYVOICE3_PIPELINE)
    assert cv3.splitlines()[2] == "pipeline: **cosyvoice3** (every figure below is CosyVoice3's)"
    assert "token2wav: **" not in cv3
    line = next(x for x in text.splitlines() if x.startswith("| triton-stream | 1 | 16 (0)"))
    assert "200 / 220 (200–220)" in line and "1000 / 1100 (1000–1100)" in line and "0 / 25 (0–25)" in line and "50 / n/a (50–50)" in line
    assert "| triton-stream | 1 | n/a / n/a | 2.25 / 2.50 (2.25–2.50)" in text  # the stage table
    assert "Real-time streams per machine" in text and "**0**; per GPU (1 used): **0**" in text  # run 2 stalled
    assert "replicas: **1** (one tritonserver); GPUs used: **1**" in text
    assert "GPU busy, GPU by GPU" not in text  # one GPU: the table's column is that GPU


def test_results_directories_are_fresh_for_every_invocation(tmp_path):
    now = datetime(2026, 11, 23, 22, 5, 1, tzinfo=timezone.utc)
    first = sb.fresh_results_dir(tmp_path / "results", "cuda-bf16-r3", now)
    (first / "summary.md").write_text("run 1")
    second = sb.fresh_results_dir(tmp_path / "results", "cuda-bf16-r3", now)  # same second, same settings
    assert first.name == "20261123T220501Z-cuda-bf16-r3" and second != first and second.is_dir()
    assert (first / "summary.md").read_text() == "run 1"
    assert sb.fresh_results_dir(tmp_path / "results", "cuda-bf16-r3").name.endswith("Z-cuda-bf16-r3")


def test_settings_slug_is_short_and_file_name_safe():
    args = argparse.Namespace(device="cuda", dtype="bf16", max_batch=32, token2wav="unet", spark=False,
                              cosyvoice3=False, render_arg=["first_hop=15", "layout=a/b"], only="triton-stream,triton-offline", repeat=3,
                              replicas=1, server_arg=[], balance="round-robin")
    slug = sb.settings_slug(args)
    assert slug == "cuda-bf16-b32-unet-first_hop15-layoutab-triton-stream+triton-offline-r3"
    replicas = sb.settings_slug(argparse.Namespace(**{**vars(args), "replicas": 4}))
    assert replicas == "cuda-bf16-b32-unet-first_hop15-layoutab-triton-stream+triton-offline-rep4-r3"
    balanced = sb.settings_slug(argparse.Namespace(**{**vars(args), "replicas": 2, "balance": "least-busy",
                                                      "only": None}))
    assert balanced == "cuda-bf16-b32-unet-first_hop15-layoutab-rep2-least-busy-r3"
    assert sb.settings_slug(argparse.Namespace(**{**vars(args), "token2wav": "dit"})).startswith("cuda-bf16-b32-dit-")
    pool = sb.settings_slug(argparse.Namespace(**{**vars(args), "server_arg": ["--backend-config=python,thread-pool-size=128"]}))
    assert "-layoutab-thread-pool-size128-triton-stream" in pool  # a server argument names its run too
    assert len(sb.settings_slug(argparse.Namespace(**{**vars(args), "only": "x" * 300}))) <= 80
    # a Spark run is named as one from its first word, however long the rest
    spark = argparse.Namespace(**{**vars(args), "spark": True, "only": "x" * 300})
    # and without a token2wav: Spark vocodes with its own BiCodec
    assert sb.settings_slug(spark).startswith("spark-tts-cuda-bf16-b32-first_hop15-")
    # a CosyVoice3 run likewise (its own DiT flow and HiFT)
    cv3 = sb.settings_slug(argparse.Namespace(**{**vars(args), "cosyvoice3": True}))
    assert cv3 == "cosyvoice3-cuda-bf16-b32-first_hop15-layoutab-triton-stream+triton-offline-r3"
    # the render's default slot count goes unnamed
    assert sb.settings_slug(argparse.Namespace(**{**vars(args), "max_batch": None})).startswith("cuda-bf16-unet-")


async def test_spark_scenarios_aim_tts_bench_at_the_spark_models():  # async: the targets open gRPC clients
    assert sb.pipeline_args("triton", None) == [] and sb.pipeline_args("gateway", None) == []
    assert sb.pipeline_args("triton", "spark-tts") == ["--pipeline", "spark-tts"]
    assert sb.pipeline_args("gateway", "spark-tts") == ["--model", "spark-tts"]
    from ttsbench.cli import build_parser, make_targets

    args = build_parser().parse_args(["triton", *sb.pipeline_args("triton", sb.SPARK_PIPELINE), "--mode", "both"])
    assert {t.model for t in make_targets(args)} == {contract.SPARK_OFFLINE_MODEL, contract.SPARK_STREAMING_MODEL}
    assert all(t.mode.startswith("triton-spark-tts/") for t in make_targets(args))
    gateway = build_parser().parse_args(["gateway", *sb.pipeline_args("gateway", sb.SPARK_PIPELINE)])
    from gateway.settings import Settings

    assert gateway.model in Settings().spark_models  # the name the gateway serves Spark under


async def test_cosyvoice3_scenarios_aim_tts_bench_at_the_cosyvoice3_models():  # async: the targets open gRPC clients
    from gateway.settings import Settings
    from ttsbench.cli import build_parser, make_targets

    args = build_parser().parse_args(["triton", *sb.pipeline_args("triton", sb.COSYVOICE3_PIPELINE), "--mode", "both"])
    assert {t.model for t in make_targets(args)} == {contract.COSYVOICE3_OFFLINE_MODEL,
                                                     contract.COSYVOICE3_STREAMING_MODEL}
    assert all(t.mode.startswith("triton-cosyvoice3/") for t in make_targets(args))
    gateway = build_parser().parse_args(["gateway", *sb.pipeline_args("gateway", sb.COSYVOICE3_PIPELINE)])
    assert gateway.model in Settings().cosyvoice3_models  # the name the gateway serves CosyVoice3 under


def test_busy_share_averages_the_samples_inside_the_window():
    samples = [(9.9, 100.0), (10.0, 40.0), (10.2, 60.0), (10.4, 80.0), (10.6, 100.0)]
    assert sb.busy_share(samples, (10.0, 10.4)) == pytest.approx(0.6)
    assert sb.busy_share(samples, (20.0, 21.0)) is None
    assert sb.busy_share(samples, None) is None


def test_visible_gpus():
    assert sb.visible_gpu_indices({}) is None
    assert sb.visible_gpu_indices({"CUDA_VISIBLE_DEVICES": "2,3"}) == [2, 3]
    assert sb.visible_gpu_indices({"CUDA_VISIBLE_DEVICES": "GPU-1234abcd"}) is None


def _only_path(monkeypatch, directory: Path) -> None:
    """A PATH without any real nvidia-smi, and no pynvml."""
    monkeypatch.setenv("PATH", str(directory))
    monkeypatch.setitem(sys.modules, "pynvml", None)


def test_gpu_sampler_without_a_gpu_reports_nothing_and_does_not_fail(monkeypatch, tmp_path):
    _only_path(monkeypatch, tmp_path)
    sampler = sb.GpuSampler().start()
    time.sleep(0.05)
    sampler.stop()
    assert sampler.source is None and sampler.samples == []
    assert sampler.busy_share((0.0, time.time())) is None


def test_gpu_sampler_reads_nvidia_smi(monkeypatch, tmp_path):
    fake = tmp_path / "nvidia-smi"
    log = tmp_path / "args"
    # Two GPUs at 30 % and 70 %, one line each per tick (index, percent), and a line that is not a number.
    fake.write_text(f'#!/bin/sh\nPATH=/usr/bin:/bin\necho "$@" > {log}\necho "0, [N/A]"\n'
                    'while true; do echo "0, 30"; echo "1, 70"; sleep 0.05; done\n')
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    _only_path(monkeypatch, tmp_path)
    sampler = sb.GpuSampler(environ={"CUDA_VISIBLE_DEVICES": "0,1"})
    started = time.time()
    sampler.start()
    deadline = time.monotonic() + 10
    while len(sampler.samples) < 6 and time.monotonic() < deadline:
        time.sleep(0.05)
    sampler.stop()
    assert sampler.source == "nvidia-smi"
    assert len(sampler.samples) >= 6
    assert sampler.busy_share((started, time.time())) == pytest.approx(0.5, abs=0.2 / len(sampler.samples) + 1e-9)
    assert sampler.busy_per_gpu((started, time.time())) == {"0": pytest.approx(0.3), "1": pytest.approx(0.7)}
    assert sampler.busy_per_gpu((0.0, 1.0)) == {"0": None, "1": None}  # no sample in that window
    args = log.read_text().split()
    assert "--query-gpu=index,utilization.gpu" in args and "-lms=200" in args and "--id=0,1" in args
    assert os.path.exists(fake)


def test_gpu_memory_without_a_gpu_is_none(monkeypatch, tmp_path):
    _only_path(monkeypatch, tmp_path)
    memory = sb.GpuMemory()
    assert memory.source is None and memory.used() is None and memory.total() is None


def test_gpu_memory_reads_nvidia_smi_in_bytes(monkeypatch, tmp_path):
    fake = tmp_path / "nvidia-smi"
    log = tmp_path / "args"
    used = tmp_path / "used"  # MiB per GPU, one line each: the fake prints what the test wrote last
    used.write_text("1000\n2500\n")
    total = tmp_path / "total"
    total.write_text("143771\n81559\n")
    fake.write_text(f"#!/bin/sh\nPATH=/usr/bin:/bin\necho \"$@\" > {log}\n"
                    f'case "$*" in *memory.total*) cat {total};; *) cat {used};; esac\n')
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    _only_path(monkeypatch, tmp_path)
    memory = sb.GpuMemory(environ={"CUDA_VISIBLE_DEVICES": "0,1"})
    assert memory.source == "nvidia-smi"
    assert memory.used() == [1000 * 2**20, 2500 * 2**20]
    used.write_text("1200\n2500\n")
    assert memory.used() == [1200 * 2**20, 2500 * 2**20]
    args = log.read_text().split()
    assert "--query-gpu=memory.used" in args and "--format=csv,noheader,nounits" in args and "--id=0,1" in args
    assert memory.total() == [143771 * 2**20, 81559 * 2**20]
    assert "--query-gpu=memory.total" in log.read_text().split() and "--id=0,1" in log.read_text().split()
    assert sb.GpuMemory(indices=[1]).used() == [1200 * 2**20, 2500 * 2**20]  # what the fake prints, whatever asked
    assert "--id=1" in log.read_text().split()  # the GPUs asked for, not CUDA_VISIBLE_DEVICES'
    used.write_text("[N/A]\n")
    assert memory.used() is None  # a failed reading is a missing sample, never a made-up one


@pytest.mark.parametrize(("argv", "message"), [
    (["--only", "triton-stream,nope"], "unknown scenario(s) nope"),
    (["--stub-env", "/nonexistent/env"], "is not a Python environment"),
    (["--dit-dir", "/nonexistent/token2wav"], "--dit-dir is only used with --token2wav dit"),
    (["--token2wav", "dit", "--dit-dir", "/nonexistent/token2wav"], "--dit-dir: DiT token2wav directory"),
    (["--render-arg", "token2wav=dit"], "give token2wav with --token2wav, not --render-arg"),
    (["--render-arg", "max_batch=64"], "give max_batch with --max-batch, not --render-arg"),
    (["--token2wav", "dit", "--render-arg", "dit_dir=/x"], "give dit_dir with --dit-dir, not --render-arg"),
    (["--spark-dir", "/x"], "--spark-dir and --spark-benchmark-ratio need --spark"),
    (["--spark-benchmark-ratio", "2"], "--spark-dir and --spark-benchmark-ratio need --spark"),
    (["--spark", "--token2wav", "dit"], "--token2wav and --dit-dir do not apply"),
    (["--spark", "--dit-dir", "/x"], "--token2wav and --dit-dir do not apply"),
    (["--cosyvoice3-dir", "/x"], "--cosyvoice3-dir and --cosyvoice3-benchmark-ratio need --cosyvoice3"),
    (["--cosyvoice3-benchmark-ratio", "2"], "--cosyvoice3-dir and --cosyvoice3-benchmark-ratio need --cosyvoice3"),
    (["--cosyvoice3", "--spark"], "--spark and --cosyvoice3 each load one pipeline"),
    (["--cosyvoice3", "--token2wav", "dit"], "CosyVoice3, which has its own DiT flow and HiFT: --token2wav and"),
    (["--cosyvoice3", "--render-arg", "cosyvoice3=x"], "give cosyvoice3 with --cosyvoice3, not --render-arg"),
    (["--open-loop", "1", "--open-loop-min", "8", "--open-loop-max", "4"], "--open-loop: rate bounds must be"),
    (["--balance", "least-busy"], "--balance least-busy spreads requests over replicas: add --replicas N"),
    (["--render-arg", "first_hop"], "'first_hop' is not FIELD=VALUE"),
    (["--variant", ""], "--variant needs FIELD=VALUE items"),
    (["--variant", "first_hop"], "--variant: 'first_hop' is not FIELD=VALUE"),
    (["--variant", "dtype=fp16"], "give dtype with --dtype, not --variant"),
    (["--variant", "balance=fastest", "--replicas", "2", "--device", "cpu"], "balance is one of"),
    (["--variant", "balance=least-busy"], "--balance least-busy spreads requests over replicas: add --replicas N"),
    (["--render-arg", "first_hop=5", "--variant", "first_hop=5 "], "measures a setting already measured"),
    (["--variant", "first_hop=6", "--variant", "first_hop=6"], "measures a setting already measured"),
])
def test_bad_settings_stop_before_anything_is_written(tmp_path, argv, message):
    with pytest.raises(SystemExit, match=re.escape(message)):
        sb.main(["--work", str(tmp_path / "work"), *argv])
    assert not (tmp_path / "work").exists()


def test_random_weights_are_written_once_and_an_interrupted_write_is_redone(tmp_path):
    calls = []

    def interrupted(path: Path) -> None:
        calls.append(path)
        path.mkdir()
        (path / "llm.pt").write_bytes(b"half")
        raise KeyboardInterrupt

    def complete(path: Path) -> None:
        calls.append(path)
        path.mkdir()
        (path / "llm.pt").write_bytes(b"whole")

    with pytest.raises(KeyboardInterrupt):
        launch.random_weights(tmp_path / "model", interrupted, "test")
    assert not (tmp_path / "model").exists()  # the half-written files are not a model
    assert launch.random_weights(tmp_path / "model", complete, "test") == tmp_path / "model"
    assert launch.random_weights(tmp_path / "model", complete, "test") == tmp_path / "model"  # reused
    assert calls == [tmp_path / "model.partial"] * 2
    assert (tmp_path / "model" / "llm.pt").read_bytes() == b"whole"
    assert not (tmp_path / "model.partial").exists()


def test_the_random_dit_is_the_released_layout_and_loads_strictly(tmp_path):
    import shutil

    from cosyvoice2.dit.config import DiTFlowConfig
    from cosyvoice2.dit.layout import DIT_HIFT_CONFIG
    from cosyvoice2.dit.loading import load_dit_token2wav
    from cosyvoice2.hift import HiFTConfig

    dit_dir = launch.random_weights(tmp_path / "dit", launch.write_random_dit, "DiT token2wav")
    try:
        assert not (dit_dir / DIT_HIFT_CONFIG).exists()  # HiFT at its released (default) size, as released
        engine = load_dit_token2wav(dit_dir)  # every key and shape, strictly
        assert engine.flow.config == DiTFlowConfig() and engine.hift.config == HiFTConfig()
    finally:
        shutil.rmtree(dit_dir)  # ~700 MB: not left to the temporary-directory retention


def test_levels_repeat_and_token2wav_are_checked_by_the_parser(capsys):
    parser = sb.build_parser()
    assert parser.parse_args(["--stream-levels", "1,8"]).stream_levels == [1, 8]
    assert (parser.parse_args([]).token2wav, parser.parse_args(["--token2wav", "dit"]).token2wav) == ("unet", "dit")
    for argv in (["--stream-levels", "0,4"], ["--offline-levels", "x"], ["--repeat", "0"], ["--token2wav", "bigvgan"]):
        with pytest.raises(SystemExit):
            parser.parse_args(argv)


def _check_own_benchmark_mode(capsys, common: dict, pipeline: str, model_dir, announced: str, tokenizer,
                              tokens_per_char: float, models: tuple[str, ...]):
    """A stack rendered with `pipeline`'s directory (`spark`, `cosyvoice3`) beside CosyVoice2: its own benchmark
    ratio, announced, giving the built-in sentences `tokens_per_char`, its models rendered, CosyVoice2's ratio off;
    a given ratio is rendered as given, 0 as off. Returns the default render (options, repository)."""
    from ttsbench.sentences import SENTENCES

    options, repo = launch.render_stack(**common, **{f"{pipeline}_dir": model_dir})
    ratio = getattr(options, pipeline).benchmark_ratio
    assert getattr(options, pipeline).model_dir == model_dir and options.benchmark_speech_ratio is None
    assert announced.format(ratio) in capsys.readouterr().out
    tokens = sum(ratio * len(tokenizer.encode(s)) for s in SENTENCES)
    assert tokens / sum(len(s) for s in SENTENCES) == pytest.approx(tokens_per_char, rel=1e-3)
    for name in models:
        assert (repo / name / "config.pbtxt").is_file()
    for given, rendered in ((2.5, 2.5), (0, None)):  # 0: off, for real weights
        given_options, _ = launch.render_stack(**common, **{f"{pipeline}_dir": model_dir,
                                                            f"{pipeline}_benchmark_ratio": given})
        assert getattr(given_options, pipeline).benchmark_ratio == rendered
    return options, repo


def test_render_stack_renders_spark_beside_cosyvoice2_in_its_own_benchmark_mode(tmp_path, capsys):
    from cosyvoice2.testing import write_tiny_model
    from spark_tts.prompt import SparkTokenizer
    from spark_tts.testing import write_tiny_model as write_tiny_spark

    model, spark = write_tiny_model(tmp_path / "tiny"), write_tiny_spark(tmp_path / "spark")
    assert launch.ensure_spark_dir(tmp_path / "work", spark) == spark  # given weights are never rewritten
    common = {"work": tmp_path / "work", "model_dir": model, "device": "cpu", "dtype": "fp32", "max_batch": 4,
              "max_seq_len": 512, "benchmark_speech_ratio": 0}  # fmt: skip
    options, repo = launch.render_stack(**common)
    assert options.spark is None and not (repo / contract.SPARK_STREAMING_MODEL).exists()

    # the default ratio gives the built-in sentences 3.33 semantic tokens (50 per second) per character
    options, _ = _check_own_benchmark_mode(
        capsys, common, "spark", spark, "Spark benchmark mode: {} semantic tokens per text token",
        SparkTokenizer.from_model_dir(spark), launch.SPARK_TOKENS_PER_CHAR,
        (contract.SPARK_OFFLINE_MODEL, contract.SPARK_STREAMING_MODEL))


def test_render_stack_renders_cosyvoice3_beside_cosyvoice2_in_its_own_benchmark_mode(tmp_path, capsys):
    from cosyvoice2.testing import write_tiny_model
    from cosyvoice3.layout import released_dir_problems
    from cosyvoice3.text import CosyVoice3Tokenizer

    model, work = write_tiny_model(tmp_path / "tiny"), tmp_path / "work"
    # no --cosyvoice3-dir: on the CPU the tiny model (every file serving reads), written once, then reused
    cv3 = launch.ensure_cosyvoice3_dir(work, None, "cpu")
    assert cv3 == work / "cosyvoice3-tiny" and released_dir_problems(cv3) == []
    written = {p: p.stat().st_mtime_ns for p in cv3.rglob("*")}
    assert launch.ensure_cosyvoice3_dir(work, None, "cpu") == cv3
    assert {p: p.stat().st_mtime_ns for p in cv3.rglob("*")} == written
    assert launch.ensure_cosyvoice3_dir(work, tmp_path / "given", "cuda") == tmp_path / "given"  # never rewritten
    (work / "cosyvoice3-model").mkdir()  # CUDA's released-size one, once written, is reused (not the tiny one)
    assert launch.ensure_cosyvoice3_dir(work, None, "cuda") == work / "cosyvoice3-model"

    common = {"work": work, "model_dir": model, "device": "cpu", "dtype": "fp32", "max_batch": 4,
              "max_seq_len": 512, "benchmark_speech_ratio": 0}  # fmt: skip
    # the default ratio gives the built-in sentences 1.67 speech tokens (25 per second) per character
    options, repo = _check_own_benchmark_mode(
        capsys, common, "cosyvoice3", cv3, "CosyVoice3 benchmark mode: {} speech tokens per text token",
        CosyVoice3Tokenizer.from_model_dir(cv3), launch.SPEECH_TOKENS_PER_CHAR,
        (contract.COSYVOICE3_OFFLINE_MODEL, contract.COSYVOICE3_STREAMING_MODEL))
    assert options.spark is None and not (repo / contract.SPARK_STREAMING_MODEL).exists()


# -- the first-chunk breakdown, from two scrapes of /metrics around a level --------------------------------------
def _scrape(values: dict[tuple[str, str], float]) -> str:
    """A Triton metrics page with these `cosyvoice2_<stat>{model=...}` values (and metrics of others around them)."""
    lines = ["# HELP nv_inference_count Number of inferences", "# TYPE nv_inference_count counter",
             'nv_inference_count{model="cosyvoice2_stream",version="1"} 12']
    for (stat, model), value in values.items():
        lines += [f"# TYPE cosyvoice2_{stat} counter", f'cosyvoice2_{stat}{{model="{model}"}} {value}']
    return "\n".join(lines) + "\n"


#: A level of 4 streaming requests in the single layout (`llm` and `token2wav` models), seconds.
BEFORE = {("orchestrator_first_chunks_total", "cosyvoice2_stream"): 10, ("llm_first_chunks_total", "llm"): 10,
          ("token2wav_first_chunks_total", "token2wav"): 10,
          ("orchestrator_first_chunk_prompt_seconds_total", "cosyvoice2_stream"): 1.0,
          ("llm_first_chunk_wait_seconds_total", "llm"): 0.5}
LEVEL = {  # what the level added
    ("orchestrator_first_chunks_total", "cosyvoice2_stream"): 4,
    ("orchestrator_first_chunk_prompt_seconds_total", "cosyvoice2_stream"): 0.04,
    ("orchestrator_first_chunk_tokens_seconds_total", "cosyvoice2_stream"): 0.8,
    ("orchestrator_first_chunk_audio_seconds_total", "cosyvoice2_stream"): 1.2,
    ("orchestrator_first_chunk_send_seconds_total", "cosyvoice2_stream"): 0.008,
    ("llm_first_chunks_total", "llm"): 4,
    ("llm_first_chunk_wait_seconds_total", "llm"): 0.1,
    ("llm_first_chunk_prefill_seconds_total", "llm"): 0.06,
    ("llm_first_chunk_decode_seconds_total", "llm"): 0.56,
    ("llm_first_chunk_steps_total", "llm"): 112,
    ("token2wav_first_chunks_total", "token2wav"): 4,
    ("token2wav_first_chunk_wait_seconds_total", "token2wav"): 0.4,
    ("token2wav_first_chunk_call_seconds_total", "token2wav"): 0.7,
    ("token2wav_first_chunk_rows_total", "token2wav"): 7,
}


def _after(level: dict[tuple[str, str], float], before=BEFORE) -> dict[tuple[str, str], float]:
    return {key: before.get(key, 0.0) + level.get(key, 0.0) for key in before.keys() | level.keys()}


def test_first_chunk_breakdown_lays_the_level_means_end_to_end():
    before, after = sb.parse_metrics(_scrape(BEFORE)), sb.parse_metrics(_scrape(_after(LEVEL)))
    assert before["token2wav_first_chunks_total"] == 10 and "nv_inference_count" not in before
    stages = sb.stage_breakdown(before, after)
    expected_ms = {"prompt": 10.0, "tokens": 200.0, "audio": 300.0, "send": 2.0,  # the orchestrator's, over 4
                   "llm_queue": 25.0, "llm_prefill": 15.0, "llm_decode": 140.0,  # the LLM's, over its 4
                   "token2wav_queue": 100.0, "token2wav_call": 175.0}  # token2wav's, over its 4
    for key, ms in expected_ms.items():
        assert stages[f"first_chunk_{key}_ms"] == pytest.approx(ms), key
    assert stages["first_chunks"] == stages["first_chunks_llm"] == stages["first_chunks_token2wav"] == 4
    assert stages["first_chunk_ms"] == pytest.approx(512.0)
    assert stages["first_chunk_llm_decode_steps"] == pytest.approx(28.0)
    assert stages["first_chunk_token2wav_rows"] == pytest.approx(7 / 4)
    # other: what the LLM's stages leave of the tokens stage (20 ms) and token2wav's of the audio stage (25 ms)
    assert stages["first_chunk_other_ms"] == pytest.approx(45.0)
    laid = [stages[key] for _, key, _ in sb.FIRST_CHUNK_COLUMNS[1:] if key.endswith("_ms")]
    assert sum(laid) == pytest.approx(stages["first_chunk_ms"])  # the columns add up to the first chunk


def test_first_chunk_breakdown_without_a_layers_counters_keeps_its_orchestrator_stage_out_of_other():
    # TensorRT-LLM: no llm_* metrics; the tokens stage stays whole, the LLM's columns are n/a
    level = {key: value for key, value in LEVEL.items() if not key[0].startswith("llm_")}
    earlier = {key: value for key, value in BEFORE.items() if not key[0].startswith("llm_")}
    stages = sb.stage_breakdown(sb.parse_metrics(_scrape(earlier)), sb.parse_metrics(_scrape(_after(level, earlier))))
    assert stages["first_chunk_llm_queue_ms"] is None and stages["first_chunk_llm_decode_steps"] is None
    assert stages["first_chunks_llm"] is None and stages["first_chunks_token2wav"] == 4
    assert stages["first_chunk_tokens_ms"] == pytest.approx(200.0)
    assert stages["first_chunk_other_ms"] == pytest.approx(25.0)  # only token2wav's remainder
    # an offline level: no streaming request, no breakdown
    offline = sb.first_chunk_breakdown({"llm_first_chunks_total": 0.0, "orchestrator_requests_total": 4.0})
    assert offline["first_chunks"] == 0 and all(v is None for k, v in offline.items() if k != "first_chunks")


def test_first_chunk_breakdown_reads_counters_that_the_serving_layers_define():
    from speech_serving import llm_scheduler, orchestrator, token2wav

    defined = {*llm_scheduler.FIRST_CHUNK_STATS, *token2wav.FIRST_CHUNK_STATS, *orchestrator.FIRST_CHUNK_STATS}
    read = {sb.FIRST_CHUNKS, *(count for _, count, _ in sb.FIRST_CHUNK_SEGMENTS if count)}
    read |= {counter for _, _, stages in sb.FIRST_CHUNK_SEGMENTS for _, counter in stages}
    read |= {f"orchestrator_first_chunk_{segment}_seconds_total" for segment, _, _ in sb.FIRST_CHUNK_SEGMENTS}
    read |= {"llm_first_chunk_steps_total", "token2wav_first_chunk_rows_total"}
    assert read == defined


def test_summary_has_a_first_chunk_table_for_streaming_levels_only():
    stages = sb.stage_breakdown(sb.parse_metrics(_scrape(BEFORE)), sb.parse_metrics(_scrape(_after(LEVEL))))
    slower = sb.stage_breakdown(sb.parse_metrics(_scrape(BEFORE)), sb.parse_metrics(_scrape(_after(
        {**LEVEL, ("orchestrator_first_chunk_send_seconds_total", "cosyvoice2_stream"): 0.016}))))
    measures = dict.fromkeys((key for _, key, *_ in sb.SUMMARY_COLUMNS), 0.5)
    rows = [_row(16, run=1, stages=stages, **measures), _row(16, run=2, stages=slower, **measures),
            _row(32, scenario="triton-offline", stages=sb.stage_breakdown({}, {}), **measures)]
    text = sb.summary_markdown(rows, "title", None, "unet")
    table = text.split("First chunk, stage by stage", 1)[1]
    header = next(line for line in table.splitlines() if line.startswith("| scenario"))
    assert header.split(" | ")[2:] == [title for title, *_ in sb.FIRST_CHUNK_COLUMNS[:-1]] + ["other |"]
    line = next(line for line in table.splitlines() if line.startswith("| triton-stream | 16 |"))
    assert "| 512 / 514 (512–514) |" in line and "| 2.0 / 4.0 (2.0–4.0) |" in line  # first chunk; send
    assert "triton-offline" not in table  # no first chunk there


def test_settled_metrics_reads_until_the_metrics_stop_changing(monkeypatch):
    reads = iter([{"a": 1.0}, {"a": 2.0}, {"a": 3.0}] + [{"a": 3.0}] * 1000)  # the last publications come late
    monkeypatch.setattr(sb, "replica_metrics", lambda servers: [next(reads)])
    assert sb.settled_metrics(None, quiet_s=0.25) == [{"a": 3.0}]
    ticks = iter(range(10_000))  # never settles: given up after the timeout, with the latest reading
    monkeypatch.setattr(sb, "replica_metrics", lambda servers: [{"a": float(next(ticks))}])
    started = time.monotonic()
    last = sb.settled_metrics(None, quiet_s=0.25, timeout_s=0.5)
    assert 0.5 <= time.monotonic() - started < 5 and last[0]["a"] >= 2


async def _rate_search_document():
    """What `tts-bench --rate-search` writes, made by tts-bench's own code: 1 and 2 req/s meet the bound, 4 misses
    it (first chunk p95 and a stalled stream), 3 meets it."""
    from ttsbench.ratesearch import ListenerBound, SearchSettings, search_rate
    from ttsbench.report import RateResult, RequestRecord, report_document, summarize_rate

    def step(rate):
        first, gap = (0.9, 1.0) if rate >= 4 else (0.1 * rate, 0.2)
        records = (RequestRecord("a", (first, first + gap), first + gap, 1.0, chunk_seconds=(0.5, 0.5)),
                   RequestRecord("b", (0.1, 0.3), 0.3, 1.0, chunk_seconds=(0.5, 0.5)))  # fmt: skip
        return summarize_rate(RateResult("triton/streaming", rate, 0, 2 / rate, 3.0, records, (0.001,), 2,
                                         window=(100.0 + rate, 101.0 + rate)))  # fmt: skip

    async def measure(rate):
        return step(rate)

    search = await search_rate(measure, SearchSettings(1.0, 0.5, 8.0, max_steps=4), ListenerBound(0.5))
    return report_document([], {}, rates=search.steps, rate_search=search.to_dict())


async def test_rate_rows_take_each_search_step_from_the_tts_bench_document():
    document = await _rate_search_document()
    rows = sb.rate_rows(document, 2, lambda window: None if window is None else window[0] / 1000)
    assert [(r["rate"], r["met"]) for r in rows] == [(1.0, True), (2.0, True), (4.0, False), (3.0, True)]
    four = rows[2]
    assert four["misses"] == ["1 stalled stream(s) (at chunk 2: 1)", "first chunk p95 860 ms > 500 ms"]
    assert (four["run"], four["requests"], four["errors"], four["streams"], four["stalled_streams"]) == (2, 2, 0, 2, 1)
    assert four["first_chunk_p95"] == pytest.approx(0.86) and four["achieved_rate"] == pytest.approx(4.0)
    assert four["gpu_busy"] == pytest.approx(0.104) and four["max_in_flight"] == 2
    assert four["send_lag_p99"] == pytest.approx(0.001) and four["audio_seconds_per_second"] == pytest.approx(2 / 3)
    assert document["rate_search"]["sustained_rate"] == 3.0


def test_the_sustained_open_loop_rate_is_the_lowest_runs():
    assert sb.sustained_open_loop_rate([]) is None
    assert sb.sustained_open_loop_rate([{"sustained_rate": 6.0}, {"sustained_rate": 4.5}]) == 4.5
    assert sb.sustained_open_loop_rate([{"sustained_rate": 6.0}, {"sustained_rate": None}]) == 0.0  # a run found none


async def test_summary_reports_the_sustained_open_loop_rate_and_every_step():
    rows = sb.rate_rows(await _rate_search_document(), 1, lambda window: 0.5)
    open_loop = {"scenario": "triton-stream", "search": {"start": 1.0, "low": 0.5}, "step_seconds": 20.0,
                 "runs": [{"run": 1, "sustained_rate": 3.0, "steps": rows}], "sustained_rate": 3.0}  # fmt: skip
    text = sb.summary_markdown([], "title", None, "unet", open_loop=open_loop)
    assert ("Sustained open-loop rate (triton-stream, Poisson arrivals: first chunk p95 <= 500 ms, no stall, no error, "
            "lowest over the runs): **3 req/s**") in text  # fmt: skip
    assert "each step 20 s of Poisson arrivals; grow x2 from 1 req/s" in text
    step_rows = [line for line in text.splitlines() if line.startswith("| 1 | ")]
    assert [line.split(" | ")[1] for line in step_rows] == ["1", "2", "4", "3"]
    assert step_rows[2].startswith("| 1 | 4 | 2 (0) | 4.00 | 500 | 820 | 860 | 892 | 50 | 0.7 | 2 | 50 | no: 1 stalled")
    assert step_rows[3].endswith("| yes |")
    none = sb.summary_markdown([], "title", None, "unet", open_loop={**open_loop, "sustained_rate": 0.0})
    assert "**none (below 0.5 req/s)**" in none
    assert "open-loop" not in sb.summary_markdown([], "title", None, "unet").lower()


# -- several tritonservers (--replicas) ---------------------------------------------------------------------------
def test_replica_metrics_add_up_and_the_stage_means_weigh_every_request():
    """Two replicas: one served 1 request (LLM step 10 ms), the other 3 (steps of 2 ms). The machine's mean is over
    all their steps, not the mean of the two replicas' means."""
    one = _scrape({("llm_steps_total", "engine"): 100, ("llm_step_seconds_total", "engine"): 1.0,
                   ("llm_step_sync_seconds_total", "engine"): 0.8, ("llm_yield_seconds_total", "engine"): 0.2,
                   ("llm_step_device_seconds_total", "engine"): 0.6,
                   ("llm_finished_total", "engine"): 1, ("llm_prefill_seconds_total", "engine"): 0.05})
    other = _scrape({("llm_steps_total", "engine"): 300, ("llm_step_seconds_total", "engine"): 0.6,
                     ("llm_step_sync_seconds_total", "engine"): 0.3, ("llm_step_device_seconds_total", "engine"): 0.24,
                     ("llm_finished_total", "engine"): 3, ("llm_prefill_seconds_total", "engine"): 0.03})
    machine = sb.sum_metrics([sb.parse_metrics(one), sb.parse_metrics(other)])
    assert machine == {"llm_steps_total": 400, "llm_step_seconds_total": pytest.approx(1.6),
                       "llm_step_sync_seconds_total": pytest.approx(1.1), "llm_yield_seconds_total": pytest.approx(0.2),
                       "llm_step_device_seconds_total": pytest.approx(0.84),
                       "llm_finished_total": 4, "llm_prefill_seconds_total": pytest.approx(0.08)}
    stages = sb.stage_breakdown({}, machine)
    assert stages["llm_step_ms"] == pytest.approx(4.0)  # 1.6 s / 400 steps; the replicas' means: 10 and 2 ms
    assert stages["llm_step_sync_ms"] == pytest.approx(2.75)  # of it, 1.1 s of waits for the tokens
    assert stages["llm_step_device_ms"] == pytest.approx(2.1)  # of those, 0.84 s of the steps' kernels
    assert stages["llm_yield_ms_per_step"] == pytest.approx(0.5)  # 0.2 s of waits for token2wav calls
    assert stages["llm_prefill_ms_per_request"] == pytest.approx(20.0)  # 80 ms / 4 requests
    assert stages["llm_steps"] == 400
    # first chunks: each replica's orchestrator counted its own; the machine's mean weighs each one's share
    first = [sb.parse_metrics(_scrape({("orchestrator_first_chunks_total", "cosyvoice2_stream"): n,
                                       ("orchestrator_first_chunk_send_seconds_total", "cosyvoice2_stream"): t}))
             for n, t in ((1, 0.1), (3, 0.03))]  # fmt: skip
    breakdown = sb.first_chunk_breakdown(sb.sum_metrics(first))
    assert breakdown["first_chunks"] == 4 and breakdown["first_chunk_send_ms"] == pytest.approx(32.5)
    assert sb.sum_metrics([]) == {}


def test_every_replicas_metrics_are_read_and_its_requests_counted(monkeypatch):
    pages = {"a": {"orchestrator_requests_total": 1.0}, "b": {"orchestrator_requests_total": 2.0, "y_total": 5.0}}
    monkeypatch.setattr(sb, "server_metrics", lambda server: pages[server])
    before = sb.replica_metrics(["a", "b"])
    assert before == [pages["a"], pages["b"]]
    assert sb.replica_requests(before, [{"orchestrator_requests_total": 4.0}, pages["b"]]) == [3.0, 0.0]


def test_replica_devices_give_each_server_one_device_and_refuse_what_makes_no_sense():
    no_count = lambda: None  # noqa: E731 - nothing tells how many GPUs there are
    assert sb.replica_devices(1, "cuda", {}) == []  # one server: it sees what this process sees
    assert sb.replica_devices(3, "cuda", {}, count_gpus=lambda: 4) == ["0", "1", "2"]
    assert sb.replica_devices(2, "cuda", {"CUDA_VISIBLE_DEVICES": "5,7,9"}) == ["5", "7"]  # the i-th visible
    assert sb.replica_devices(2, "cpu", {}, count_gpus=lambda: 0) == ["0", "1"]  # the CPU's
    assert sb.replica_devices(2, "cuda", {}, count_gpus=no_count) == ["0", "1"]
    with pytest.raises(SystemExit, match=re.escape("--replicas 2 needs 2 GPUs, one per tritonserver; this machine has 1")):
        sb.replica_devices(2, "cuda", {}, count_gpus=lambda: 1)
    with pytest.raises(SystemExit, match=re.escape("CUDA_VISIBLE_DEVICES='3' leaves 1")):
        sb.replica_devices(2, "cuda", {"CUDA_VISIBLE_DEVICES": "3"}, count_gpus=lambda: 8)


def test_the_sampled_gpus_are_the_replicas_as_the_machine_numbers_them():
    assert sb.sampled_gpu_indices([0, 1], {}) == [0, 1]
    assert sb.sampled_gpu_indices([0, 1], {"CUDA_VISIBLE_DEVICES": "4,6"}) == [4, 6]
    assert sb.sampled_gpu_indices([0], {"CUDA_VISIBLE_DEVICES": "GPU-1234abcd"}) is None  # by UUID: sample all


def test_summary_of_replicas_shows_the_machines_figures_per_gpu_too():
    rows = [_row(c, run=1, p90=0.3, total_p50=1.0, first_chunk_p50=0.2, first_chunk_p99=0.4, stalled_share=0.0,
                 stall_p90=0.0, stall_max=0.0, audio_seconds_per_second=20.0, gpu_busy=0.5,
                 gpu_busy_per_gpu={"0": 0.4, "1": 0.6}, stages={}) for c in (1, 8)]  # fmt: skip
    text = sb.summary_markdown(rows, "title", sb.realtime_streams(rows), "unet", replicas=2, gpus=2)
    assert ("replicas: **2** (2 tritonserver replicas (colocated, one per GPU) behind one round-robin target); "
            "GPUs used: **2**") in text
    assert "Real-time streams per machine" in text and "**8**; per GPU (2 used): **4**" in text
    busy = text.split("GPU busy, GPU by GPU", 1)[1]
    assert "| scenario | c | GPU 0 busy (%) | GPU 1 busy (%) |" in busy and "| triton-stream | 8 | 40 | 60 |" in busy
    open_loop = {"scenario": "triton-stream", "search": {"start": 1.0, "low": 0.5}, "step_seconds": 20.0,
                 "runs": [], "sustained_rate": 3.0}  # fmt: skip
    with_rate = sb.summary_markdown([], "title", None, "unet", open_loop=open_loop, replicas=2, gpus=2)
    assert "**3 req/s** per machine; per GPU (2 used): **1.5 req/s**" in with_rate


def test_least_busy_balance_reaches_the_triton_scenarios_only():
    from ttsbench.cli import build_parser as tts_parser

    balanced = {s.name: sb.balanced(s, "least-busy") for s in (*sb.SCENARIOS, *sb.WARMUP)}
    for scenario in (*sb.SCENARIOS, *sb.WARMUP):
        expected = (*scenario.extra, "--balance", "least-busy") if scenario.target == "triton" else scenario.extra
        assert balanced[scenario.name].extra == expected
        assert sb.balanced(scenario, "round-robin") == scenario
    command = ["triton", *balanced["triton-stream"].extra, "--mode", "streaming"]
    assert tts_parser().parse_args(command).balance == "least-busy"  # tts-bench takes what stack-bench passes
    text = sb.summary_markdown([], "title", None, "unet", replicas=2, gpus=2, balance="least-busy")
    assert "2 tritonserver replicas (colocated, one per GPU) behind one target, least-busy (tts-bench's pick)" in text


def test_one_grpc_target_names_every_replica():
    assert contract.grpc_target(["127.0.0.1:8001"]) == "127.0.0.1:8001"
    assert contract.grpc_target(["127.0.0.1:1", "127.0.0.1:2"]) == "ipv4:127.0.0.1:1,127.0.0.1:2"
    with pytest.raises(ValueError, match="no Triton address"):
        contract.grpc_target([])
    assert ("grpc.lb_policy_name", "round_robin") in contract.GRPC_CHANNEL_ARGS


def test_the_flow_padding_share_comes_from_the_frame_counters():
    before = {"token2wav_flow_frames_needed_total": 100.0, "token2wav_flow_frames_computed_total": 150.0}
    after = {"token2wav_flow_frames_needed_total": 400.0, "token2wav_flow_frames_computed_total": 550.0}
    assert sb.stage_breakdown(before, after)["token2wav_padded_share_pct"] == pytest.approx(25.0)
    assert sb.stage_breakdown({}, {})["token2wav_padded_share_pct"] is None  # an engine that does not count


def test_the_gc_pauses_of_a_level_add_up_every_model_process():
    """Each model process counts its own collections (`speech_serving.heap`); the level's are their sum."""
    before = {("python_gc_seconds_total", "cosyvoice2_stream"): 1.0, ("python_gc_seconds_total", "voice_prompt"): 0.5,
              ("python_gc_full_collections_total", "cosyvoice2_stream"): 3.0}
    level = {("python_gc_seconds_total", "cosyvoice2_stream"): 0.25, ("python_gc_seconds_total", "voice_prompt"): 0.05,
             ("python_gc_full_collections_total", "cosyvoice2_stream"): 2.0}
    stages = sb.stage_breakdown(sb.parse_metrics(_scrape(before)), sb.parse_metrics(_scrape(_after(level, before))))
    assert stages["python_gc_ms"] == pytest.approx(300.0)
    assert stages["python_gc_full_collections"] == 2.0
    none = sb.stage_breakdown({}, {})  # a server that does not count them
    assert none["python_gc_ms"] is None and none["python_gc_full_collections"] is None


#: A colocated level's LLM steps (the engine's counters): 400 steps in 1.0 s (0.6 s of it GPU waits), 100 of them
#: beside a token2wav call in 0.4 s (0.3 s of waits).
BESIDE_LEVEL = {("llm_steps_total", "cosyvoice2_stream"): 400, ("llm_step_seconds_total", "cosyvoice2_stream"): 1.0,
                ("llm_step_sync_seconds_total", "cosyvoice2_stream"): 0.6,
                ("llm_yield_seconds_total", "cosyvoice2_stream"): 0.0,
                ("llm_steps_beside_token2wav_total", "cosyvoice2_stream"): 100,
                ("llm_step_beside_token2wav_seconds_total", "cosyvoice2_stream"): 0.4,
                ("llm_step_beside_token2wav_sync_seconds_total", "cosyvoice2_stream"): 0.3}
#: What the stack had counted before the level.
BESIDE_BEFORE = {key: value / 2 for key, value in BESIDE_LEVEL.items()}


def test_the_llm_step_is_split_by_whether_a_token2wav_call_ran_beside_it():
    before = sb.parse_metrics(_scrape(BESIDE_BEFORE))
    stages = sb.stage_breakdown(before, sb.parse_metrics(_scrape(_after(BESIDE_LEVEL, BESIDE_BEFORE))))
    assert stages["llm_step_ms"] == pytest.approx(2.5)
    assert stages["llm_step_token2wav_idle_ms"] == pytest.approx(2.0)  # 0.6 s / 300 steps
    assert stages["llm_step_token2wav_idle_sync_ms"] == pytest.approx(1.0)  # 0.3 s / 300 steps
    assert stages["llm_step_beside_token2wav_ms"] == pytest.approx(4.0)  # 0.4 s / 100 steps
    assert stages["llm_step_beside_token2wav_sync_ms"] == pytest.approx(3.0)
    assert stages["llm_steps_beside_token2wav_pct"] == pytest.approx(25.0)
    from speech_serving.llm_scheduler import BESIDE_TOKEN2WAV_STATS

    assert {stat for stat, _ in BESIDE_LEVEL if "beside" in stat} == set(BESIDE_TOKEN2WAV_STATS)  # the LLM's names


SPLIT_KEYS = ("llm_step_token2wav_idle_ms", "llm_step_token2wav_idle_sync_ms", "llm_step_beside_token2wav_ms",
              "llm_step_beside_token2wav_sync_ms", "llm_steps_beside_token2wav_pct")


def test_the_split_is_na_without_its_counters_or_without_steps_on_a_side():
    # the single layout: the LLM does not see token2wav's calls, so nothing is split (not: every step idle)
    single = {key: value for key, value in BESIDE_LEVEL.items() if "beside" not in key[0]}
    stages = sb.stage_breakdown({}, sb.parse_metrics(_scrape(single)))
    assert stages["llm_step_ms"] == pytest.approx(2.5)
    assert all(stages[key] is None for key in SPLIT_KEYS)
    # no step beside a call: the idle mean is the step's, the beside means n/a
    none_beside = sb.stage_breakdown({}, sb.parse_metrics(_scrape({
        **single, ("llm_steps_beside_token2wav_total", "cosyvoice2_stream"): 0,
        ("llm_step_beside_token2wav_seconds_total", "cosyvoice2_stream"): 0,
        ("llm_step_beside_token2wav_sync_seconds_total", "cosyvoice2_stream"): 0})))
    assert none_beside["llm_step_token2wav_idle_ms"] == pytest.approx(2.5)
    assert none_beside["llm_step_beside_token2wav_ms"] is None and none_beside["llm_steps_beside_token2wav_pct"] == 0
    # every step beside a call: no idle mean
    all_beside = sb.stage_breakdown({}, {"llm_steps_total": 10.0, "llm_step_seconds_total": 0.03,
                                         "llm_step_sync_seconds_total": 0.0, "llm_yield_seconds_total": 0.0,
                                         "llm_steps_beside_token2wav_total": 10.0,
                                         "llm_step_beside_token2wav_seconds_total": 0.03})  # fmt: skip
    assert all_beside["llm_step_token2wav_idle_ms"] is None
    assert all_beside["llm_step_beside_token2wav_ms"] == pytest.approx(3.0)
    assert all_beside["llm_steps_beside_token2wav_pct"] == pytest.approx(100.0)
    # a level without LLM steps (none counted at all)
    assert all(sb.stage_breakdown({}, {})[key] is None for key in SPLIT_KEYS)


def test_the_stage_table_shows_the_split_and_na_where_there_is_none():
    split = sb.stage_breakdown({}, sb.parse_metrics(_scrape(BESIDE_LEVEL)))
    single = sb.stage_breakdown({}, {"llm_steps_total": 400.0, "llm_step_seconds_total": 1.0,
                                     "llm_step_sync_seconds_total": 0.6, "llm_yield_seconds_total": 0.0})
    measures = dict.fromkeys((key for _, key, *_ in sb.SUMMARY_COLUMNS), 0.5)
    rows = [_row(1, run=1, stages=split, **measures), _row(1, run=2, stages=single, **measures)]
    text = sb.summary_markdown(rows, "title", None, "unet")
    table = text.split("Per stage", 1)[1]
    header = next(line for line in table.splitlines() if line.startswith("| scenario")).split(" | ")
    titles = ("LLM step (ms)", "LLM step, token2wav idle (ms)", "LLM step beside token2wav (ms)",
              "steps beside token2wav (%)")
    cells = next(line for line in table.splitlines() if line.startswith("| triton-stream | 1 |")).split(" | ")
    assert [cells[header.index(title)] for title in titles] == [
        "2.50 / 2.50 (2.50–2.50)", "2.00 / n/a (2.00–2.00)", "4.00 / n/a (4.00–4.00)", "25 / n/a (25–25)"]


def test_each_replica_server_sees_its_own_device_and_all_are_started_and_stopped(tmp_path, monkeypatch):
    """The servers are replaced by recorders of what each was started with."""
    events: list[tuple[str, str]] = []
    monkeypatch.setattr(launch.TritonServer, "start", lambda server, ready_timeout: events.append(
        ("start", server.extra_env["CUDA_VISIBLE_DEVICES"])))
    monkeypatch.setattr(launch.TritonServer, "cleanup", lambda server: events.append(
        ("stop", server.extra_env["CUDA_VISIBLE_DEVICES"])))
    stack = launch.BenchStack(tmp_path / "repo", tmp_path, replica_devices=("0", "1"),
                              server_args=("--backend-config=python,thread-pool-size=128",))
    assert all(server.extra_args == ("--backend-config=python,thread-pool-size=128",) for server in stack.servers)
    stack.start_triton()
    assert events == [("start", "0"), ("start", "1")]  # one after the other
    assert stack.server_logs == [tmp_path / "tritonserver.log", tmp_path / "tritonserver-1.log"]
    stack.stop()
    assert events[2:] == [("stop", "0"), ("stop", "1")]


def _variant_args(*argv: str):
    from stackbench.cli import build_parser

    return build_parser().parse_args(list(argv))


def test_variants_put_their_items_on_top_of_the_command_line():
    from stackbench.cli import Variant, variants

    measured = variants(_variant_args("--render-arg", "first_hop=5", "--replicas", "2",
                                      "--variant", "first_hop=3 busy_streams=8", "--variant", "balance=least-busy"))
    assert measured == [
        Variant("base", ("first_hop=5",), "round-robin"),
        Variant("first_hop=3 busy_streams=8", ("first_hop=5", "first_hop=3", "busy_streams=8"), "round-robin"),
        Variant("balance=least-busy", ("first_hop=5",), "least-busy"),  # the base's render: one stack for both
    ]
    assert variants(_variant_args()) == [Variant("base", (), "round-robin")]


def test_a_server_log_that_says_a_model_runs_mixed_cuda_libraries_reaches_the_results(tmp_path):
    """The model processes' warning (`triton_repo.cuda_libraries`), as it lands in a tritonserver log, is what
    stack-bench puts beside its figures; a clean log gives none."""
    import logging

    from triton_repo.cuda_libraries import check_cuda_libraries

    wheel, system = "/opt/venv/site-packages/nvidia/cudnn/lib", "/usr/lib/x86_64-linux-gnu"
    maps = tmp_path / "maps"
    maps.write_text(f"7f00-7f01 r-xp 00000000 fd:01 1 {wheel}/libcudnn.so.9\n"
                    f"7f02-7f03 r-xp 00000000 fd:01 2 {system}/libcudnn_graph.so.9.14.0\n")
    log, clean = tmp_path / "tritonserver.log", tmp_path / "clean.log"
    clean.write_text("I1202 model loaded\n")
    logger = logging.getLogger("test-stack-bench-shadowed")
    handler = logging.FileHandler(log)
    logger.addHandler(handler)
    try:
        check_cuda_libraries(logger, maps)
    finally:
        logger.removeHandler(handler)
        handler.close()
    found = sb.shadowed_library_warnings([log, clean, tmp_path / "absent.log"])
    assert len(found) == 1 and "libcudnn (version 9)" in found[0] and system in found[0]
    assert sb.shadowed_library_warnings([clean]) == []


def test_render_items_set_the_cosyvoice3_and_spark_options_as_part_dot_field(tmp_path):
    from cosyvoice2.testing import write_tiny_model

    work = tmp_path / "work"
    common = {"work": work, "model_dir": write_tiny_model(tmp_path / "tiny"), "device": "cpu", "dtype": "fp32",
              "max_batch": 4, "max_seq_len": 512, "benchmark_speech_ratio": 0}  # fmt: skip
    cv3 = launch.ensure_cosyvoice3_dir(work, None, "cpu")
    options, _ = launch.render_stack(**common, cosyvoice3_dir=cv3, cosyvoice3_benchmark_ratio=1.0,
                                     render_args=("cosyvoice3.flow_cache=chunked", "cosyvoice3.first_hop=10",
                                                  "first_hop=20"))
    assert options.cosyvoice3.flow_cache == "chunked" and options.cosyvoice3.first_hop == 10
    assert options.first_hop == 20 and options.cosyvoice3.model_dir == cv3
    with pytest.raises(SystemExit, match=r"cosyvoice3\.flow_cache need --cosyvoice3"):
        launch.render_stack(**common, render_args=("cosyvoice3.flow_cache=chunked",))
    with pytest.raises(SystemExit, match=r"render item gateway\.port: only spark, cosyvoice3"):
        launch.render_stack(**common, render_args=("gateway.port=1",))
    # what has an option of its own is refused as a render item, nested or not
    for item, option in (("cosyvoice3.model_dir=/x", "--cosyvoice3-dir"), ("spark.benchmark_ratio=2",
                                                                          "--spark-benchmark-ratio")):
        with pytest.raises(SystemExit, match=option):
            sb.check_render_args([item], "--render-arg")
