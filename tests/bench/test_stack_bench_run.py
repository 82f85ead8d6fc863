"""`python -m stackbench` (stack-bench) end to end on the CPU: the tiny random model in a real tritonserver and a real
gateway, two runs of one streaming level per target. Checks what it wrote, never how fast anything was."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from triton_repo.server import REPO_ROOT

pytestmark = pytest.mark.triton


def tiny_run(work: Path, model: Path, *args: str) -> list[str]:
    """The stack-bench command of a short CPU run on the tiny model in `work` (no server warm-up), plus `args`."""
    return [sys.executable, "-m", "stackbench", "--work", str(work), "--model-dir", str(model), "--device", "cpu",
            "--dtype", "fp32", "--max-batch", "4", "--server-warmup", "0", "--timeout", "120", *args]


@pytest.mark.timeout(1200)  # a whole benchmark run: tritonserver and gateway start, four levels, two rate searches
def test_a_run_writes_every_result_into_its_own_fresh_directory(tmp_path):
    from cosyvoice2.testing import write_tiny_model

    model = write_tiny_model(tmp_path / "tiny")
    work = tmp_path / "work"
    (work / "results").mkdir(parents=True)
    (work / "results" / "earlier").mkdir()  # an earlier invocation's results stay as they are
    command = tiny_run(work, model, "--only", "triton-stream,gateway-stream-pcm", "--stream-levels", "1",
                       "--gateway-levels", "1", "--requests", "2", "--warmup", "0", "--repeat", "2",
                       "--render-arg", "first_hop=5",
                       # a short open-loop search after each run's levels: two steps of 2 s of arrivals
                       "--open-loop", "1", "--open-loop-min", "0.5", "--open-loop-max", "2",
                       "--open-loop-step-seconds", "2", "--open-loop-steps", "2")
    done = subprocess.run(command, capture_output=True, text=True, timeout=1100, cwd=REPO_ROOT)  # noqa: S603
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]

    printed = re.findall(r"^results: (.+)$", done.stdout, re.M)
    assert printed and len(set(printed)) == 1
    out = Path(printed[-1])
    assert out.parent == work / "results" and out.name.endswith("-cpu-fp32-b4-unet-first_hop5-triton-stream+gateway-stream-pcm-r2")
    assert sorted(p.name for p in (work / "results").iterdir()) == sorted(["earlier", out.name])
    names = {f"{s}-c1-r{r}" for s in ("triton-stream", "gateway-stream-pcm") for r in (1, 2)}
    assert {p.stem for p in (out / "levels").glob("*.json")} == names | {"open-loop-r1", "open-loop-r2"}
    assert "Started GRPCInferenceService" in (out / "tritonserver_tail.log").read_text()
    assert "Uvicorn running" in (out / "gateway_tail.log").read_text()

    results = json.loads((out / "results.json").read_text())
    rows = results["levels"]
    assert sorted((r["scenario"], r["run"]) for r in rows) == sorted(
        (s, r) for s in ("triton-stream", "gateway-stream-pcm") for r in (1, 2)
    )
    for row in rows:
        raw = json.loads((out / "levels" / f"{row['scenario']}-c1-r{row['run']}.json").read_text())["levels"][0]
        assert row["requests"] == raw["requests"] == 2
        assert row["first_chunk_p90"] == raw["first_chunk"]["p90"]
        assert row["streams"] == 2 - row["errors"] and row["stalled_streams"] == raw["stalls"]["stalled"]
    triton_rows = [r for r in rows if r["scenario"] == "triton-stream"]
    realtime = all(r["errors"] == 0 and r["first_chunk_p90"] <= 0.5 and r["stalled_streams"] == 0 for r in triton_rows)
    assert results["realtime_streams"] == results["realtime_streams_per_gpu"] == (1 if realtime else 0)
    assert (results["replicas"], results["gpus_used"], results["replica_devices"]) == (1, 1, [])
    assert set(json.loads((out / "stages.json").read_text())) >= names
    for row in rows:  # both scenarios stream through cosyvoice2_stream: each request's first chunk, stage by stage
        stages = row["stages"]
        counts = (stages["first_chunks"], stages["first_chunks_llm"], stages["first_chunks_token2wav"])
        assert counts == (row["requests"] - row["errors"],) * 3 and counts[0] > 0
        laid = [stages[f"first_chunk_{key}_ms"] for key in ("prompt", "llm_queue", "llm_prefill", "llm_decode",
                                                            "token2wav_queue", "token2wav_call", "send", "other")]
        assert sum(laid) == pytest.approx(stages["first_chunk_ms"]) and stages["first_chunk_other_ms"] >= 0

    # the open-loop search of each run: steps from its tts-bench document, each verdict the rule applied to them
    open_loop = results["open_loop"]
    assert open_loop["scenario"] == "triton-stream" and [r["run"] for r in open_loop["runs"]] == [1, 2]
    for run in open_loop["runs"]:
        raw = json.loads((out / "levels" / f"open-loop-r{run['run']}.json").read_text())
        steps = run["steps"]
        assert 1 <= len(steps) <= 2 and steps[0]["rate"] == 1.0
        assert [s["rate"] for s in steps] == [r["rate"] for r in raw["rates"]]
        for step, rate in zip(steps, raw["rates"], strict=True):
            assert rate["mode"] == "triton/streaming" and step["requests"] == rate["requests"] >= 1
            met = (step["errors"] == 0 and step["stalled_streams"] == 0 and step["first_chunk_p95"] is not None
                   and step["first_chunk_p95"] <= 0.5)  # fmt: skip
            assert step["met"] == met
        failed = [s["rate"] for s in steps if not s["met"]]
        passed = [s["rate"] for s in steps if s["met"] and (not failed or s["rate"] < min(failed))]
        assert run["sustained_rate"] == (max(passed) if passed else None)
    assert open_loop["sustained_rate"] == min(r["sustained_rate"] or 0.0 for r in open_loop["runs"])

    summary = (out / "summary.md").read_text()
    assert summary in done.stdout
    assert "Sustained open-loop rate (triton-stream, Poisson arrivals: first chunk p95 <= 500 ms" in summary
    assert len(re.findall(r"^\| [12] \| [\d.]+ \| \d+ \(\d+\) \|", summary, re.M)) == sum(
        len(r["steps"]) for r in open_loop["runs"])
    assert re.search(r"^\| triton-stream \| 1 \| 4 \(\d\) \| [\d.]+ / [\d.]+ \(", summary, re.M)
    assert re.search(r"^\| gateway-stream-pcm \| 1 \| 4 \(\d\) \|", summary, re.M)
    assert f"**{results['realtime_streams']}**; per GPU (1 used)" in summary
    assert re.search(r"^First chunk, stage by stage", summary, re.M)
    assert "token2wav: **unet**" in summary and results["token2wav"] == "unet" and results["dit_dir"] is None
    assert (results["pipeline"], results["spark_dir"]) == ("cosyvoice2", None)


@pytest.mark.timeout(1200)  # two tritonservers and a gateway start, two short levels
def test_replicas_serve_the_levels_together_behind_one_round_robin_target(tmp_path):
    """`--replicas 2` on the CPU: two tritonservers on one rendered repository, tts-bench and the gateway aimed at
    both through one `ipv4:a,b` target; each replica's own metrics show it served requests of every level."""
    from cosyvoice2.testing import write_tiny_model

    model = write_tiny_model(tmp_path / "tiny")
    work = tmp_path / "work"
    command = tiny_run(work, model, "--replicas", "2", "--only", "triton-stream,gateway-stream-pcm",
                       "--stream-levels", "2", "--gateway-levels", "2", "--requests", "4", "--warmup", "1",
                       "--render-arg", "first_hop=5")
    done = subprocess.run(command, capture_output=True, text=True, timeout=1100, cwd=REPO_ROOT)  # noqa: S603
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]

    out = Path(re.findall(r"^results: (.+)$", done.stdout, re.M)[-1])
    assert out.name.endswith("-cpu-fp32-b4-unet-first_hop5-triton-stream+gateway-stream-pcm-rep2-r1")
    results = json.loads((out / "results.json").read_text())
    assert (results["replicas"], results["gpus_used"], results["replica_devices"]) == (2, 2, ["0", "1"])
    addresses = re.fullmatch(r"ipv4:(127\.0\.0\.1:\d+),(127\.0\.0\.1:\d+)", results["grpc_target"])
    assert addresses and addresses[1] != addresses[2]
    for log in ("tritonserver_tail.log", "tritonserver-1_tail.log"):  # each replica's own log
        assert "Started GRPCInferenceService" in (out / log).read_text()

    rows = {row["scenario"]: row for row in results["levels"]}
    assert set(rows) == {"triton-stream", "gateway-stream-pcm"}
    for scenario, row in rows.items():
        assert (row["requests"], row["errors"]) == (4, 0), scenario
        served = row["replica_requests"]  # from each replica's own Triton metrics
        assert len(served) == 2 and all(n >= 1 for n in served), (scenario, served)
        # the level's stages come from both replicas' counters added up: at least every measured request's first
        # chunk (a warm-up request's counter may still be landing on a loaded machine: not an exact equality)
        assert row["stages"]["first_chunks"] >= row["requests"] and sum(served) >= row["requests"], scenario

    summary = (out / "summary.md").read_text()
    assert "replicas: **2** (2 tritonserver replicas (colocated, one per GPU) behind one round-robin target); " \
           "GPUs used: **2**" in summary
    realtime = results["realtime_streams"]
    assert results["realtime_streams_per_gpu"] == realtime / 2
    assert f"**{realtime}**; per GPU (2 used): **{realtime / 2:.3g}**" in summary


@pytest.mark.timeout(1200)  # two tritonservers start, two settings x two runs of one short level
def test_variants_are_measured_interleaved_each_on_its_own_render(tmp_path):
    """`--variant first_hop=6` beside the command's `first_hop=5`: two renders, two stacks up at once, run 1 of
    both settings before run 2 of either, each setting's documents in a directory of its own, and the side-by-side
    summary on top."""
    from cosyvoice2.testing import write_tiny_model

    model = write_tiny_model(tmp_path / "tiny")
    work = tmp_path / "work"
    command = tiny_run(work, model, "--only", "triton-stream", "--stream-levels", "1", "--requests", "2",
                       "--warmup", "0", "--repeat", "2", "--render-arg", "first_hop=5", "--variant", "first_hop=6")
    done = subprocess.run(command, capture_output=True, text=True, timeout=1100, cwd=REPO_ROOT)  # noqa: S603
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]

    out = Path(re.findall(r"^results: (.+)$", done.stdout, re.M)[-1])
    assert out.name.endswith("-first_hop5-triton-stream-2settings-r2")
    index = json.loads((out / "results.json").read_text())
    assert [(v["name"], v["render_args"], v["results"]) for v in index["variants"]] == [
        ("base", ["first_hop=5"], "0-base"), ("first_hop=6", ["first_hop=5", "first_hop=6"], "1-first_hop6")]
    windows = {}
    for variant, first_hop in (("0-base", "5"), ("1-first_hop6", "6")):
        results = json.loads((out / variant / "results.json").read_text())
        assert results["render"]["first_hop"] == first_hop  # the variant's item won over the command's
        assert [(r["run"], r["requests"], r["errors"]) for r in results["levels"]] == [(1, 2, 0), (2, 2, 0)]
        assert "Started GRPCInferenceService" in (out / variant / "tritonserver_tail.log").read_text()
        for run in (1, 2):
            level = json.loads((out / variant / "levels" / f"triton-stream-c1-r{run}.json").read_text())
            windows[(variant, run)] = level["levels"][0]["window"]
        own = (out / variant / "summary.md").read_text()
        assert own.startswith(f"# stack-bench {out.name}/{variant}\n") and re.search(r"^\| triton-stream \| 1 \| 4 \(0\) \|", own, re.M)
    # interleaved: base run 1, variant run 1, base run 2, variant run 2
    order = sorted(windows, key=lambda key: windows[key][0])
    assert order == [("0-base", 1), ("1-first_hop6", 1), ("0-base", 2), ("1-first_hop6", 2)]
    assert (work / "variants" / "0" / "repo").is_dir() and (work / "variants" / "1" / "repo").is_dir()

    summary = (out / "summary.md").read_text()
    assert re.search(r"^\| triton-stream \| 1 \| base \| 4 \(0\) \|", summary, re.M)
    assert re.search(r"^\| triton-stream \| 1 \| first_hop=6 \| 4 \(0\) \|", summary, re.M)
    assert "`1-first_hop6/summary.md`" in summary


def _rendered_parameters(config: Path) -> dict[str, str]:
    from google.protobuf import text_format
    from tritonclient.grpc import model_config_pb2

    parsed = text_format.Parse(config.read_text(), model_config_pb2.ModelConfig())
    return {key: value.string_value for key, value in parsed.parameters.items()}


@pytest.mark.timeout(900)  # tritonserver start and two measured levels
def test_a_dit_run_renders_the_dit_token2wav_and_is_named_after_it(tmp_path):
    from cosyvoice2.testing import write_tiny_model
    from cosyvoice2.testing.dit import write_dit_model

    model = write_tiny_model(tmp_path / "tiny")
    work = tmp_path / "work"
    # Without --dit-dir the run takes WORK/dit, written once (released size) and reused: a micro DiT placed there
    # keeps this CPU run short and exercises that default.
    dit_dir = write_dit_model(work / "dit", seed=1)
    command = tiny_run(work, model, "--token2wav", "dit", "--only", "triton-stream,triton-offline",
                       "--stream-levels", "1", "--offline-levels", "1", "--requests", "2", "--warmup", "0",
                       "--render-arg", "first_hop=5")
    done = subprocess.run(command, capture_output=True, text=True, timeout=850, cwd=REPO_ROOT)  # noqa: S603
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]

    out = Path(re.findall(r"^results: (.+)$", done.stdout, re.M)[-1])
    assert out.name.endswith("-cpu-fp32-b4-dit-first_hop5-triton-stream+triton-offline-r1")
    results = json.loads((out / "results.json").read_text())
    assert (results["token2wav"], results["dit_dir"]) == ("dit", str(dit_dir))
    assert (results["render"]["token2wav"], results["render"]["dit_dir"]) == ("dit", str(dit_dir))
    # what tritonserver actually loaded: the token2wav parameters of the one rendered model that runs token2wav
    (params,) = [found for config in sorted((work / "repo").glob("*/config.pbtxt"))
                 if "dit_dir" in (found := _rendered_parameters(config))]
    assert (params["token2wav"], params["dit_dir"]) == ("dit", str(dit_dir.resolve()))
    assert sorted(p.name for p in work.iterdir() if p.name.startswith("dit")) == ["dit"]  # nothing new written

    rows = results["levels"]
    assert sorted(r["scenario"] for r in rows) == ["triton-offline", "triton-stream"]
    for row in rows:  # the DiT token2wav served every request and made audio
        assert (row["requests"], row["errors"]) == (2, 0) and row["audio_seconds_per_second"] > 0
        assert row["stages"]["token2wav_calls"] > 0
    summary = (out / "summary.md").read_text()
    assert f"token2wav: **dit ({dit_dir})**" in summary and out.name in summary
    assert re.search(r"^\| triton-stream \| 1 \| 2 \(0\) \|", summary, re.M)
    assert re.search(r"^\| triton-offline \| 1 \| 2 \(0\) \|", summary, re.M)


SPARK_RATIO = 2.0
SPARK_SECONDS_PER_TOKEN = 320 / 16_000  # BiCodec: 320 samples of 16 kHz audio per semantic token


def _one_level_each(work: Path, model: Path, *pipeline: str) -> Path:
    """A CPU run of `pipeline`'s options: one streaming and one offline level of two requests; its results dir."""
    command = tiny_run(work, model, *pipeline, "--only", "triton-stream,triton-offline", "--stream-levels", "1",
                       "--offline-levels", "1", "--requests", "2", "--warmup", "0")
    done = subprocess.run(command, capture_output=True, text=True, timeout=1100, cwd=REPO_ROOT)  # noqa: S603
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return Path(re.findall(r"^results: (.+)$", done.stdout, re.M)[-1])


@pytest.mark.timeout(1200)
def test_a_spark_run_loads_the_spark_models_in_benchmark_mode(tmp_path):
    """`--spark`: the Spark pipeline in benchmark mode, offline and streaming; every response lasts exactly the
    configured semantic tokens per Spark text token, timed at the 16 kHz the responses state."""
    from cosyvoice2.testing import write_tiny_model
    from spark_tts.prompt import SparkTokenizer
    from spark_tts.testing import write_tiny_model as write_tiny_spark
    from ttsbench.sentences import SENTENCES

    model, work = write_tiny_model(tmp_path / "tiny"), tmp_path / "work"
    # Without --spark-dir the run takes WORK/spark-model, written once (released size) and reused: a tiny Spark
    # model placed there keeps this CPU run short and exercises that default.
    spark = write_tiny_spark(work / "spark-model", seed=2)
    out = _one_level_each(work, model, "--spark", "--spark-benchmark-ratio", str(SPARK_RATIO))
    assert re.search(r"Z-spark-tts-cpu-fp32-b4-triton-stream\+triton-offline-r1$", out.name)  # no token2wav in it
    results = json.loads((out / "results.json").read_text())
    assert (results["pipeline"], results["token2wav"], results["spark_dir"]) == ("spark-tts", None, str(spark))
    assert sorted(p.name for p in work.iterdir() if p.name.startswith("spark")) == ["spark-model"]  # nothing new
    summary = (out / "summary.md").read_text()
    assert "pipeline: **spark-tts**" in summary and "token2wav: **" not in summary  # Spark vocodes with its BiCodec
    assert sorted(r["scenario"] for r in results["levels"]) == ["triton-offline", "triton-stream"]
    tokenizer = SparkTokenizer.from_model_dir(spark)
    for scenario, mode in (("triton-stream", "streaming"), ("triton-offline", "offline")):
        (level,) = json.loads((out / "levels" / f"{scenario}-c1-r1.json").read_text())["levels"]
        assert level["mode"] == f"triton-spark-tts/{mode}" and level["errors"] == 0
        for record in level["records"]:
            text = SENTENCES[int(record["item_id"].rsplit("-", 1)[1])]
            tokens = max(1, round(SPARK_RATIO * len(tokenizer.encode(text))))
            assert record["audio_seconds"] == pytest.approx(tokens * SPARK_SECONDS_PER_TOKEN), (scenario, text)


COSYVOICE3_RATIO = 2.0
COSYVOICE3_SECONDS_PER_TOKEN = 0.04  # 25 speech tokens per second: 2 mel frames of 480 samples at 24 kHz each


@pytest.mark.timeout(1200)
def test_a_cosyvoice3_run_loads_the_cosyvoice3_models_in_benchmark_mode(tmp_path):
    """`--cosyvoice3` on the CPU: without --cosyvoice3-dir the tiny random CosyVoice3 is written under WORK; the
    CosyVoice3 pipeline in benchmark mode, offline and streaming; every response lasts exactly the configured speech
    tokens per CosyVoice3 text token, and the results say they are CosyVoice3's."""
    from cosyvoice2.testing import write_tiny_model
    from cosyvoice3.text import CosyVoice3Tokenizer
    from ttsbench.sentences import SENTENCES

    model, work = write_tiny_model(tmp_path / "tiny"), tmp_path / "work"
    out = _one_level_each(work, model, "--cosyvoice3", "--cosyvoice3-benchmark-ratio", str(COSYVOICE3_RATIO))
    assert re.search(r"Z-cosyvoice3-cpu-fp32-b4-triton-stream\+triton-offline-r1$", out.name)  # no token2wav in it
    cv3 = work / "cosyvoice3-tiny"
    results = json.loads((out / "results.json").read_text())
    assert (results["pipeline"], results["token2wav"], results["cosyvoice3_dir"]) == ("cosyvoice3", None, str(cv3))
    assert results["render"]["cosyvoice3"] != "None" and results["spark_dir"] is None
    summary = (out / "summary.md").read_text()
    assert "pipeline: **cosyvoice3** (every figure below is CosyVoice3's)" in summary and "token2wav: **" not in summary
    assert sorted(r["scenario"] for r in results["levels"]) == ["triton-offline", "triton-stream"]
    # the stage tables read CosyVoice3's counters (its engine counts like CosyVoice2's; CosyVoice2 stays idle), the
    # flow padding too (its batched solves' frames, counted by the DiT flow)
    stream = next(r["stages"] for r in results["levels"] if r["scenario"] == "triton-stream")
    assert stream["first_chunks"] == 2 and stream["llm_step_ms"] > 0 and stream["token2wav_call_ms"] > 0
    assert 0 <= stream["token2wav_padded_share_pct"] < 100
    tokenizer = CosyVoice3Tokenizer.from_model_dir(cv3)
    for scenario, mode in (("triton-stream", "streaming"), ("triton-offline", "offline")):
        (level,) = json.loads((out / "levels" / f"{scenario}-c1-r1.json").read_text())["levels"]
        assert level["mode"] == f"triton-cosyvoice3/{mode}" and level["errors"] == 0
        for record in level["records"]:
            text = SENTENCES[int(record["item_id"].rsplit("-", 1)[1])]
            tokens = max(1, round(COSYVOICE3_RATIO * len(tokenizer.encode(text))))
            assert record["audio_seconds"] == pytest.approx(tokens * COSYVOICE3_SECONDS_PER_TOKEN), (scenario, text)


def _processes_mentioning(text: str) -> list[int]:
    """Pids of the live processes whose command line contains `text` (Linux /proc)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            state = next((line for line in (entry / "status").read_text().splitlines() if line.startswith("State:")), "")
        except OSError:  # it ended meanwhile
            continue
        if text in cmdline and "zombie" not in state:
            found.append(int(entry.name))
    return found


@pytest.mark.timeout(600)
def test_sigterm_stops_the_tritonserver_it_started(tmp_path):
    """`timeout` or a cancelled job sends SIGTERM: stack-bench stops its tritonserver (a session of its own, which
    outlives a plain kill of the benchmark) before it exits."""
    import signal
    import time

    from cosyvoice2.testing import write_tiny_model

    model = write_tiny_model(tmp_path / "tiny")
    work = tmp_path / "work-sigterm"
    command = tiny_run(work, model, "--only", "triton-stream", "--stream-levels", "1", "--requests", "2",
                       "--warmup", "0", "--repeat", "100", "--render-arg", "first_hop=5")
    bench = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,  # noqa: S603
                             cwd=REPO_ROOT)
    try:
        seen = []
        for line in bench.stdout:  # type: ignore[union-attr]
            seen.append(line)
            if "tritonserver(s) ready" in line:
                break
        else:
            pytest.fail("stack-bench ended before its tritonserver was ready:\n" + "".join(seen[-40:]))
        servers = [pid for pid in _processes_mentioning(str(work)) if pid != bench.pid]
        assert servers, "no process of the started tritonserver found"
        bench.send_signal(signal.SIGTERM)
        rest, _ = bench.communicate(timeout=120)
        assert bench.returncode == 128 + signal.SIGTERM, "".join(seen[-20:]) + rest[-3000:]
        deadline = time.monotonic() + 10
        while (left := [pid for pid in servers if pid in _processes_mentioning(str(work))]) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not left, f"still running after stack-bench exited: {left}"
    finally:
        if bench.poll() is None:
            bench.kill()
            bench.wait()
