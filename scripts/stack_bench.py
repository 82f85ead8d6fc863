"""Whole-stack benchmark on one machine: rendered repository -> tritonserver + gateway -> `tts-bench` scenarios.

    python scripts/stack_bench.py --work var/stackbench --device cuda --dtype bf16 \
        --benchmark-speech-ratio 7 --out var/stackbench/results [--model-dir DIR] [--render-arg --first-hop=15]

Without `--model-dir` it writes released-size random weights once (`cosyvoice2.testing`), which is why
`--benchmark-speech-ratio` exists: random weights stop at random, so the stack is rendered to generate a fixed,
realistic number of speech tokens per text token. Each scenario is one `tts-bench` run (its table is printed and
its JSON written under `--out`); around each one the Triton metrics are read, and their deltas give the
per-stage breakdown (LLM prefill and step, token2wav call) of that scenario.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO_ROOT), str(REPO_ROOT / "benchmarks")]

from triton_repo.render import RenderOptions, write_repository  # noqa: E402
from triton_repo.server import TritonServer, free_port  # noqa: E402


SPEECH_TOKENS_PER_CHAR = 1.67  # 25 speech tokens per second / ~15 characters per second of read English


def realistic_ratio(model_dir: Path) -> float:
    """Speech tokens per text token that give the built-in sentences natural durations with this tokenizer
    (the random full-size model ships a tiny tokenizer with many more tokens per character than Qwen's)."""
    from cosyvoice2.text.tokenizer import CosyVoice2Tokenizer
    from ttsbench.sentences import SENTENCES

    tokenizer = CosyVoice2Tokenizer.from_model_dir(model_dir)
    chars = sum(len(s) for s in SENTENCES)
    return round(SPEECH_TOKENS_PER_CHAR * chars / sum(len(tokenizer.encode(s)) for s in SENTENCES), 3)


@dataclass(frozen=True)
class Scenario:
    name: str
    target: str  # "triton" | "gateway"
    mode: str  # "streaming" | "offline"
    concurrency: str
    extra: tuple[str, ...] = ()


DEFAULT_SCENARIOS = (
    Scenario("triton-stream", "triton", "streaming", "1,4,16"),
    Scenario("triton-offline", "triton", "offline", "1,8,32"),
    Scenario("gateway-stream-pcm", "gateway", "streaming", "1"),
    Scenario("gateway-offline-pcm", "gateway", "offline", "1"),
    Scenario("gateway-stream-mp3", "gateway", "streaming", "1", ("--response-format", "mp3")),
)


WARMUP_SCENARIOS = (
    Scenario("warmup-stream", "triton", "streaming", "8"),
    Scenario("warmup-offline", "triton", "offline", "8"),
)


def triton_metrics(server: TritonServer) -> dict[str, float]:
    """stat name -> value of every `cosyvoice2_*` metric, summed over models (stat names are unique per family)."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{server.metrics_port}/metrics").read().decode()  # noqa: S310
    out: dict[str, float] = {}
    for name, value in re.findall(r'^cosyvoice2_(\w+)\{[^}]*\} (\S+)$', text, re.M):
        out[name] = out.get(name, 0.0) + float(value)
    return out


def stage_breakdown(before: dict[str, float], after: dict[str, float]) -> dict[str, float | None]:
    """Per-stage means over one scenario, from the counters' deltas."""
    d = {k: after[k] - before.get(k, 0.0) for k in after}

    def ratio(num: str, den: str, scale: float = 1000.0) -> float | None:
        return scale * d[num] / d[den] if d.get(den) else None

    return {
        "llm_prefill_ms_per_request": ratio("llm_prefill_seconds_total", "llm_finished_total"),
        "llm_step_ms": ratio("llm_step_seconds_total", "llm_steps_total"),
        "llm_steps": d.get("llm_steps_total"),
        "token2wav_call_ms": ratio("token2wav_engine_seconds_total", "token2wav_engine_calls_total"),
        "token2wav_chunks_per_call": ratio("token2wav_chunks_total", "token2wav_engine_calls_total", 1.0),
        "token2wav_calls": d.get("token2wav_engine_calls_total"),
    }


def wait_http_ok(url: str, timeout: float, proc: subprocess.Popen) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{proc.args} exited with {proc.returncode}")
        try:
            with urllib.request.urlopen(url, timeout=1) as r:  # noqa: S310
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.3)
    raise RuntimeError(f"{url} not ready after {timeout:.0f} s")


def run_level(scenario: Scenario, concurrency: int, url: str, json_path: Path, requests: int | None,
              timeout: float, warmup: int) -> None:  # fmt: skip
    """One concurrency level of a scenario: one `tts-bench` run (so the metrics deltas around it are this
    level's alone). At least two requests per worker are measured."""
    command = [sys.executable, "-m", "ttsbench", scenario.target, "--url", url, "--mode", scenario.mode,
               "--concurrency", str(concurrency), "--json", str(json_path), "--timeout", str(timeout),
               "--warmup", str(warmup), *scenario.extra]  # fmt: skip
    if requests:
        command += ["--requests", str(max(requests, 2 * concurrency))]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO_ROOT / "benchmarks"), str(REPO_ROOT)])}
    print(f"\n## {scenario.name} c={concurrency}: {' '.join(command[1:])}", flush=True)
    subprocess.run(command, check=True, env=env)  # noqa: S603 - our own module


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--work", type=Path, default=REPO_ROOT / "var" / "stackbench")
    parser.add_argument("--out", type=Path, help="results directory (default: WORK/results)")
    parser.add_argument("--model-dir", type=Path, help="default: released-size random weights under WORK")
    parser.add_argument("--device", default="cuda", choices=("cpu", "cuda"))
    parser.add_argument("--dtype", default="bf16")
    parser.add_argument("--max-batch", type=int, default=32)
    parser.add_argument("--max-seq-len", type=int, default=2048)
    parser.add_argument("--benchmark-speech-ratio", type=float,
                        help="speech tokens per target text token (0 = off: real weights); default: what makes "
                             f"the built-in sentences last {SPEECH_TOKENS_PER_CHAR} tokens per character with this "
                             "model's tokenizer (~15 characters per second of English speech)")
    parser.add_argument("--timeout", type=float, default=120.0, help="deadline of one request, seconds")
    parser.add_argument("--render-arg", action="append", default=[], metavar="FIELD=VALUE",
                        help="extra RenderOptions field, e.g. first_hop=15 or layout=single")
    parser.add_argument("--requests", type=int, help="measured requests per level (tts-bench default otherwise)")
    parser.add_argument("--only", help="comma-separated scenario names (default: all)")
    parser.add_argument("--server-warmup", type=int, default=48,
                        help="unmeasured streaming and offline requests (8 at a time) before the first level")
    parser.add_argument("--warmup", type=int, default=2,
                        help="unmeasured requests per worker before each level (the token2wav CUDA graphs of a "
                             "shape are captured on its second call)")
    args = parser.parse_args(argv)

    out_dir = args.out or args.work / "results"
    out_dir.mkdir(parents=True, exist_ok=True)
    model_dir = args.model_dir
    if model_dir is None:
        model_dir = args.work / "model"
        if not (model_dir / "llm.pt").exists():
            from cosyvoice2.testing import write_full_size_random_model

            started = time.perf_counter()
            write_full_size_random_model(model_dir)
            print(f"wrote random full-size weights in {time.perf_counter() - started:.0f} s", flush=True)
    ratio = args.benchmark_speech_ratio
    if ratio is None:
        ratio = realistic_ratio(model_dir)
        print(f"benchmark mode: {ratio} speech tokens per text token", flush=True)
    extra = {}
    for item in args.render_arg:
        key, _, value = item.partition("=")
        extra[key] = int(value) if value.lstrip("-").isdigit() else value
    options = RenderOptions(
        model_dir=model_dir, out=args.work / "repo", device=args.device, dtype=args.dtype, max_batch=args.max_batch,
        max_seq_len=args.max_seq_len, benchmark_speech_ratio=ratio or None, **extra,
    )  # fmt: skip
    repo = write_repository(options)
    scenarios = [s for s in DEFAULT_SCENARIOS if not args.only or s.name in args.only.split(",")]

    started = time.perf_counter()
    server = TritonServer(model_repository=repo, log_path=args.work / "tritonserver.log")
    gateway: subprocess.Popen | None = None
    results: dict[str, object] = {"render": {k: str(v) for k, v in vars(options).items()}}
    try:
        server.start(ready_timeout=900)
        results["server_ready_s"] = round(time.perf_counter() - started, 1)
        print(f"tritonserver ready in {results['server_ready_s']} s", flush=True)
        if any(s.target == "gateway" for s in scenarios):
            port = free_port()
            env = {**os.environ, "TTS_TRITON_URL": server.grpc_url, "TTS_PORT": str(port), "TTS_HOST": "127.0.0.1"}
            gateway = subprocess.Popen([sys.executable, "-m", "gateway"], env=env, cwd=REPO_ROOT)  # noqa: S603
            wait_http_ok(f"http://127.0.0.1:{port}/ready", 120, gateway)
        if args.server_warmup:
            # Unmeasured: the first calls of each shape run eagerly and the second ones capture CUDA graphs;
            # a server that has been up a while has them all, so the levels below measure that state.
            print(f"\n## server warm-up: {args.server_warmup} streaming + offline requests", flush=True)
            for warm in WARMUP_SCENARIOS:
                run_level(warm, int(warm.concurrency), server.grpc_url, out_dir / f"{warm.name}.json",
                          args.server_warmup, args.timeout, 0)
        for scenario in scenarios:
            url = server.grpc_url if scenario.target == "triton" else f"http://127.0.0.1:{port}"
            for concurrency in (int(c) for c in scenario.concurrency.split(",")):
                name = f"{scenario.name}-c{concurrency}"
                before = triton_metrics(server)
                run_level(scenario, concurrency, url, out_dir / f"{name}.json", args.requests, args.timeout,
                          args.warmup)
                (level,) = json.loads((out_dir / f"{name}.json").read_text())["levels"]
                if level["errors"] == level["requests"]:
                    raise RuntimeError(f"{name}: every request failed; stopping (server log tail saved)")
                results[name] = stage_breakdown(before, triton_metrics(server))
                print(json.dumps(results[name]), flush=True)
    except BaseException:
        print(server.log_tail(80), flush=True)
        raise
    finally:
        if gateway is not None:
            gateway.terminate()
            gateway.wait(10)
        server.cleanup()
        log = args.work / "tritonserver.log"
        if log.exists():  # the last lines travel with the results (a failed request's story is there)
            (out_dir / "tritonserver_tail.log").write_text("\n".join(log.read_text(errors="replace").splitlines()[-400:]))
    (out_dir / "stages.json").write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
