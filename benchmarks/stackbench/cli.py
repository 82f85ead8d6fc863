"""Whole-stack benchmark on one machine: rendered repository -> tritonserver + gateway -> `tts-bench` levels.

    stack-bench --stub-env .venv-stub --repeat 3 [--render-arg first_hop=15]   # or: python -m stackbench ...
    stack-bench --stub-env .venv-stub --repeat 3 --token2wav dit   # the DiT token2wav
    stack-bench --stub-env .venv-stub --spark [--spark-dir models/Spark-TTS-0.5B]
    stack-bench --stub-env .venv-stub --cosyvoice3 [--cosyvoice3-dir models/Fun-CosyVoice3-0.5B-2512]

(`scripts/gpu_setup.sh` prepares a CUDA machine and prints the exact command; docs/PERFORMANCE.md.)

Without `--model-dir` it writes released-size random weights once (`cosyvoice2.testing`), which is why
`--benchmark-speech-ratio` exists: random weights stop at random, so the stack is rendered to generate a fixed,
realistic number of speech tokens per text token. `--token2wav dit` renders the stack with the DiT token2wav
(docs/engine.md) instead of CosyVoice2's UNet flow; without `--dit-dir` it likewise writes a released-size random
DiT directory once (`cosyvoice2.testing.dit`, WORK/dit). Random weights are written into a sibling `.partial`
directory that is renamed when complete, so an interrupted write is redone, never taken for a model.

Each level (scenario x concurrency x run) is one `tts-bench` run; around it the Triton metrics are read (after it
once they stop changing; their deltas give the per-stage breakdown: LLM prefill and step (where the LLM sees its
process's token2wav calls, the colocated layout, also the step with token2wav idle and beside a call, and the share
of steps beside one), token2wav call; and for streaming levels the mean first chunk stage by stage: voice prompt,
LLM queue, prefill and decode, token2wav queue and call, send, and the other time they leave of the pipeline's
first-chunk time) and the GPU's utilization is
sampled every 200 ms (NVML through `pynvml` when importable, else `nvidia-smi`; n/a without a GPU). Per level it reports first chunk p50/p90/p99,
playback stalls, audio seconds per wall second and the GPU busy share; at the end the real-time streams (per
machine, and per GPU: divided by the GPUs used): the highest `triton-stream` concurrency whose first chunk p90 is
<= 500 ms with no stream stalling and no error, in every run. With `--open-loop START` each run also searches,
after its levels, the sustained open-loop rate: the highest rate of Poisson arrivals (requests sent when they arrive, however many are running: what a service facing
independent listeners sees) at which first chunk p95 is <= 500 ms with no stream stalling and no error (`tts-bench
--rate-search`: grow from START by x2 until a rate misses, then bisect; each step a fixed stretch of arrivals), and
reports the lowest over the runs. Every invocation writes a fresh directory WORK/results/<UTC time>-<settings>/ (or under --out; the
settings name the token2wav, e.g. cuda-bf16-b32-dit-r3, and the summary says it too): summary.md (the tables:
measures, stages, first chunk by stage), results.json (every level's measures, with its stages), stages.json (the
stages per level), levels/*.json (the raw `tts-bench` documents) and the tails of the tritonserver and gateway logs.

With `--replicas N` (N > 1) it starts N tritonservers on the same rendered repository, the colocated way: replica i
sees only GPU i (its CUDA_VISIBLE_DEVICES: the i-th device this process sees; with `--device cpu` they all share
the CPU), each on ports of its own. tts-bench then loads all of them through one round-robin gRPC target
(`ipv4:127.0.0.1:P1,127.0.0.1:P2`, the gateway's channel options), and so does the gateway (its `triton_url`):
what a Kubernetes headless Service in front of N Triton pods gives. The Triton metrics are every replica's added
up, the GPU busy share is sampled GPU by GPU (the summary shows each GPU when there are several), every per-level
figure is the machine's, and the summary divides the real-time streams and the open-loop rate by the GPUs used
(N).
Results directories of such runs are named with `rep<N>`; summary.md and results.json say how many replicas ran,
and every level in results.json has the requests each replica took (`replica_requests`, from its own counters).

With `--variant 'FIELD=VALUE ...'` (repeatable) one invocation measures several settings against each other: the
command line's own ("base") and each variant, whose render items go on top of the `--render-arg`s (`balance=...`
sets its `--balance`; variants that differ only in that share one stack). Every setting's stack is rendered into a
work directory of its own (WORK/variants/<i>); before the first level the stacks are started and warmed up one at a
time; then run 1 of every setting's levels, then run 2 of every setting, ...: interleaved runs of one machine state,
not one setting after another. Each setting writes its usual documents into RESULTS/<i>-<setting>/, and
RESULTS/summary.md puts the settings side by side, level by level (each cell every run and the spread). The stacks
that are not being measured sit idle meanwhile, holding their GPU memory: each stack's footprint (what its start and
warm-up added to the memory in use, per GPU it uses: `gpu_memory_footprint_bytes`) is read, and the next stack only
starts where the largest footprint so far, times a margin (FIT_MARGIN), is free on each of its GPUs; else the invocation
stops before it starts (and before any measured level), saying how many stacks fit. A warm-up level with any error
stops it too, naming the setting and whether its server log says the GPU ran out of memory.

With `--spark` the same levels load the Spark-TTS pipeline instead (`spark_tts` / `spark_tts_stream` through
`tts-bench --pipeline spark-tts`, the gateway's `model="spark-tts"`): the stack is rendered with `--spark-dir`
(default: released-size random Spark weights written once under WORK/spark-model, `spark_tts.testing`, the same
`.partial` way) beside CosyVoice2, and in benchmark mode with Spark's own ratio (`--spark-benchmark-ratio`:
semantic tokens, 50 per second, per token of Spark's tokenizer). Spark vocodes with its own BiCodec, so the
token2wav options do not apply: its results directories are named `spark-tts-<settings>` instead of after a
token2wav, its summary says `pipeline: spark-tts` and its documents `"pipeline": "spark-tts"`, so they never mix
with CosyVoice2 runs.

With `--cosyvoice3` they load the CosyVoice3 pipeline the same way (`cosyvoice3` / `cosyvoice3_stream` through
`tts-bench --pipeline cosyvoice3`, the gateway's `model="cosyvoice3"`): the stack is rendered with
`--cosyvoice3-dir` beside CosyVoice2 (default: random weights written once, `cosyvoice3.testing`, the same
`.partial` way: released-size dense ones under WORK/cosyvoice3-model with `--device cuda`, the tiny model under
WORK/cosyvoice3-tiny with `--device cpu`), in benchmark mode with CosyVoice3's own ratio
(`--cosyvoice3-benchmark-ratio`: speech tokens, 25 per second, per token of CosyVoice3's tokenizer). CosyVoice3
has its own DiT flow and causal HiFT, so the token2wav options do not apply either: results directories
`cosyvoice3-<settings>`, summary `pipeline: cosyvoice3` (it says every figure is CosyVoice3's), documents
`"pipeline": "cosyvoice3"`.

Options:
  --work DIR                    models, rendered repository and logs (default var/stackbench)
  --out DIR                     parent of the fresh results directories (default WORK/results)
  --model-dir DIR               real or random weights (default: released-size random weights under WORK)
  --token2wav NAME              unet (CosyVoice2's flow) or dit (the DiT flow) (default unet)
  --dit-dir DIR                 DiT token2wav directory, --token2wav dit only (default: released-size random under WORK)
  --device {cpu,cuda}           where the engine runs (default cuda)
  --dtype NAME                  LLM and flow dtype (default bf16)
  --max-batch N                 LLM batch slots (default: the render's, 64 for the PyTorch LLM on a GPU)
  --max-seq-len N               LLM sequence limit (default 2048)
  --benchmark-speech-ratio R    speech tokens per text token (0 = off, for real weights)
  --timeout S                   deadline of one request (default 120)
  --render-arg FIELD=VALUE      extra RenderOptions field, repeatable (first_hop=15, layout=single; with --spark or
                                --cosyvoice3 their own as PART.FIELD: cosyvoice3.flow_cache=chunked)
  --requests N                  measured requests per level (at least 2 per worker)
  --only NAMES                  comma-separated scenarios (default: all)
  --stream-levels LIST          triton-stream concurrencies (default 1,4,16,32,64)
  --offline-levels LIST         triton-offline concurrencies (default 32,64)
  --gateway-levels LIST         concurrencies of the gateway scenarios (default 1)
  --repeat N                    runs of every level (default 1; 3 for published numbers)
  --server-warmup N             unmeasured requests before the first level, at the largest level's concurrency (default 48)
  --warmup N                    unmeasured requests per worker before each level (default 2)
  --stub-env DIR                Python environment of the Triton python stubs (numpy < 2; default: this one)
  --spark                       benchmark the Spark-TTS pipeline instead of CosyVoice2
  --spark-dir DIR               Spark weights (default: released-size random weights under WORK)
  --spark-benchmark-ratio R     semantic tokens per Spark text token (0 = off, for real weights)
  --cosyvoice3                  benchmark the CosyVoice3 pipeline instead of CosyVoice2
  --cosyvoice3-dir DIR          CosyVoice3 weights (default: random weights under WORK, released size on cuda)
  --cosyvoice3-benchmark-ratio R  speech tokens per CosyVoice3 text token (0 = off, for real weights)
  --open-loop START             also search the sustained open-loop rate from START requests/s, each run (default: off)
  --open-loop-scenario NAME     the streaming scenario the search loads (default triton-stream)
  --open-loop-min R             lowest rate the search may try, requests/s (default 0.25)
  --open-loop-max R             highest rate the search may try, requests/s (default 64)
  --open-loop-step-seconds S    arrivals offered per search step (default 30)
  --open-loop-steps N           most rates one search measures (default 8)
  --replicas N                  tritonservers on the same colocated repository, replica i on GPU i (default 1)
  --balance round-robin|least-busy  how tts-bench spreads the Triton scenarios' requests over the replicas: the
                                target's round robin, as the gateway (default round-robin), or each to the server with
                                the fewest of the run's requests in flight
  --variant 'FIELD=VALUE ...'   another setting measured beside the command's own, repeatable (render items; balance=...)
  --server-arg ARG              an extra tritonserver argument, repeatable (named in the results directory)
  --stacks-when-slow MS         py-spy dumps of every tritonserver process into RESULTS/stacks/ when a second's
                                mean LLM step passes MS ms (stackbench.stacks; at most every 20 s; py-spy on PATH)
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, replace
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from cosyvoice2.dit.loading import check_dit_dir
from stackbench.launch import (
    SPARK_TOKENS_PER_CHAR,
    SPEECH_TOKENS_PER_CHAR,
    BenchStack,
    ensure_cosyvoice3_dir,
    ensure_dit_dir,
    ensure_model_dir,
    ensure_spark_dir,
    render_fields,
    render_stack,
)
from triton_repo.cuda_libraries import SHADOWED_MARK
from triton_repo.render import TOKEN2WAVS
from stackbench.stacks import SlowStacks
from stackbench.timeline import MetricsTimeline
from triton_repo.server import REPO_ROOT, TritonServer, stop_process
from ttsbench.cli import DEFAULT_RATE_BOUNDS, concurrency_list, positive_rate
from ttsbench.targets import BALANCES
from ttsbench.ratesearch import ListenerBound, SearchSettings, SearchSettingsError

#: Real time for a listener: the first audio within this p90, and no stream running dry afterwards.
REALTIME_FIRST_CHUNK_P90_S = 0.5
#: The scenario whose levels decide the real-time streams (the pipeline itself, no HTTP encoding).
REALTIME_SCENARIO = "triton-stream"
GPU_SAMPLE_INTERVAL_S = 0.2
#: After a level the Triton metrics are read once they have not changed for this long (each model publishes a change
#: within 100 ms, `MetricsExporter.PERIOD_S`, unless its process waits for the CPU), at most METRICS_SETTLE_MAX_S:
#: the last requests' counters belong in this level's deltas, not the next level's.
METRICS_SETTLE_S = 0.5
METRICS_SETTLE_MAX_S = 10.0
LOG_TAIL_LINES = 400
#: RenderOptions fields that have options of their own (they name the results): not accepted as --render-arg.
OWN_OPTIONS = {"token2wav": "--token2wav", "dit_dir": "--dit-dir", "spark": "--spark", "cosyvoice3": "--cosyvoice3",
               "max_batch": "--max-batch", "max_seq_len": "--max-seq-len", "device": "--device", "dtype": "--dtype",
               "model_dir": "--model-dir", "out": "--work", "benchmark_speech_ratio": "--benchmark-speech-ratio",
               "spark.model_dir": "--spark-dir", "spark.benchmark_ratio": "--spark-benchmark-ratio",
               "cosyvoice3.model_dir": "--cosyvoice3-dir",
               "cosyvoice3.benchmark_ratio": "--cosyvoice3-benchmark-ratio"}
#: The pipeline `--spark` loads: tts-bench's `--pipeline` for Triton, the gateway's model name.
SPARK_PIPELINE = "spark-tts"
#: The pipeline `--cosyvoice3` loads (the same two names).
COSYVOICE3_PIPELINE = "cosyvoice3"
#: The model each pipeline other than CosyVoice2 runs, as the summary names whose figures it shows.
PIPELINE_MODELS = {SPARK_PIPELINE: "Spark-TTS", COSYVOICE3_PIPELINE: "CosyVoice3"}
#: The open-loop rule: the first audio within this p95 for requests arriving at random, no stall, no error.
OPEN_LOOP_BOUND = ListenerBound(first_chunk_p95=0.5)
#: The next stack starts only where the largest footprint so far (start and warm-up), times this, is free on each GPU
#: it uses: its warm-up may reach a little further than the one measured (other shapes, the allocator's rounding).
FIT_MARGIN = 1.1
#: What a server log says when a model ran out of GPU memory (PyTorch's message, its exception's name).
OUT_OF_MEMORY_MARKS = ("CUDA out of memory", "OutOfMemoryError")
#: The way out of a GPU too small for every setting's stack at once.
FEWER_STACKS = ("measure fewer --variant settings per invocation, or fewer levels or a lower concurrency (the "
                "warm-up runs at the largest level's)")
GIB = 2**30


@dataclass(frozen=True)
class Scenario:
    name: str
    target: str  # "triton" | "gateway"
    mode: str  # "streaming" | "offline"
    #: Which option gives this scenario's concurrency levels.
    levels_option: str
    extra: tuple[str, ...] = ()


SCENARIOS = (
    Scenario("triton-stream", "triton", "streaming", "stream_levels"),
    Scenario("triton-offline", "triton", "offline", "offline_levels"),
    Scenario("gateway-stream-pcm", "gateway", "streaming", "gateway_levels"),
    Scenario("gateway-offline-pcm", "gateway", "offline", "gateway_levels"),
    Scenario("gateway-stream-mp3", "gateway", "streaming", "gateway_levels", ("--response-format", "mp3")),
)

WARMUP = (Scenario("warmup-stream", "triton", "streaming", ""), Scenario("warmup-offline", "triton", "offline", ""))
WARMUP_CONCURRENCY = 8


# Triton metrics -> stage breakdown ----------------------------------------------------------------


def replica_metrics(servers: Sequence[TritonServer]) -> list[dict[str, float]]:
    """Each server's `server_metrics`, in the servers' order."""
    return [server_metrics(server) for server in servers]


def server_metrics(server: TritonServer) -> dict[str, float]:
    """stat name -> value of every `cosyvoice2_*` metric of one server (`parse_metrics`)."""
    return parse_metrics(urllib.request.urlopen(server.metrics_url).read().decode())  # noqa: S310


def sum_metrics(parts: Iterable[dict[str, float]]) -> dict[str, float]:
    """The metrics of several servers (the replicas behind one target) as one machine's: every counter and sum
    added up. The breakdowns divide a sum's delta by its count's delta, so they stay means over every request of
    the machine (weighted by each replica's share), never means of the replicas' means."""
    out: dict[str, float] = {}
    for part in parts:
        for name, value in part.items():
            out[name] = out.get(name, 0.0) + value
    return out


def settled_metrics(servers: Sequence[TritonServer], quiet_s: float = METRICS_SETTLE_S,
                    timeout_s: float = METRICS_SETTLE_MAX_S) -> list[dict[str, float]]:
    """`replica_metrics` once they have stayed unchanged for ``quiet_s`` (or after ``timeout_s``)."""
    deadline = time.monotonic() + timeout_s
    current, since = replica_metrics(servers), time.monotonic()
    while time.monotonic() < deadline:
        time.sleep(0.1)
        latest = replica_metrics(servers)
        if latest != current:
            current, since = latest, time.monotonic()
        elif time.monotonic() - since >= quiet_s:
            break
    return current


def parse_metrics(text: str) -> dict[str, float]:
    """stat name -> value of every `cosyvoice2_*` metric in a Prometheus text, summed over models (stat names are
    unique per family)."""
    out: dict[str, float] = {}
    for name, value in re.findall(r'^cosyvoice2_(\w+)\{[^}]*\} (\S+)$', text, re.M):
        out[name] = out.get(name, 0.0) + float(value)
    return out


#: A first chunk's way through the stack (docs/PERFORMANCE.md#what-is-measured): the orchestrator's stages laid end
#: to end, each with the stages the layer it waits for measured inside it, as (orchestrator stage, the layer's
#: count, ((breakdown key, the layer's counter), ...)). Every sum is divided by its own layer's count.
FIRST_CHUNK_SEGMENTS: tuple[tuple[str, str | None, tuple[tuple[str, str], ...]], ...] = (
    ("prompt", None, ()),
    ("tokens", "llm_first_chunks_total", (
        ("llm_queue", "llm_first_chunk_wait_seconds_total"),
        ("llm_prefill", "llm_first_chunk_prefill_seconds_total"),
        ("llm_decode", "llm_first_chunk_decode_seconds_total"),
    )),
    ("audio", "token2wav_first_chunks_total", (
        ("token2wav_queue", "token2wav_first_chunk_wait_seconds_total"),
        ("token2wav_call", "token2wav_first_chunk_call_seconds_total"),
    )),
    ("send", None, ()),
)  # fmt: skip
FIRST_CHUNKS = "orchestrator_first_chunks_total"


def first_chunk_breakdown(d: dict[str, float]) -> dict[str, float | None]:
    """The mean first chunk of a level's streaming requests (``d``: the counters' deltas), in ms, stage by stage.

    ``first_chunk_ms`` is the orchestrator's first-chunk time (arrival -> first response sent), the sum of its
    stages ``first_chunk_{prompt,tokens,audio,send}_ms``. Inside `tokens` and `audio` the LLM's and token2wav's own
    stages (queue, prefill, decode; queue, call) replace them where that layer counted first chunks (not with
    TensorRT-LLM or Spark's vocoder: then those stages are None); ``first_chunk_other_ms`` is what the stages leave
    of the first-chunk time: IPC, gRPC, the hand-overs between processes and threads. All None without streaming
    requests. ``first_chunks``, ``first_chunks_llm``, ``first_chunks_token2wav``: each layer's count (equal when every
    layer saw every request's first chunk)."""
    count = d.get(FIRST_CHUNKS) or 0.0
    out: dict[str, float | None] = {"first_chunks": count}
    keys = ["first_chunk_ms", "first_chunk_other_ms", "first_chunk_llm_decode_steps", "first_chunk_token2wav_rows",
            "first_chunks_llm", "first_chunks_token2wav"]
    keys += [f"first_chunk_{segment}_ms" for segment, _, _ in FIRST_CHUNK_SEGMENTS]
    keys += [f"first_chunk_{key}_ms" for _, _, stages in FIRST_CHUNK_SEGMENTS for key, _ in stages]
    out.update(dict.fromkeys(keys))
    if not count:
        return out
    total = placed = 0.0
    for segment, layer_count, stages in FIRST_CHUNK_SEGMENTS:
        ms = 1000.0 * d.get(f"orchestrator_first_chunk_{segment}_seconds_total", 0.0) / count
        out[f"first_chunk_{segment}_ms"] = ms
        total += ms
        n = d.get(layer_count) if layer_count else None
        if not n:  # no breakdown inside: the orchestrator's stage is the stage
            placed += ms
            continue
        out[f"first_chunks_{layer_count.split('_')[0]}"] = n  # = first_chunks, or the layer missed some
        for key, counter in stages:
            out[f"first_chunk_{key}_ms"] = value = 1000.0 * d.get(counter, 0.0) / n
            placed += value
        if segment == "tokens":
            out["first_chunk_llm_decode_steps"] = d.get("llm_first_chunk_steps_total", 0.0) / n
        else:
            out["first_chunk_token2wav_rows"] = d.get("token2wav_first_chunk_rows_total", 0.0) / n
    out["first_chunk_ms"] = total
    out["first_chunk_other_ms"] = total - placed
    return out


#: The counter of the requests a server's pipeline models took (offline and streaming, every pipeline).
REQUESTS_COUNTER = "orchestrator_requests_total"


def replica_requests(before: Sequence[dict[str, float]], after: Sequence[dict[str, float]]) -> list[float]:
    """The requests each replica's pipeline took between two `replica_metrics` readings (how the target spread
    them)."""
    return [a.get(REQUESTS_COUNTER, 0.0) - b.get(REQUESTS_COUNTER, 0.0) for b, a in zip(before, after, strict=True)]


def padded_share(d: dict[str, float], needed: str, computed: str) -> float | None:
    """The share (%) of `computed` that was not `needed` (padding), from counter deltas; None: not counted."""
    return 100.0 * (1.0 - d.get(needed, 0.0) / d[computed]) if d.get(computed) else None


def beside_token2wav_breakdown(d: dict[str, float]) -> dict[str, float | None]:
    """The LLM steps split by whether a token2wav call ran beside them (`llm_scheduler.BESIDE_TOKEN2WAV_STATS`:
    the colocated engine's LLM sees its process's token2wav calls), from counter deltas: the mean step and its GPU
    wait with token2wav idle and beside a call, and the share of steps beside one (%). None where the counters are
    absent (no token2wav calls seen: the single layout, TensorRT-LLM) or a mean has no step."""
    seen = "llm_steps_beside_token2wav_total" in d
    steps, beside_steps = d.get("llm_steps_total", 0.0), d.get("llm_steps_beside_token2wav_total", 0.0)
    beside_s = d.get("llm_step_beside_token2wav_seconds_total", 0.0)
    beside_sync_s = d.get("llm_step_beside_token2wav_sync_seconds_total", 0.0)

    def per_step_ms(seconds: float, count: float) -> float | None:
        return 1000.0 * seconds / count if seen and count else None

    return {
        "llm_step_token2wav_idle_ms": per_step_ms(d.get("llm_step_seconds_total", 0.0) - beside_s,
                                                  steps - beside_steps),
        "llm_step_token2wav_idle_sync_ms": per_step_ms(d.get("llm_step_sync_seconds_total", 0.0) - beside_sync_s,
                                                       steps - beside_steps),
        "llm_step_beside_token2wav_ms": per_step_ms(beside_s, beside_steps),
        "llm_step_beside_token2wav_sync_ms": per_step_ms(beside_sync_s, beside_steps),
        "llm_steps_beside_token2wav_pct": 100.0 * beside_steps / steps if seen and steps else None,
    }


def stage_breakdown(before: dict[str, float], after: dict[str, float]) -> dict[str, float | None]:
    """Per-stage means over one level, from the counters' deltas (the first chunks': `first_chunk_breakdown`; the
    LLM steps beside token2wav calls: `beside_token2wav_breakdown`)."""
    d = {k: after[k] - before.get(k, 0.0) for k in after}

    def ratio(num: str, den: str, scale: float = 1000.0) -> float | None:  # None: no count, or a server without num
        return scale * d[num] / d[den] if d.get(den) and num in d else None

    return {
        "llm_prefill_ms_per_request": ratio("llm_prefill_seconds_total", "llm_finished_total"),
        "llm_step_ms": ratio("llm_step_seconds_total", "llm_steps_total"),
        # of the step, the host's wait for its tokens (the GPU's part; the rest is host work)
        "llm_step_sync_ms": ratio("llm_step_sync_seconds_total", "llm_steps_total"),
        # of that wait, the span of the step's kernels on the GPU (the rest: the step began late)
        "llm_step_device_ms": ratio("llm_step_device_seconds_total", "llm_steps_total"),
        # the waits for a running token2wav call before a step (llm_yield=lone), per step
        "llm_yield_ms_per_step": ratio("llm_yield_seconds_total", "llm_steps_total"),
        "llm_steps": d.get("llm_steps_total"),
        **beside_token2wav_breakdown(d),
        "token2wav_call_ms": ratio("token2wav_engine_seconds_total", "token2wav_engine_calls_total"),
        "token2wav_chunks_per_call": ratio("token2wav_call_jobs_total", "token2wav_engine_calls_total", 1.0),
        "token2wav_calls": d.get("token2wav_engine_calls_total"),
        # streams whose flow caches met the budget in this level (they recompute the frames since then)
        "token2wav_flow_cache_refused": d.get("token2wav_flow_cache_refused_total"),
        "token2wav_cuda_alloc_retries": d.get("token2wav_cuda_alloc_retries_total"),
        # the model processes' garbage collections in this level, every process added up: each stopped its
        # process's threads (`speech_serving.heap`)
        "python_gc_ms": None if "python_gc_seconds_total" not in d else 1000.0 * d["python_gc_seconds_total"],
        "python_gc_full_collections": d.get("python_gc_full_collections_total"),
        # the share of the flow estimator's frames that were padding (graph buckets); None: not counted
        "token2wav_padded_share_pct": padded_share(d, "token2wav_flow_frames_needed_total",
                                                   "token2wav_flow_frames_computed_total"),
        **first_chunk_breakdown(d),
    }


# GPU busy share ------------------------------------------------------------------------------------


def visible_gpu_indices(environ: dict[str, str]) -> list[int] | None:
    """The physical GPU indices CUDA_VISIBLE_DEVICES names, or None for all GPUs (unset, or given as UUIDs)."""
    value = environ.get("CUDA_VISIBLE_DEVICES", "").strip()
    if not value or not all(part.strip().isdigit() for part in value.split(",")):
        return None
    return [int(part) for part in value.split(",")]


def nvml_handles(indices: Sequence[int] | None) -> tuple[Any, list[Any]] | None:
    """(pynvml, a handle per GPU in ``indices`` or per GPU when None), or None when NVML is not there."""
    found = nvml_gpus(indices)
    return None if found is None else (found[0], [handle for _, handle in found[1]])


def nvml_gpus(indices: Sequence[int] | None) -> tuple[Any, list[tuple[int, Any]]] | None:
    """(pynvml, (index, handle) per GPU in ``indices`` or per GPU when None), or None when NVML is not there."""
    try:
        import pynvml  # noqa: PLC0415 - optional

        pynvml.nvmlInit()
        chosen = indices if indices is not None else range(pynvml.nvmlDeviceGetCount())
        return pynvml, [(i, pynvml.nvmlDeviceGetHandleByIndex(i)) for i in chosen]
    except Exception:  # noqa: BLE001 - not installed, no driver, no GPU: fall back
        return None


def gpu_count() -> int | None:
    """How many GPUs this machine has (NVML, else `nvidia-smi -L`), None when neither can tell."""
    found = nvml_gpus(None)
    if found is not None:
        return len(found[1])
    if (smi := shutil.which("nvidia-smi")) is None:
        return None
    try:
        listed = subprocess.run([smi, "-L"], capture_output=True, text=True, timeout=10, check=True).stdout  # noqa: S603
    except (OSError, subprocess.SubprocessError):
        return None
    return sum(1 for line in listed.splitlines() if line.startswith("GPU "))


class GpuSampler:
    """Utilization (percent of the time a kernel ran) of the visible GPUs every 200 ms, in a background thread.

    NVML through `pynvml` when it imports and initializes, else a long-running `nvidia-smi -lms`; with
    neither, ``source`` is None and every busy share is n/a. Samples are (wall-clock time, percent), one
    per GPU per tick, in ``samples`` (all GPUs) and ``per_gpu`` (by GPU index). ``indices``: the GPUs to sample
    (default: those CUDA_VISIBLE_DEVICES names, or all).
    """

    def __init__(self, interval: float = GPU_SAMPLE_INTERVAL_S, environ: dict[str, str] | None = None,
                 indices: Sequence[int] | None = None) -> None:  # fmt: skip
        self.interval = interval
        self.indices = list(indices) if indices is not None else visible_gpu_indices(
            dict(os.environ) if environ is None else environ)
        self.samples: list[tuple[float, float]] = []
        self.per_gpu: dict[int, list[tuple[float, float]]] = {}
        self.source: str | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._proc: subprocess.Popen | None = None

    def start(self) -> GpuSampler:
        poll = self._nvml_poller()
        if poll is not None:
            self.source = "nvml"
            self._thread = threading.Thread(target=self._run_nvml, args=(poll,), daemon=True)
        elif (smi := shutil.which("nvidia-smi")) is not None:
            command = [smi, "--query-gpu=index,utilization.gpu", "--format=csv,noheader,nounits",
                       f"-lms={round(self.interval * 1000)}"]  # fmt: skip
            if self.indices is not None:
                command.append(f"--id={','.join(map(str, self.indices))}")
            try:
                self._proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)  # noqa: S603
            except OSError:
                return self
            self.source = "nvidia-smi"
            self._thread = threading.Thread(target=self._run_smi, daemon=True)
        if self._thread is not None:
            self._thread.start()
        return self

    def _nvml_poller(self) -> Callable[[], list[tuple[int, float]]] | None:
        nvml = nvml_gpus(self.indices)
        if nvml is None:
            return None
        pynvml, gpus = nvml
        return lambda: [(i, float(pynvml.nvmlDeviceGetUtilizationRates(h).gpu)) for i, h in gpus]

    def _add(self, now: float, gpu: int, value: float) -> None:
        self.samples.append((now, value))
        self.per_gpu.setdefault(gpu, []).append((now, value))

    def _run_nvml(self, poll: Callable[[], list[tuple[int, float]]]) -> None:
        while not self._stop.wait(self.interval):
            try:
                values = poll()
            except Exception:  # noqa: BLE001 - a failed read is a missing sample, not a failed benchmark
                continue
            now = time.time()
            for gpu, value in values:
                self._add(now, gpu, value)

    def _run_smi(self) -> None:
        assert self._proc is not None and self._proc.stdout is not None
        for line in self._proc.stdout:
            index, _, value = line.partition(",")
            try:
                gpu, percent = int(index), float(value)
            except ValueError:  # "[N/A]" or a message: no sample
                continue
            self._add(time.time(), gpu, percent)

    def stop(self) -> None:
        self._stop.set()
        if self._proc is not None:
            stop_process(self._proc, 5)
        if self._thread is not None:
            self._thread.join(5)

    def busy_share(self, window: Sequence[float] | None) -> float | None:
        """Mean utilization over every sampled GPU."""
        return busy_share(self.samples, window)

    def busy_per_gpu(self, window: Sequence[float] | None) -> dict[str, float | None]:
        """GPU index (as a string: a JSON key) -> its own busy share; empty without samples."""
        return {str(gpu): busy_share(samples, window) for gpu, samples in sorted(self.per_gpu.items())}


class GpuMemory:
    """Memory in use and in all (bytes) on each visible GPU, read when asked: NVML through `pynvml` when it imports
    and initializes, else one `nvidia-smi` call per reading; with neither (or a reading that fails), ``source`` is
    None and ``used`` and ``total`` return None. Used memory counts every process on the GPU, as `nvidia-smi` shows
    it. ``indices``: the GPUs to read (default: those CUDA_VISIBLE_DEVICES names, or all)."""

    def __init__(self, environ: dict[str, str] | None = None, indices: Sequence[int] | None = None) -> None:
        self.indices = list(indices) if indices is not None else visible_gpu_indices(
            dict(os.environ) if environ is None else environ)
        self.source: str | None = None
        self._read: Callable[[str], list[int]] | None = None  # "used" or "total": NVML's and nvidia-smi's name
        nvml = nvml_handles(self.indices)
        if nvml is not None:
            pynvml, handles = nvml
            self.source = "nvml"
            self._read = lambda what: [int(getattr(pynvml.nvmlDeviceGetMemoryInfo(h), what)) for h in handles]
        elif (smi := shutil.which("nvidia-smi")) is not None:
            command = [smi, "--format=csv,noheader,nounits"]
            if self.indices is not None:
                command.append(f"--id={','.join(map(str, self.indices))}")
            self.source = "nvidia-smi"
            self._read = lambda what: self._smi([*command, f"--query-gpu=memory.{what}"])
        if self.source is not None and self.used() is None:  # e.g. nvidia-smi without a driver
            self.source, self._read = None, None

    @staticmethod
    def _smi(command: list[str]) -> list[int]:
        out = subprocess.run(command, capture_output=True, text=True, timeout=10, check=True).stdout  # noqa: S603
        return [int(float(line)) * 2**20 for line in out.split()]  # MiB

    def _reading(self, what: str) -> list[int] | None:
        if self._read is None:
            return None
        try:
            values = self._read(what)
        except Exception:  # noqa: BLE001 - a failed read is a missing sample, which the caller reports
            return None
        return values or None

    def used(self) -> list[int] | None:
        return self._reading("used")

    def total(self) -> list[int] | None:
        return self._reading("total")


def gib(values: Iterable[int]) -> str:
    """Byte counts as GiB, e.g. "52.0, 51.6 GiB"."""
    return ", ".join(f"{value / GIB:.1f}" for value in values) + " GiB"


class StackFit:
    """Whether one more stack fits on the GPUs it uses: each stack's footprint (what its start and warm-up added to
    the memory in use on each GPU read) from a reading before it starts and one after its warm-up, and a refusal
    before a stack starts where the largest footprint so far, times ``margin``, is not free on a GPU. Without
    readings nothing is checked: stacks start as they come."""

    def __init__(self, memory: GpuMemory, margin: float = FIT_MARGIN) -> None:
        self.memory, self.margin = memory, margin
        self.totals = memory.total()
        self.footprints: list[list[int]] = []  # per stack measured, bytes per GPU read

    def gpu_name(self, position: int) -> str:
        return f"GPU {position if self.memory.indices is None else self.memory.indices[position]}"

    def check(self, setting: str) -> list[int] | None:
        """The memory in use now, before ``setting``'s stack starts (None: not read). SystemExit where the stack
        would not fit."""
        used = self.memory.used()
        if used is None or self.totals is None or not self.footprints:
            return used
        for position, (total, in_use) in enumerate(zip(self.totals, used)):
            largest = max(footprint[position] for footprint in self.footprints)
            free, needed = total - in_use, largest * self.margin
            if free < needed:
                up = len(self.footprints)
                raise SystemExit(
                    f"stack-bench: the stack of {setting} would not fit on {self.gpu_name(position)}: "
                    f"{free / GIB:.1f} GiB of {total / GIB:.1f} GiB free, and the {up} stack(s) up took "
                    f"{gib(f[position] for f in self.footprints)} there (each its start and warm-up; one more needs "
                    f"{needed / GIB:.1f} GiB, the largest x {self.margin}). {up} stack(s) fit: {FEWER_STACKS} "
                    "(variants that differ only in balance= share their render's stack)")
        return used

    def footprint(self, before: list[int] | None) -> list[int] | None:
        """What the stack started since the reading ``before`` added on each GPU (bytes); None without readings."""
        after = self.memory.used()
        if before is None or after is None or len(after) != len(before):
            return None
        grown = [max(0, a - b) for a, b in zip(after, before)]
        self.footprints.append(grown)
        return grown


def shadowed_library_warnings(logs: Iterable[Path]) -> list[str]:
    """The lines of these server logs that say a model process runs a mix of two builds of a CUDA library
    (`triton_repo.cuda_libraries`): figures measured so are not the stack's."""
    lines: list[str] = []
    for log in logs:
        if log.exists():
            lines += [line.strip() for line in log.read_text(errors="replace").splitlines() if SHADOWED_MARK in line]
    return lines


def ran_out_of_memory(logs: Iterable[Path]) -> bool:
    """Whether one of these server logs says a model ran out of GPU memory."""
    for log in logs:
        if log.exists():
            text = log.read_text(errors="replace")
            if any(mark in text for mark in OUT_OF_MEMORY_MARKS):
                return True
    return False


def busy_share(samples: Sequence[tuple[float, float]], window: Sequence[float] | None) -> float | None:
    """Mean GPU utilization (0..1) over the samples inside ``window`` (start, end); None when there are none."""
    if window is None:
        return None
    start, end = window
    inside = [value for t, value in samples if start <= t <= end]
    return math.fsum(inside) / len(inside) / 100.0 if inside else None


# One level -------------------------------------------------------------------------------------------


def balanced(scenario: Scenario, balance: str) -> Scenario:
    """`scenario` with tts-bench spreading its requests by `balance` (the Triton scenarios; round robin: as it is)."""
    if scenario.target != "triton" or balance == "round-robin":
        return scenario
    return replace(scenario, extra=(*scenario.extra, "--balance", balance))


def pipeline_args(target: str, pipeline: str | None) -> list[str]:
    """tts-bench's arguments that aim a scenario's target at ``pipeline`` (None: CosyVoice2, its default)."""
    if pipeline is None:
        return []
    return ["--pipeline", pipeline] if target == "triton" else ["--model", pipeline]


def run_level(scenario: Scenario, concurrency: int, url: str, json_path: Path, requests: int | None,
              timeout: float, warmup: int, pipeline: str | None = None) -> dict[str, Any]:  # fmt: skip
    """One concurrency level of a scenario: one `tts-bench` run (so the metrics deltas around it are this
    level's alone), at least two measured requests per worker. Returns tts-bench's level document."""
    command = [sys.executable, "-m", "ttsbench", scenario.target, "--url", url, "--mode", scenario.mode,
               "--concurrency", str(concurrency), "--json", str(json_path), "--timeout", str(timeout),
               "--warmup", str(warmup), *pipeline_args(scenario.target, pipeline), *scenario.extra]  # fmt: skip
    if requests:
        command += ["--requests", str(max(requests, 2 * concurrency))]
    (level,) = tts_bench(command, f"{scenario.name} c={concurrency}")["levels"]
    return level


def tts_bench(command: list[str], title: str) -> dict[str, Any]:
    """Run one `tts-bench` command line and return the document it wrote (where its ``--json`` says)."""
    print(f"\n## {title}: {' '.join(command[1:])}", flush=True)
    # This interpreter, this environment: the tts-bench installed beside this package.
    subprocess.run(command, check=True)  # noqa: S603 - our own module
    return json.loads(Path(command[command.index("--json") + 1]).read_text())


def open_loop_settings(args: argparse.Namespace) -> SearchSettings | None:
    """The rate search ``--open-loop`` asks for (None without it); SystemExit for settings that cannot work."""
    if args.open_loop is None:
        return None
    try:
        return SearchSettings(args.open_loop, args.open_loop_min, args.open_loop_max, max_steps=args.open_loop_steps)
    except SearchSettingsError as exc:
        raise SystemExit(f"stack-bench: --open-loop: {exc}") from None


def run_rate_search(scenario: Scenario, url: str, json_path: Path, search: SearchSettings, step_seconds: float,
                    timeout: float, warmup: int, pipeline: str | None = None) -> dict[str, Any]:  # fmt: skip
    """One open-loop rate search on a scenario: one `tts-bench --rate-search` run, every step ``step_seconds`` of
    Poisson arrivals (one arrival seed for every run: the runs offer the same load). Returns its document."""
    command = [sys.executable, "-m", "ttsbench", scenario.target, "--url", url, "--mode", "streaming",
               "--rate-search", str(search.start), "--rate-bounds", f"{search.low},{search.high}",
               "--search-steps", str(search.max_steps), "--search-precision", str(search.precision),
               "--first-chunk-p95", str(OPEN_LOOP_BOUND.first_chunk_p95), "--duration", str(step_seconds),
               "--json", str(json_path), "--timeout", str(timeout), "--warmup", str(warmup),
               *pipeline_args(scenario.target, pipeline), *scenario.extra]  # fmt: skip
    return tts_bench(command, f"{scenario.name} open-loop rate search")


def level_row(scenario: Scenario, concurrency: int, run: int, level: dict[str, Any], gpu_busy: float | None,
              stages: dict[str, float | None], gpu_busy_per_gpu: dict[str, float | None] | None = None
              ) -> dict[str, Any]:  # fmt: skip
    """The measures of one level, from tts-bench's level document (seconds, shares 0..1), all of the machine's
    (every replica's requests together); ``gpu_busy`` is the mean over the sampled GPUs, ``gpu_busy_per_gpu`` each
    one's. Offline levels have no first chunk (their one piece is the whole response: see total_p50)."""
    first = (level.get("first_chunk") or {}) if scenario.mode == "streaming" else {}
    stalls = level.get("stalls")
    return {
        "scenario": scenario.name,
        "mode": scenario.mode,
        "concurrency": concurrency,
        "run": run,
        "requests": level["requests"],
        "errors": level["errors"],
        "first_chunk_p50": first.get("p50"),
        "first_chunk_p90": first.get("p90"),
        "first_chunk_p99": first.get("p99"),
        "total_p50": (level.get("total") or {}).get("p50"),
        "streams": stalls["streams"] if stalls else None,
        "stalled_streams": stalls["stalled"] if stalls else None,
        "stalled_share": stalls["stalled_share"] if stalls else None,
        "stall_total": stalls["total"] if stalls else None,
        "stall_p50": stalls["p50"] if stalls else None,
        "stall_p90": stalls["p90"] if stalls else None,
        "stall_max": stalls["max"] if stalls else None,
        # stall events by the chunk that came too late (tts-bench's `by_piece`; absent from older documents: {})
        "stalls_by_chunk": {int(k): v for k, v in (stalls.get("by_piece") or {}).items()} if stalls else None,
        "audio_seconds_per_second": level["audio_seconds_per_second"],
        "aggregate_rtf": level.get("aggregate_rtf"),
        "gpu_busy": gpu_busy,
        "gpu_busy_per_gpu": gpu_busy_per_gpu or {},
        "stages": stages,
    }


def is_realtime(row: dict[str, Any]) -> bool:
    """A level every listener hears in real time: first chunk p90 within the bound, no stall, no error."""
    p90 = row["first_chunk_p90"]
    return (
        row["errors"] == 0
        and p90 is not None
        and p90 <= REALTIME_FIRST_CHUNK_P90_S
        and row["stalled_streams"] == 0
    )


def realtime_streams(rows: Sequence[dict[str, Any]], scenario: str = REALTIME_SCENARIO) -> int | None:
    """The highest concurrency of ``scenario`` that is real time in every run (0: none is); None without levels."""
    runs: dict[int, list[bool]] = {}
    for row in rows:
        if row["scenario"] == scenario:
            runs.setdefault(row["concurrency"], []).append(is_realtime(row))
    if not runs:
        return None
    return max((c for c, ok in runs.items() if all(ok)), default=0)


def rate_rows(document: dict[str, Any], run: int, busy: Callable[[Sequence[float] | None], float | None]
              ) -> list[dict[str, Any]]:  # fmt: skip
    """The measures of each step of a `tts-bench --rate-search` document, in the order measured (seconds, shares
    0..1), with the search's verdict; ``busy`` gives the GPU busy share of a step's window."""
    rows = []
    for step, rate in zip(document["rate_search"]["steps"], document["rates"], strict=True):
        first = rate.get("first_chunk") or {}
        stalls = rate.get("stalls")
        rows.append({
            "run": run,
            "rate": rate["rate"],
            "achieved_rate": rate["achieved_rate"],
            "requests": rate["requests"],
            "errors": rate["errors"],
            **{f"first_chunk_{q}": first.get(q) for q in ("p50", "p90", "p95", "p99")},
            "streams": stalls["streams"] if stalls else None,
            "stalled_streams": stalls["stalled"] if stalls else None,
            "stalled_share": stalls["stalled_share"] if stalls else None,
            "audio_seconds_per_second": rate["audio_seconds_per_second"],
            "max_in_flight": rate["max_in_flight"],
            "send_lag_p99": (rate.get("send_lag") or {}).get("p99"),
            "gpu_busy": busy(rate.get("window")),
            "met": step["met"],
            "misses": step["misses"],
        })  # fmt: skip
    return rows


def sustained_open_loop_rate(runs: Sequence[dict[str, Any]]) -> float | None:
    """The sustained open-loop rate over the runs: the lowest run's (0.0 when a run found none); None without runs."""
    if not runs:
        return None
    return min(run["sustained_rate"] or 0.0 for run in runs)


# Summary --------------------------------------------------------------------------------------------

#: (column title, row key, scale, format) of the summary table.
SUMMARY_COLUMNS: tuple[tuple[str, str, float, str], ...] = (
    ("first chunk p50 (ms)", "first_chunk_p50", 1000.0, "{:.0f}"),
    ("first chunk p90 (ms)", "first_chunk_p90", 1000.0, "{:.0f}"),
    ("first chunk p99 (ms)", "first_chunk_p99", 1000.0, "{:.0f}"),
    ("total p50 (ms)", "total_p50", 1000.0, "{:.0f}"),
    ("stalled streams (%)", "stalled_share", 100.0, "{:.0f}"),
    ("stall p90 (ms)", "stall_p90", 1000.0, "{:.0f}"),
    ("stall max (ms)", "stall_max", 1000.0, "{:.0f}"),
    ("audio s/s", "audio_seconds_per_second", 1.0, "{:.1f}"),
    ("GPU busy (%)", "gpu_busy", 100.0, "{:.0f}"),
)
#: (column title, stage_breakdown key, format) of the per-stage table.
STAGE_COLUMNS: tuple[tuple[str, str, str], ...] = (
    ("LLM prefill (ms)", "llm_prefill_ms_per_request", "{:.1f}"),
    ("LLM step (ms)", "llm_step_ms", "{:.2f}"),
    ("of it, GPU wait (ms)", "llm_step_sync_ms", "{:.2f}"),
    ("step's kernels on the GPU (ms)", "llm_step_device_ms", "{:.2f}"),
    ("LLM step, token2wav idle (ms)", "llm_step_token2wav_idle_ms", "{:.2f}"),
    ("LLM step beside token2wav (ms)", "llm_step_beside_token2wav_ms", "{:.2f}"),
    ("steps beside token2wav (%)", "llm_steps_beside_token2wav_pct", "{:.0f}"),
    ("token2wav call (ms)", "token2wav_call_ms", "{:.0f}"),
    ("token2wav jobs per call", "token2wav_chunks_per_call", "{:.1f}"),
    ("flow padding (%)", "token2wav_padded_share_pct", "{:.0f}"),
    ("caches over budget", "token2wav_flow_cache_refused", "{:.0f}"),
    ("alloc retries", "token2wav_cuda_alloc_retries", "{:.0f}"),
    ("GC pauses (ms)", "python_gc_ms", "{:.0f}"),
    ("full GCs", "python_gc_full_collections", "{:.0f}"),
    # the slowest second of the level (`stackbench.timeline`): a level that slowed down as a whole for a while
    ("LLM step, slowest s (ms)", "llm_step_ms_slowest", "{:.1f}"),
    ("token2wav call, slowest s (ms)", "token2wav_call_ms_slowest", "{:.0f}"),
)
#: (column title, first_chunk_breakdown key, format) of the first-chunk table: the first-chunk time, then its stages
#: in the order they happen (the rows of calls and decode steps next to their stage), then what they leave.
FIRST_CHUNK_COLUMNS: tuple[tuple[str, str, str], ...] = (
    ("pipeline first chunk (ms)", "first_chunk_ms", "{:.0f}"),
    ("voice prompt", "first_chunk_prompt_ms", "{:.1f}"),
    ("LLM queue", "first_chunk_llm_queue_ms", "{:.1f}"),
    ("LLM prefill", "first_chunk_llm_prefill_ms", "{:.1f}"),
    ("LLM decode", "first_chunk_llm_decode_ms", "{:.1f}"),
    ("decode steps", "first_chunk_llm_decode_steps", "{:.1f}"),
    ("token2wav queue", "first_chunk_token2wav_queue_ms", "{:.1f}"),
    ("token2wav call", "first_chunk_token2wav_call_ms", "{:.1f}"),
    ("rows per call", "first_chunk_token2wav_rows", "{:.1f}"),
    ("send", "first_chunk_send_ms", "{:.1f}"),
    ("other", "first_chunk_other_ms", "{:.1f}"),
)
NA = "n/a"


def spread_cell(values: Sequence[float | None], scale: float, fmt: str) -> str:
    """Each run's value, then the spread (min–max) when there are several runs; n/a for a missing value."""
    cells = [NA if v is None else fmt.format(v * scale) for v in values]
    present = [v for v in values if v is not None]
    text = " / ".join(cells)
    if len(values) > 1 and present:
        text += f" ({fmt.format(min(present) * scale)}–{fmt.format(max(present) * scale)})"
    return text


def per_gpu(value: float | None, gpus: int) -> str:
    """A machine's figure divided among the GPUs it used."""
    return NA if value is None else f"{value / gpus:.3g}"


def summary_markdown(rows: Sequence[dict[str, Any]], title: str, realtime: int | None, token2wav: str | None,
                     pipeline: str | None = None, open_loop: dict[str, Any] | None = None, *, replicas: int = 1,
                     gpus: int = 1, balance: str = "round-robin", setting: str | None = None) -> str:  # fmt: skip
    """The summary (``setting``: the line naming the setting of a `--variant` invocation): what it measured
    (CosyVoice2's token2wav, or the other ``pipeline``, which has its own
    vocoder) on how many tritonservers (``replicas``, their requests spread by ``balance``) and ``gpus``, then one table row per scenario and
    concurrency, each cell all runs' values and their spread (the machine's figures: every replica together); with
    several GPUs sampled each one's busy share; the real-time streams per machine and per GPU; with ``open_loop``
    (results.json's) the sustained open-loop rate and its search's steps."""
    groups: dict[tuple[str, int], list[dict[str, Any]]] = {}
    for row in rows:
        groups.setdefault((row["scenario"], row["concurrency"]), []).append(row)
    header = ["scenario", "c", "requests (errors)", *(title for title, *_ in SUMMARY_COLUMNS)]
    measured = (f"pipeline: **{pipeline}** (every figure below is {PIPELINE_MODELS.get(pipeline, pipeline)}'s)"
                if pipeline is not None else f"token2wav: **{token2wav}**")  # fmt: skip
    spread = "one round-robin target" if balance == "round-robin" else f"one target, {balance} (tts-bench's pick)"
    servers = (f"{replicas} tritonserver replicas (colocated, one per GPU) behind {spread}"
               if replicas > 1 else "one tritonserver")  # fmt: skip
    lines = [f"# {title}", "", *([setting, ""] if setting else []), measured, "",
             f"replicas: **{replicas}** ({servers}); GPUs used: **{gpus}**", "",
             "| " + " | ".join(header) + " |", "|" + "---|" * len(header)]  # fmt: skip
    for (scenario, concurrency), runs in groups.items():
        runs = sorted(runs, key=lambda r: r["run"])
        counts = f"{sum(r['requests'] for r in runs)} ({sum(r['errors'] for r in runs)})"
        cells = [scenario, str(concurrency), counts]
        cells += [spread_cell([r[key] for r in runs], scale, fmt) for _, key, scale, fmt in SUMMARY_COLUMNS]
        lines.append("| " + " | ".join(cells) + " |")
    header = ["scenario", "c", *(title for title, *_ in STAGE_COLUMNS)]
    lines += ["", "Per stage (means over each level, from the Triton counters):", "",
              "| " + " | ".join(header) + " |", "|" + "---|" * len(header)]  # fmt: skip
    for (scenario, concurrency), runs in groups.items():
        runs = sorted(runs, key=lambda r: r["run"])
        cells = [scenario, str(concurrency)]
        cells += [spread_cell([r["stages"].get(key) for r in runs], 1.0, fmt) for _, key, fmt in STAGE_COLUMNS]
        lines.append("| " + " | ".join(cells) + " |")
    streaming = {key: runs for key, runs in groups.items() if any(r["stages"].get("first_chunks") for r in runs)}
    if streaming:
        header = ["scenario", "c", *(title for title, *_ in FIRST_CHUNK_COLUMNS)]
        lines += ["", "First chunk, stage by stage (mean ms over each level's streaming requests, inside the "
                  "pipeline; the stages add up to the first chunk, other is the rest):", "",
                  "| " + " | ".join(header) + " |", "|" + "---|" * len(header)]  # fmt: skip
        for (scenario, concurrency), runs in streaming.items():
            runs = sorted(runs, key=lambda r: r["run"])
            cells = [scenario, str(concurrency)]
            cells += [spread_cell([r["stages"].get(key) for r in runs], 1.0, fmt)
                      for _, key, fmt in FIRST_CHUNK_COLUMNS]
            lines.append("| " + " | ".join(cells) + " |")
    lines += gpu_busy_markdown(groups)
    shown = NA if realtime is None else str(realtime)
    lines += ["", f"Real-time streams per machine ({REALTIME_SCENARIO}: first chunk p90 <= "
              f"{REALTIME_FIRST_CHUNK_P90_S * 1000:.0f} ms, no stall, no error, in every run): **{shown}**; "
              f"per GPU ({gpus} used): **{per_gpu(realtime, gpus)}**", ""]  # fmt: skip
    if open_loop is not None:
        lines += open_loop_markdown(open_loop, gpus)
    return "\n".join(lines)


def gpu_busy_markdown(groups: dict[tuple[str, int], list[dict[str, Any]]]) -> list[str]:
    """A table of each GPU's busy share per level, when more than one GPU was sampled (else nothing)."""
    gpus = sorted({gpu for runs in groups.values() for r in runs for gpu in r.get("gpu_busy_per_gpu") or {}}, key=int)
    if len(gpus) < 2:
        return []
    header = ["scenario", "c", *(f"GPU {gpu} busy (%)" for gpu in gpus)]
    lines = ["", "GPU busy, GPU by GPU (the table's GPU busy is their mean):", "",
             "| " + " | ".join(header) + " |", "|" + "---|" * len(header)]  # fmt: skip
    for (scenario, concurrency), runs in groups.items():
        runs = sorted(runs, key=lambda r: r["run"])
        cells = [scenario, str(concurrency)]
        cells += [spread_cell([(r.get("gpu_busy_per_gpu") or {}).get(gpu) for r in runs], 100.0, "{:.0f}")
                  for gpu in gpus]  # fmt: skip
        lines.append("| " + " | ".join(cells) + " |")
    return lines


#: (column title, rate_rows key, scale, format) of the open-loop table.
OPEN_LOOP_COLUMNS: tuple[tuple[str, str, float, str], ...] = (
    ("achieved (req/s)", "achieved_rate", 1.0, "{:.2f}"),
    ("first chunk p50 (ms)", "first_chunk_p50", 1000.0, "{:.0f}"),
    ("p90", "first_chunk_p90", 1000.0, "{:.0f}"),
    ("p95", "first_chunk_p95", 1000.0, "{:.0f}"),
    ("p99", "first_chunk_p99", 1000.0, "{:.0f}"),
    ("stalled streams (%)", "stalled_share", 100.0, "{:.0f}"),
    ("audio s/s", "audio_seconds_per_second", 1.0, "{:.1f}"),
    ("most in flight", "max_in_flight", 1.0, "{:.0f}"),
    ("GPU busy (%)", "gpu_busy", 100.0, "{:.0f}"),
)


def open_loop_markdown(open_loop: dict[str, Any], gpus: int = 1) -> list[str]:
    """The sustained open-loop rate (the machine's, and per GPU of ``gpus``) and a row per search step (each run's
    steps in the order measured)."""
    rate = open_loop["sustained_rate"]
    low = open_loop["search"]["low"]
    shown = NA if rate is None else (f"{rate:g} req/s" if rate else f"none (below {low:g} req/s)")
    shown_per_gpu = f"{per_gpu(rate, gpus)} req/s" if rate else shown
    lines = [f"Sustained open-loop rate ({open_loop['scenario']}, Poisson arrivals: {OPEN_LOOP_BOUND.describe()}, "
             f"lowest over the runs): **{shown}** per machine; per GPU ({gpus} used): **{shown_per_gpu}**", "",
             f"Open-loop rate search (each step {open_loop['step_seconds']:g} s of Poisson arrivals; grow x2 from "
             f"{open_loop['search']['start']:g} req/s until a rate misses, then bisect):", ""]  # fmt: skip
    header = ["run", "rate (req/s)", "requests (errors)", *(t for t, *_ in OPEN_LOOP_COLUMNS), "meets"]
    lines += ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for run in open_loop["runs"]:
        for row in run["steps"]:
            cells = [str(row["run"]), f"{row['rate']:g}", f"{row['requests']} ({row['errors']})"]
            cells += [NA if row[key] is None else fmt.format(row[key] * scale)
                      for _, key, scale, fmt in OPEN_LOOP_COLUMNS]  # fmt: skip
            cells.append("yes" if row["met"] else "no: " + ", ".join(row["misses"]))
            lines.append("| " + " | ".join(cells) + " |")
    return [*lines, ""]


#: (column title, row key or "stages." stage key, scale, format) of the variants' side-by-side table: the measures and
#: stages that decide between settings, as the summary's own tables show them.
VARIANT_COLUMNS: tuple[tuple[str, str, float, str], ...] = (
    *(column for column in SUMMARY_COLUMNS if column[1] in ("first_chunk_p50", "first_chunk_p90", "stalled_share",
                                                            "total_p50", "audio_seconds_per_second", "gpu_busy")),
    *((title, f"stages.{key}", 1.0, fmt) for title, key, fmt in STAGE_COLUMNS
      if key in ("token2wav_call_ms", "token2wav_padded_share_pct", "llm_step_ms")),
)


def variants_markdown(runs: Sequence[VariantRun], title: str, gpus: int = 1) -> str:
    """The variants side by side: per scenario and concurrency one row per variant, each cell every run's value and
    their spread; then each variant's real-time streams and where its own summary is."""

    def value(row: dict[str, Any], key: str) -> float | None:
        return row["stages"].get(key.partition(".")[2]) if key.startswith("stages.") else row.get(key)

    header = ["scenario", "c", "variant", "requests (errors)", *(t for t, *_ in VARIANT_COLUMNS)]
    lines = [f"# {title}", "", f"{len(runs)} settings, their runs interleaved (run k of every setting before run k+1 "
             "of any), every stack started and warmed up, one at a time, before the first level; each setting's own "
             "summary is in its directory.",
             "", "| " + " | ".join(header) + " |", "|" + "---|" * len(header)]  # fmt: skip
    levels: list[tuple[str, int]] = []
    for variant_run in runs:
        for row in variant_run.rows:
            if (row["scenario"], row["concurrency"]) not in levels:
                levels.append((row["scenario"], row["concurrency"]))
    for scenario, concurrency in levels:
        for variant_run in runs:
            rows = sorted((r for r in variant_run.rows if (r["scenario"], r["concurrency"]) == (scenario, concurrency)),
                          key=lambda r: r["run"])  # fmt: skip
            if not rows:
                continue
            cells = [scenario, str(concurrency), variant_run.variant.name,
                     f"{sum(r['requests'] for r in rows)} ({sum(r['errors'] for r in rows)})"]
            cells += [spread_cell([value(r, key) for r in rows], scale, fmt) for _, key, scale, fmt in VARIANT_COLUMNS]
            lines.append("| " + " | ".join(cells) + " |")
    lines += ["", "Real-time streams per machine (first chunk p90 <= "
              f"{REALTIME_FIRST_CHUNK_P90_S * 1000:.0f} ms, no stall, no error, in every run), per GPU ({gpus} used):", ""]
    for variant_run in runs:
        realtime = variant_run.realtime
        lines.append(f"- {variant_run.variant.name}: **{NA if realtime is None else realtime}** "
                     f"({per_gpu(realtime, gpus)} per GPU); `{variant_run.out_dir.name}/summary.md`")
    return "\n".join([*lines, ""])


# Replicas and GPUs --------------------------------------------------------------------------------

def replica_devices(replicas: int, device: str, environ: dict[str, str],
                    count_gpus: Callable[[], int | None] = gpu_count) -> list[str]:  # fmt: skip
    """CUDA_VISIBLE_DEVICES of each of ``replicas`` tritonservers: the i-th device this process sees (the i-th entry
    of its CUDA_VISIBLE_DEVICES, else GPU i); empty for one (it sees what this process sees). SystemExit where fewer
    GPUs are there than servers. With ``device`` cpu they all run on the CPU, whatever the machine has."""
    if replicas == 1:
        return []
    visible = [part.strip() for part in environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if part.strip()]
    if device == "cuda":
        if "CUDA_VISIBLE_DEVICES" in environ and len(visible) < replicas:
            raise SystemExit(f"stack-bench: --replicas {replicas} needs {replicas} GPUs, one per tritonserver; "
                             f"CUDA_VISIBLE_DEVICES={environ['CUDA_VISIBLE_DEVICES']!r} leaves {len(visible)}")
        if "CUDA_VISIBLE_DEVICES" not in environ and (count := count_gpus()) is not None and count < replicas:
            raise SystemExit(f"stack-bench: --replicas {replicas} needs {replicas} GPUs, one per tritonserver; "
                             f"this machine has {count}")
    return [visible[i] if i < len(visible) else str(i) for i in range(replicas)]


def sampled_gpu_indices(gpus: Sequence[int], environ: dict[str, str]) -> list[int] | None:
    """The physical indices of ``gpus`` (through CUDA_VISIBLE_DEVICES), what the GPU sampler reads; None (every GPU)
    when CUDA_VISIBLE_DEVICES names its devices otherwise than by index."""
    if not environ.get("CUDA_VISIBLE_DEVICES", "").strip():
        return list(gpus)
    visible = visible_gpu_indices(environ)
    return None if visible is None else [visible[g] for g in gpus if g < len(visible)]


# Results directory ---------------------------------------------------------------------------------


def selected_pipeline(args: argparse.Namespace) -> str | None:
    """The pipeline the levels load: `--spark`'s, `--cosyvoice3`'s, or None (CosyVoice2, tts-bench's default)."""
    if args.spark:
        return SPARK_PIPELINE
    return COSYVOICE3_PIPELINE if args.cosyvoice3 else None


def settings_slug(args: argparse.Namespace) -> str:
    """A short, file-name-safe description of the settings that change the numbers."""
    # UNet and DiT runs never share a name; a Spark or CosyVoice3 run (a vocoder of its own) is named as one from its
    # first word
    pipeline = selected_pipeline(args)
    parts = [pipeline] if pipeline is not None else []
    slots = [] if args.max_batch is None else [f"b{args.max_batch}"]  # the render's default slot count goes unnamed
    parts += [args.device, args.dtype, *slots] + ([] if pipeline is not None else [args.token2wav])
    parts += [item.replace("=", "") for item in args.render_arg]
    parts += [item.rpartition(",")[2].replace("=", "") for item in args.server_arg]  # e.g. thread-pool-size128
    if args.only:
        parts.append(args.only.replace(",", "+"))
    if args.replicas > 1:
        parts.append(f"rep{args.replicas}" + ("" if args.balance == "round-robin" else f"-{args.balance}"))
    if getattr(args, "variant", None):
        parts.append(f"{len(args.variant) + 1}settings")
    parts.append(f"r{args.repeat}")
    return re.sub(r"[^A-Za-z0-9_.+-]", "", "-".join(parts))[:80]


def fresh_results_dir(parent: Path, slug: str, now: datetime | None = None) -> Path:
    """A new directory <parent>/<UTC time>-<slug>[-N]: never one that exists, so results are never overwritten."""
    stamp = (now or datetime.now(timezone.utc)).astimezone(timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    parent.mkdir(parents=True, exist_ok=True)
    for n in range(1000):
        path = parent / (f"{stamp}-{slug}" + (f"-{n}" if n else ""))
        try:
            path.mkdir()
        except FileExistsError:
            continue
        return path
    raise RuntimeError(f"no free results directory name under {parent}")


def copy_tail(log: Path, dest: Path, lines: int = LOG_TAIL_LINES) -> None:
    if log.exists():  # the last lines travel with the results (a failed request's story is there)
        dest.write_text("\n".join(log.read_text(errors="replace").splitlines()[-lines:]) + "\n")


# Command line ----------------------------------------------------------------------------------------


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError("must be >= 1")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="stack-bench", description=__doc__.split("\n\n")[0])
    parser.add_argument("--work", type=Path, default=REPO_ROOT / "var" / "stackbench")
    parser.add_argument("--out", type=Path, help="parent of the fresh results directories (default: WORK/results)")
    parser.add_argument("--model-dir", type=Path, help="default: released-size random weights under WORK")
    parser.add_argument("--token2wav", default="unet", choices=TOKEN2WAVS,
                        help="which flow + HiFT turns speech tokens into audio: unet (CosyVoice2's) or dit")
    parser.add_argument("--dit-dir", type=Path,
                        help="DiT token2wav directory (--token2wav dit; default: released-size random weights under "
                             "WORK/dit)")
    parser.add_argument("--device", default="cuda", choices=("cpu", "cuda"))
    parser.add_argument("--dtype", default="bf16")
    parser.add_argument("--max-batch", type=int,
                        help="LLM sequences decoded together (default: the render's, 64 for the PyTorch LLM on a GPU)")
    parser.add_argument("--max-seq-len", type=int, default=2048)
    parser.add_argument("--benchmark-speech-ratio", type=float,
                        help="speech tokens per target text token (0 = off: real weights); default: what makes "
                             f"the built-in sentences last {SPEECH_TOKENS_PER_CHAR} tokens per character with this "
                             "model's tokenizer (~15 characters per second of English speech)")
    parser.add_argument("--timeout", type=float, default=120.0, help="deadline of one request, seconds")
    parser.add_argument("--render-arg", action="append", default=[], metavar="FIELD=VALUE",
                        help="extra RenderOptions field, e.g. first_hop=15 or layout=single; the --spark / "
                             "--cosyvoice3 pipeline's own as PART.FIELD, e.g. cosyvoice3.flow_cache=chunked")
    parser.add_argument("--requests", type=int, help="measured requests per level (tts-bench default otherwise)")
    parser.add_argument("--only", help="comma-separated scenario names (default: all): "
                        + ", ".join(s.name for s in SCENARIOS))
    parser.add_argument("--stream-levels", type=concurrency_list, default=[1, 4, 16, 32, 64],
                        help="concurrency levels of triton-stream (default 1,4,16,32,64)")
    parser.add_argument("--offline-levels", type=concurrency_list, default=[32, 64],
                        help="concurrency levels of triton-offline (default 32,64)")
    parser.add_argument("--gateway-levels", type=concurrency_list, default=[1],
                        help="concurrency levels of the gateway scenarios (default 1)")
    parser.add_argument("--repeat", type=_positive, default=1,
                        help="runs of every level, interleaved (run 1 of all levels, then run 2, ...)")
    parser.add_argument("--server-warmup", type=int, default=48,
                        help=f"unmeasured streaming and offline requests before the first level, as many at a "
                             f"time as the largest level (at least {WARMUP_CONCURRENCY})")
    parser.add_argument("--warmup", type=int, default=2,
                        help="unmeasured requests per worker before each level (the token2wav CUDA graphs of a "
                             "shape are captured on its second call)")
    parser.add_argument("--stub-env", type=Path,
                        help="Python environment (venv directory) the Triton python stubs run in; it needs numpy < 2 "
                             "(scripts/gpu_setup.sh makes one when this environment has numpy 2); default: this one")
    parser.add_argument("--spark", action="store_true",
                        help="load the Spark-TTS pipeline (spark_tts / spark_tts_stream; the gateway's spark-tts) "
                             "instead of CosyVoice2; the stack is rendered with both")
    parser.add_argument("--spark-dir", type=Path,
                        help="Spark-TTS weights for --spark (default: released-size random weights under "
                             "WORK/spark-model)")
    parser.add_argument("--spark-benchmark-ratio", type=float,
                        help="semantic tokens per Spark text token (0 = off: real weights); default: what makes the "
                             f"built-in sentences last {SPARK_TOKENS_PER_CHAR} tokens per character")
    parser.add_argument("--cosyvoice3", action="store_true",
                        help="load the CosyVoice3 pipeline (cosyvoice3 / cosyvoice3_stream; the gateway's cosyvoice3) "
                             "instead of CosyVoice2; the stack is rendered with both")
    parser.add_argument("--cosyvoice3-dir", type=Path,
                        help="CosyVoice3 weights for --cosyvoice3 (default: random weights written once: released "
                             "size under WORK/cosyvoice3-model on cuda, the tiny model under WORK/cosyvoice3-tiny "
                             "on cpu)")
    parser.add_argument("--cosyvoice3-benchmark-ratio", type=float,
                        help="speech tokens per CosyVoice3 text token (0 = off: real weights); default: what makes "
                             f"the built-in sentences last {SPEECH_TOKENS_PER_CHAR} tokens per character")
    parser.add_argument("--open-loop", type=positive_rate, metavar="START",
                        help="each run, after its levels: search the highest rate of Poisson arrivals (requests/s) "
                             f"with {OPEN_LOOP_BOUND.describe()}, starting at START")
    parser.add_argument("--open-loop-scenario", default=REALTIME_SCENARIO,
                        choices=[s.name for s in SCENARIOS if s.mode == "streaming"],
                        help=f"the streaming scenario the search loads (default {REALTIME_SCENARIO})")
    low, high = DEFAULT_RATE_BOUNDS  # tts-bench's
    parser.add_argument("--open-loop-min", type=positive_rate, default=low, help="lowest rate the search may try")
    parser.add_argument("--open-loop-max", type=positive_rate, default=high, help="highest rate the search may try")
    parser.add_argument("--open-loop-step-seconds", type=positive_rate, default=30.0,
                        help="seconds of arrivals per search step (the step then waits for what is still running)")
    parser.add_argument("--open-loop-steps", type=_positive, default=8, help="most rates one search measures")
    parser.add_argument("--replicas", type=_positive, default=1,
                        help="tritonservers serving the same (colocated) repository, replica i on GPU i, all behind "
                             "one round-robin gRPC target (default 1)")
    parser.add_argument("--balance", choices=BALANCES, default="round-robin",
                        help="with --replicas: how tts-bench spreads the Triton scenarios' requests over the "
                             "tritonservers: the target's round robin (as the gateway), or least-busy (each request to "
                             "the server with the fewest of the run's requests in flight)")
    parser.add_argument("--stacks-when-slow", type=float, metavar="MS",
                        help="py-spy dumps of every tritonserver process (RESULTS/stacks/) when a second's mean LLM "
                             "step passes MS ms, at most every 20 s (needs py-spy on PATH)")
    parser.add_argument("--variant", action="append", default=[], metavar="'FIELD=VALUE ...'",
                        help="another setting measured beside the command's own (repeatable): render FIELD=VALUE "
                             "items on top of the --render-args, balance=... for its --balance; the settings' stacks "
                             "start and warm up one at a time before the first level (one that would not fit in GPU "
                             "memory is refused) and their runs interleave (results per setting in "
                             "RESULTS/<i>-<setting>/, side by side in RESULTS/summary.md)")
    parser.add_argument("--server-arg", action="append", default=[], metavar="ARG",
                        help="an extra tritonserver argument (repeatable), e.g. "
                             "--server-arg=--backend-config=python,thread-pool-size=128")
    return parser


def exit_on_sigterm(signum: int, frame: object) -> None:
    """SIGTERM (`timeout`, a CI job cancelled, `kill`) ends the run the way Ctrl-C does: the `finally` below stops
    the tritonservers and the gateway, which run in sessions of their own and would otherwise outlive it. A second
    SIGTERM during that clean-up is ignored."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    raise SystemExit(128 + signum)


def main(argv: Sequence[str] | None = None) -> int:
    previous = signal.signal(signal.SIGTERM, exit_on_sigterm)
    try:
        return run(argv)
    finally:
        signal.signal(signal.SIGTERM, previous)


@dataclass(frozen=True)
class Variant:
    """One setting measured: the render's ``FIELD=VALUE`` items (the command's `--render-arg`s, then the variant's
    own, which win) and how tts-bench spreads the Triton scenarios' requests over the replicas."""

    name: str
    render_args: tuple[str, ...]
    balance: str


#: The setting of the command line itself, when `--variant`s are measured beside it.
BASE_VARIANT = "base"


def check_render_args(items: Iterable[str], where: str) -> None:
    for item in items:
        field_name, sep, value = item.partition("=")
        if not sep or not field_name or not value:
            raise SystemExit(f"stack-bench: {where}: {item!r} is not FIELD=VALUE")
        if field_name in OWN_OPTIONS:
            raise SystemExit(f"stack-bench: give {field_name} with {OWN_OPTIONS[field_name]}, not {where} "
                             "(the results are named after it)")


def variants(args: argparse.Namespace) -> list[Variant]:
    """The settings one invocation measures: the command line's, then one per `--variant` (its FIELD=VALUE items on
    top of the command's render args; `balance=...` sets the variant's `--balance`)."""
    measured = [Variant(BASE_VARIANT, tuple(args.render_arg), args.balance)]
    for spec in args.variant:
        items = spec.split()
        if not items:
            raise SystemExit("stack-bench: --variant needs FIELD=VALUE items, e.g. --variant busy_streams=8")
        render = [item for item in items if not item.startswith("balance=")]
        check_render_args(render, "--variant")
        balances = [item.partition("=")[2] for item in items if item.startswith("balance=")]
        if any(balance not in BALANCES for balance in balances):
            raise SystemExit(f"stack-bench: --variant {spec!r}: balance is one of {', '.join(BALANCES)}")
        variant = Variant(" ".join(items), (*args.render_arg, *render), balances[-1] if balances else args.balance)
        if any(v.name == variant.name or (render_fields(v.render_args), v.balance)
               == (render_fields(variant.render_args), variant.balance) for v in measured):
            raise SystemExit(f"stack-bench: --variant {spec!r} measures a setting already measured")
        measured.append(variant)
    for variant in measured:
        if variant.balance != "round-robin" and args.replicas < 2:
            raise SystemExit(f"stack-bench: --balance {variant.balance} spreads requests over replicas: "
                             "add --replicas N")
    return measured


@dataclass(frozen=True)
class Weights:
    """The weights every setting of an invocation loads (the pipeline's, and the token2wav's or the other
    pipeline's where one is measured)."""

    model_dir: Path
    dit_dir: Path | None = None
    spark_dir: Path | None = None
    cosyvoice3_dir: Path | None = None


def token2wav_label(args: argparse.Namespace, weights: Weights) -> str:
    """The token2wav as the summary names it (the DiT with its directory)."""
    return args.token2wav if weights.dit_dir is None else f"{args.token2wav} ({weights.dit_dir})"


class StackUnderTest:
    """One rendered repository on its tritonserver(s) (and gateway, when a scenario needs it), with the timeline of
    their metrics and, with `--stacks-when-slow`, the stack dumps of their processes. Variants that differ only in
    their balance share one."""

    def __init__(self, args: argparse.Namespace, render_args: Sequence[str], work: Path, weights: Weights,
                 devices: list[str], stacks_dir: Path) -> None:  # fmt: skip
        self.work = work
        self.options, repo = render_stack(
            work=work, model_dir=weights.model_dir, device=args.device, dtype=args.dtype,
            max_batch=args.max_batch, max_seq_len=args.max_seq_len, benchmark_speech_ratio=args.benchmark_speech_ratio,
            render_args=render_args, token2wav=args.token2wav, dit_dir=weights.dit_dir,
            spark_dir=weights.spark_dir, spark_benchmark_ratio=args.spark_benchmark_ratio,
            cosyvoice3_dir=weights.cosyvoice3_dir, cosyvoice3_benchmark_ratio=args.cosyvoice3_benchmark_ratio,
        )  # fmt: skip
        self.bench = BenchStack(repo, work, stub_env=args.stub_env, replica_devices=devices,
                                server_args=tuple(args.server_arg))
        self.servers = self.bench.servers
        self.slow_stacks = (SlowStacks(lambda: [server.pid for server in self.servers], stacks_dir,
                                       args.stacks_when_slow) if args.stacks_when_slow else None)  # fmt: skip
        self.timeline = MetricsTimeline(lambda: sum_metrics(replica_metrics(self.servers)), GpuMemory().used,
                                        on_tick=self.slow_stacks.observe if self.slow_stacks is not None else None)
        self.ready_s: float | None = None
        self.started = False

    def start(self, with_gateway: bool) -> None:
        started = time.perf_counter()
        self.started = True
        self.bench.start_triton()
        self.ready_s = round(time.perf_counter() - started, 1)
        print(f"{len(self.servers)} tritonserver(s) ready in {self.ready_s} s: {self.bench.grpc_target}", flush=True)
        if with_gateway:
            self.bench.start_gateway()

    def watch(self) -> None:
        """From the first measured level on (not during the warm-up's captures): the metrics' timeline, and the
        stack dumps it triggers."""
        self.timeline.start()

    def url(self, scenario: Scenario) -> str:
        return self.bench.grpc_target if scenario.target == "triton" else self.bench.gateway_url

    def stop(self, out_dir: Path) -> None:
        """Stop the servers; the timeline and the logs' tails go to ``out_dir``."""
        self.timeline.stop()
        (out_dir / "timeline.json").write_text(json.dumps(self.timeline.to_json()))
        if self.slow_stacks is not None:
            self.slow_stacks.join()
        self.bench.stop()
        for replica, log in enumerate(self.bench.server_logs):
            copy_tail(log, out_dir / ("tritonserver_tail.log" if replica == 0 else f"tritonserver-{replica}_tail.log"))
        copy_tail(self.bench.gateway_log, out_dir / "gateway_tail.log")


class VariantRun:
    """What one variant measures on its stack: its levels, run by run, and the documents it writes into
    ``out_dir`` (results.json, stages.json, summary.md, levels/)."""

    def __init__(self, variant: Variant, stack: StackUnderTest, out_dir: Path, args: argparse.Namespace,
                 sampler: GpuSampler, gpus: int, weights: Weights, devices: list[str],
                 search: SearchSettings | None) -> None:  # fmt: skip
        self.variant, self.stack, self.out_dir, self.args, self.sampler, self.gpus = \
            variant, stack, out_dir, args, sampler, gpus
        self.levels_dir = out_dir / "levels"
        self.levels_dir.mkdir()
        self.pipeline = selected_pipeline(args)
        self.token2wav = token2wav_label(args, weights)
        self.scenarios = [balanced(s, variant.balance) for s in SCENARIOS
                          if not args.only or s.name in args.only.split(",")]
        self.search = search
        self.open_loop_scenario = balanced(next(s for s in SCENARIOS if s.name == args.open_loop_scenario),
                                           variant.balance)
        settings = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
        settings["max_batch"] = stack.options.max_batch  # what the render chose where --max-batch was left out
        settings["render_arg"], settings["balance"] = list(variant.render_args), variant.balance
        self.document: dict[str, Any] = {
            "settings": settings,
            "variant": variant.name,
            "pipeline": self.pipeline or "cosyvoice2",
            "token2wav": None if self.pipeline else args.token2wav,  # Spark and CosyVoice3 vocode with their own
            "dit_dir": None if weights.dit_dir is None else str(weights.dit_dir),
            "spark_dir": None if weights.spark_dir is None else str(weights.spark_dir),
            "cosyvoice3_dir": None if weights.cosyvoice3_dir is None else str(weights.cosyvoice3_dir),
            "render": {k: str(v) for k, v in vars(stack.options).items()},
            "replicas": args.replicas,
            "balance": variant.balance,  # how tts-bench spread the Triton scenarios' requests over the replicas
            "replica_devices": devices,  # each tritonserver's CUDA_VISIBLE_DEVICES (none: one server)
            "gpus_used": gpus,
            # what its stack's start and warm-up added to the memory in use, bytes per GPU it uses (None: not read)
            "gpu_memory_footprint_bytes": None,
            "started": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "levels": [],
        }
        if search is not None:
            self.document["open_loop"] = {
                "scenario": self.open_loop_scenario.name,
                "rule": {"first_chunk_p95_max_s": OPEN_LOOP_BOUND.first_chunk_p95, "stalled_streams": 0, "errors": 0,
                         "lowest_over_runs": True},
                "search": asdict(search),
                "step_seconds": args.open_loop_step_seconds,
                "runs": [],
                "sustained_rate": None,
            }  # fmt: skip
        self.rows: list[dict[str, Any]] = self.document["levels"]
        self.stages: dict[str, Any] = {"render": self.document["render"]}
        self.realtime: int | None = None

    @property
    def loaded(self) -> list[Scenario]:
        return self.scenarios + ([self.open_loop_scenario] if self.search is not None else [])

    def record_start(self) -> None:
        self.document["grpc_target"] = self.stack.bench.grpc_target  # the ports are chosen as the servers start
        self.document["server_ready_s"] = self.stages["server_ready_s"] = self.stack.ready_s
        self.document["gpu_sampler"] = self.sampler.source

    def warm_up(self) -> None:
        """Unmeasured: the first calls of each shape run eagerly and the second ones capture CUDA graphs; a server
        that has been up a while has them all, so the levels measure that state. At the largest level's
        concurrency: calls of more rows than the warm-up formed (eager shapes, kernel plans) otherwise land in the
        first measured run of a larger level (its p90 was the worst of three)."""
        args = self.args
        concurrency = max(WARMUP_CONCURRENCY, *(c for s in self.scenarios for c in getattr(args, s.levels_option)))
        print(f"\n## server warm-up: {args.server_warmup} streaming + offline requests, {concurrency} at a "
              "time", flush=True)
        for warm in WARMUP:
            level = run_level(balanced(warm, self.variant.balance), concurrency, self.stack.bench.grpc_target,
                              self.levels_dir / f"{warm.name}.json", args.server_warmup, args.timeout, 0,
                              self.pipeline)  # fmt: skip
            if level["errors"]:  # the measured levels would fail the same way, minutes later
                cause = (f"; its server log says the GPU ran out of memory: {FEWER_STACKS}"
                         if ran_out_of_memory(self.stack.bench.server_logs) else "")
                raise SystemExit(f"stack-bench: setting {self.variant.name!r}: {level['errors']} of "
                                 f"{level['requests']} {warm.name} requests failed{cause}; stopping before the "
                                 "measured levels (server log tail saved)")

    def measure(self, run: int) -> None:
        """Run ``run`` of every level, then (with `--open-loop`) its rate search."""
        args, servers = self.args, self.stack.servers
        for scenario in self.scenarios:
            for concurrency in getattr(args, scenario.levels_option):
                name = f"{scenario.name}-c{concurrency}-r{run}"
                before = replica_metrics(servers)
                level = run_level(scenario, concurrency, self.stack.url(scenario), self.levels_dir / f"{name}.json",
                                  args.requests, args.timeout, args.warmup, self.pipeline)  # fmt: skip
                after = settled_metrics(servers)
                self.stages[name] = stage_breakdown(sum_metrics(before), sum_metrics(after))
                window = level.get("window")
                self.stages[name].update(self.stack.timeline.slowest(window))
                row = level_row(scenario, concurrency, run, level, self.sampler.busy_share(window), self.stages[name],
                                self.sampler.busy_per_gpu(window))  # fmt: skip
                row["replica_requests"] = replica_requests(before, after)
                if args.variant:
                    row["variant"] = self.variant.name
                self.rows.append(row)
                print(json.dumps({k: v for k, v in row.items() if k != "stages"}), flush=True)
                self.write_results()
                if level["errors"] == level["requests"]:
                    raise RuntimeError(f"{name}: every request failed; stopping (server log tail saved)")
        if self.search is not None:
            found = run_rate_search(self.open_loop_scenario, self.stack.url(self.open_loop_scenario),
                                    self.levels_dir / f"open-loop-r{run}.json", self.search,
                                    args.open_loop_step_seconds, args.timeout, args.warmup, self.pipeline)  # fmt: skip
            outcome = found["rate_search"]
            open_loop = self.document["open_loop"]
            open_loop["runs"].append({
                "run": run, "sustained_rate": outcome["sustained_rate"], "failed_above": outcome["failed_above"],
                "steps": rate_rows(found, run, self.sampler.busy_share),
            })  # fmt: skip
            open_loop["sustained_rate"] = rate = sustained_open_loop_rate(open_loop["runs"])
            open_loop["sustained_rate_per_gpu"] = None if rate is None else round(rate / self.gpus, 3)
            print(json.dumps({k: v for k, v in open_loop["runs"][-1].items() if k != "steps"}), flush=True)
            self.write_results()

    def write_results(self) -> None:
        (self.out_dir / "results.json").write_text(json.dumps(self.document, indent=1))

    def finish(self) -> None:
        """The real-time streams and every document of the variant, also after a failure (what was measured)."""
        self.realtime = realtime = realtime_streams(self.rows)
        self.document["realtime_streams"] = realtime  # the machine's: every replica together
        self.document["realtime_streams_per_gpu"] = None if realtime is None else round(realtime / self.gpus, 3)
        self.document["realtime_rule"] = {"scenario": REALTIME_SCENARIO,
                                          "first_chunk_p90_max_s": REALTIME_FIRST_CHUNK_P90_S,
                                          "stalled_streams": 0, "errors": 0, "in_every_run": True}  # fmt: skip
        self.write_results()
        (self.out_dir / "stages.json").write_text(json.dumps(self.stages, indent=1))
        title, setting = f"stack-bench {self.out_dir.name}", None
        if self.args.variant:
            title = f"stack-bench {self.out_dir.parent.name}/{self.out_dir.name}"
            setting = (f"variant: **{self.variant.name}** (render args: "
                       f"{' '.join(self.variant.render_args) or 'none'})")
        summary = summary_markdown(self.rows, title, realtime, self.token2wav, self.pipeline,
                                   self.document.get("open_loop"), replicas=self.args.replicas, gpus=self.gpus,
                                   balance=self.variant.balance, setting=setting)
        (self.out_dir / "summary.md").write_text(summary)
        print("\n" + summary, flush=True)
        print(f"real-time streams per machine: {NA if realtime is None else realtime}, per GPU ({self.gpus} used): "
              f"{per_gpu(realtime, self.gpus)}", flush=True)  # fmt: skip
        if self.search is not None:
            print(f"sustained open-loop rate: {self.document['open_loop']['sustained_rate']} req/s", flush=True)


def variant_dir_name(index: int, variant: Variant) -> str:
    return f"{index}-" + (re.sub(r"[^A-Za-z0-9_.+-]", "", variant.name.replace("=", "").replace(" ", "+"))[:60]
                          or "variant")


def run(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    unknown = set((args.only or "").split(",")) - {"", *(s.name for s in SCENARIOS)}
    if unknown:
        raise SystemExit(f"stack-bench: unknown scenario(s) {', '.join(sorted(unknown))}")
    if args.stub_env is not None and not (args.stub_env / "bin" / "python3").exists():
        raise SystemExit(f"stack-bench: {args.stub_env} is not a Python environment (no bin/python3)")
    check_render_args(args.render_arg, "--render-arg")
    if not args.spark and (args.spark_dir is not None or args.spark_benchmark_ratio is not None):
        raise SystemExit("stack-bench: --spark-dir and --spark-benchmark-ratio need --spark")
    if args.spark and (args.token2wav != "unet" or args.dit_dir is not None):
        raise SystemExit("stack-bench: --spark measures Spark-TTS, which vocodes with its own BiCodec: "
                         "--token2wav and --dit-dir do not apply")
    if not args.cosyvoice3 and (args.cosyvoice3_dir is not None or args.cosyvoice3_benchmark_ratio is not None):
        raise SystemExit("stack-bench: --cosyvoice3-dir and --cosyvoice3-benchmark-ratio need --cosyvoice3")
    if args.cosyvoice3 and args.spark:
        raise SystemExit("stack-bench: --spark and --cosyvoice3 each load one pipeline: measure one per run")
    if args.cosyvoice3 and (args.token2wav != "unet" or args.dit_dir is not None):
        raise SystemExit("stack-bench: --cosyvoice3 measures CosyVoice3, which has its own DiT flow and HiFT: "
                         "--token2wav and --dit-dir do not apply")
    pipeline = selected_pipeline(args)
    if args.dit_dir is not None:
        if args.token2wav != "dit":
            raise SystemExit("stack-bench: --dit-dir is only used with --token2wav dit")
        try:
            check_dit_dir(args.dit_dir)
        except FileNotFoundError as exc:
            raise SystemExit(f"stack-bench: --dit-dir: {exc}") from None
    devices = replica_devices(args.replicas, args.device, dict(os.environ))
    measured = variants(args)
    search = open_loop_settings(args)

    out_dir = fresh_results_dir(args.out or args.work / "results", settings_slug(args))
    print(f"results: {out_dir}", flush=True)
    weights = Weights(
        model_dir=ensure_model_dir(args.work, args.model_dir),
        dit_dir=ensure_dit_dir(args.work, args.dit_dir) if args.token2wav == "dit" else None,
        spark_dir=ensure_spark_dir(args.work, args.spark_dir) if args.spark else None,
        cosyvoice3_dir=ensure_cosyvoice3_dir(args.work, args.cosyvoice3_dir, args.device) if args.cosyvoice3 else None,
    )
    print(f"pipeline: {pipeline} ({weights.spark_dir or weights.cosyvoice3_dir})" if pipeline
          else f"token2wav: {token2wav_label(args, weights)}", flush=True)  # fmt: skip

    gpus = list(range(args.replicas))  # as this process numbers them: one per tritonserver
    gpu_indices = sampled_gpu_indices(gpus, dict(os.environ))
    sampler = GpuSampler(indices=gpu_indices)
    # One invocation, one setting: its stack in WORK and its results in the results directory itself. With
    # --variant every setting gets a directory of its own under it (and each render a work directory of its own),
    # every stack is started and warmed up before the first level, and run k of every variant comes before run k+1
    # of any.
    stacks: dict[tuple[tuple[str, Any], ...], StackUnderTest] = {}  # by the render they serve
    runs: list[VariantRun] = []
    for index, variant in enumerate(measured):
        variant_out = out_dir if not args.variant else out_dir / variant_dir_name(index, variant)
        variant_out.mkdir(exist_ok=True)
        render = tuple(sorted(render_fields(variant.render_args).items()))
        stack = stacks.get(render)
        if stack is None:
            work = args.work if not args.variant else args.work / "variants" / str(len(stacks))
            work.mkdir(parents=True, exist_ok=True)
            stack = stacks[render] = StackUnderTest(args, variant.render_args, work, weights, devices,
                                                                 variant_out / "stacks")
        runs.append(VariantRun(variant, stack, variant_out, args, sampler, len(gpus), weights, devices, search))
    # One stack at a time, started and warmed up (by its first variant: the warm-up is the stack's), so that each
    # one's footprint is known before the next starts: a stack that would not fit stops the invocation before it
    # starts, not minutes later in its warm-up or levels.
    fit = StackFit(GpuMemory(indices=gpu_indices))
    if fit.memory.source is None:
        print("no NVML and no nvidia-smi: not checking that every setting's stack fits in GPU memory", flush=True)
    try:
        for stack in stacks.values():
            its_runs = [r for r in runs if r.stack is stack]
            setting = " / ".join(repr(r.variant.name) for r in its_runs)
            before = fit.check(setting)
            stack.start(any(s.target == "gateway" for r in its_runs for s in r.loaded))
            for variant_run in its_runs:
                variant_run.record_start()
            if args.server_warmup:
                its_runs[0].warm_up()
            footprint = fit.footprint(before)
            shadowed = shadowed_library_warnings(stack.bench.server_logs)
            for variant_run in its_runs:
                variant_run.document["gpu_memory_footprint_bytes"] = footprint
                variant_run.document["shadowed_cuda_libraries"] = shadowed
            for line in shadowed:
                print(f"WARNING: the stack of {setting} runs mixed CUDA library builds: {line}", flush=True)
            if footprint is not None:
                print(f"GPU memory footprint of the stack of {setting} (its start and warm-up): {gib(footprint)}",
                      flush=True)
        sampler.start()
        for stack in stacks.values():
            stack.watch()
        if sampler.source is None:
            print("no NVML and no nvidia-smi: GPU busy share is n/a", flush=True)
        for variant_run in runs:
            variant_run.document["gpu_sampler"] = sampler.source
        for run_number in range(1, args.repeat + 1):
            for variant_run in runs:
                if args.variant:
                    print(f"\n# run {run_number}, variant {variant_run.variant.name}", flush=True)
                variant_run.measure(run_number)
    except BaseException:
        for stack in (stack for stack in stacks.values() if stack.started):
            for server in stack.servers:
                print(server.log_tail(80), flush=True)
        raise
    finally:
        sampler.stop()
        stopped: set[int] = set()
        for variant_run in runs:  # each stack's timeline and logs beside its first variant's results
            if variant_run.stack.started and id(variant_run.stack) not in stopped:
                stopped.add(id(variant_run.stack))
                variant_run.stack.stop(variant_run.out_dir)
        for variant_run in runs:
            variant_run.finish()
        if args.variant:
            summary = variants_markdown(runs, f"stack-bench {out_dir.name}", gpus=len(gpus))
            (out_dir / "summary.md").write_text(summary)
            (out_dir / "results.json").write_text(json.dumps({
                "variants": [{"name": r.variant.name, "render_args": list(r.variant.render_args),
                              "balance": r.variant.balance, "results": r.out_dir.name,
                              "realtime_streams": r.realtime,
                              "gpu_memory_footprint_bytes": r.document["gpu_memory_footprint_bytes"]}
                             for r in runs],
                "repeat": args.repeat,
            }, indent=1))  # fmt: skip
            print("\n" + summary, flush=True)
        print(f"results: {out_dir}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
