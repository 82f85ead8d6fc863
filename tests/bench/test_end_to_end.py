"""tts-bench against a real tritonserver running the stand-in pipeline, directly and through a
real gateway process. Checks what was counted and measured, never how fast it was."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from tests.bench.wavfiles import write_wav
from tests.gateway.standin_model.repository import render_standin_repository
from pipeline_contract import OUTPUT_SAMPLE_RATE
from tests.gateway.standin_model.standin import read_request_log, voice_cache_entry
from triton_repo.server import REPO_ROOT, TritonServer, free_port
from ttsbench.arrivals import draw_requests
from ttsbench.cli import main

pytestmark = pytest.mark.triton

CHUNK_COUNT = 3  # responses per streaming request from the stand-in
#: Each text carries one stand-in tag word (zq...), which the stand-in logs with its output.
GOOD_TEXTS = {
    "short": "zqshort hello there.",
    "medium": "zqmedium the train leaves at seven fifteen tonight.",
    "long": "zqlong she opened the old wooden box and found a stack of letters tied with ribbon.",
}
FAILING_TEXTS = {"failstart": "zqbroken failstart nothing comes out.", "failmid": "zqhalf failmid some audio then an error."}


@dataclass
class Stack:
    triton: TritonServer
    gateway_url: str
    marker_dir: Path
    voices_dir: Path

    def produced_samples(self) -> dict[str, int]:
        """Samples the stand-in produced per tag, for requests it completed."""
        rows = read_request_log(self.marker_dir)
        produced: dict[str, set[int]] = {}
        for row in rows:
            if row["outcome"] == "done":
                produced.setdefault(row["tag"], set()).add(row["samples"])
        assert all(len(v) == 1 for v in produced.values()), produced  # deterministic per text
        return {tag: samples.pop() for tag, samples in produced.items()}


class GatewayExited(RuntimeError):
    pass


def _wait_ready(url: str, proc: subprocess.Popen, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise GatewayExited(f"gateway exited with {proc.returncode}")
        try:
            if httpx.get(f"{url}/ready", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    raise RuntimeError("gateway not ready")


def _start_gateway(env: dict[str, str], attempts: int = 3) -> tuple[subprocess.Popen, str]:
    """`python -m gateway` on a free port. The port was free when chosen, but another process may bind it
    before the gateway does (it then exits): start again on a new one."""
    for attempt in range(1, attempts + 1):
        port = free_port()
        gateway = subprocess.Popen(  # noqa: S603
            [sys.executable, "-m", "gateway"], cwd=REPO_ROOT, env={**env, "TTS_PORT": str(port)}
        )
        url = f"http://127.0.0.1:{port}"
        try:
            _wait_ready(url, gateway)
            return gateway, url
        except GatewayExited:
            if attempt == attempts:
                raise
        except BaseException:
            gateway.kill()
            gateway.wait()
            raise
    raise AssertionError("unreachable")


@pytest.fixture(scope="module")
def stack(triton_server_factory, tmp_path_factory) -> Iterator[Stack]:
    root = tmp_path_factory.mktemp("bench_stack")
    voices = root / "voices"
    voices.mkdir()
    write_wav(voices / "anna.wav", 1.0, freq=200.0)
    (voices / "anna.txt").write_text("Anna speaks.", encoding="utf-8")
    write_wav(voices / "bo.wav", 0.7, rate=16_000, channels=1, freq=320.0)
    (voices / "bo.txt").write_text("博说话。", encoding="utf-8")
    markers = root / "markers"
    repository = render_standin_repository(root / "models", markers, chunk_count=CHUNK_COUNT, chunk_delay_ms=5)
    triton = triton_server_factory(repository)

    env = dict(os.environ, TTS_TRITON_URL=triton.grpc_url, TTS_HOST="127.0.0.1",
               TTS_VOICES_DIR=str(voices), TTS_LOG_LEVEL="warning")
    gateway, url = _start_gateway(env)
    try:
        yield Stack(triton, url, markers, voices)
    finally:
        gateway.terminate()
        try:
            gateway.wait(10)
        except subprocess.TimeoutExpired:
            gateway.kill()
        triton.cleanup()


def _manifest(path: Path, voices: Path, texts: dict[str, str]) -> Path:
    lines = []
    for i, (item_id, text) in enumerate(texts.items()):
        name, transcript = (("anna", "Anna speaks."), ("bo", "博说话。"))[i % 2]
        row = {"id": item_id, "prompt_audio": str(voices / f"{name}.wav"), "prompt_text": transcript, "target_text": text}
        lines.append(json.dumps(row, ensure_ascii=False))
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def _run(tmp_path: Path, target: str, url: str, manifest: Path, *extra: str) -> dict:
    out = tmp_path / f"{target}.json"
    argv = [target, "--url", url, "--manifest", str(manifest), "--concurrency", "1,2", "--json", str(out), *extra]
    assert main(argv) == 0
    return json.loads(out.read_text())


def _tag(text: str) -> str:
    return next(w for w in text.replace(".", "").split() if w.startswith("zq"))


def _check_levels(doc: dict, stack: Stack, modes: list[str], requests: int, texts: dict[str, str]) -> None:
    produced = stack.produced_samples()
    assert [(lv["mode"], lv["concurrency"]) for lv in doc["levels"]] == [(m, c) for m in modes for c in (1, 2)]
    for level in doc["levels"]:
        assert level["requests"] == requests == len(level["records"])
        assert level["errors"] == 0
        expected_audio = 0.0
        for record in level["records"]:
            samples = produced[_tag(texts[record["item_id"]])]
            assert record["audio_seconds"] == pytest.approx(samples / OUTPUT_SAMPLE_RATE, abs=1e-9)
            assert record["chunk_offsets"] and record["chunk_offsets"][0] <= record["total"]
            assert record["chunk_offsets"] == sorted(record["chunk_offsets"])
            assert len(record["chunk_seconds"]) == len(record["chunk_offsets"])
            assert sum(record["chunk_seconds"]) == pytest.approx(record["audio_seconds"])
            expected_audio += samples / OUTPUT_SAMPLE_RATE
        assert level["audio_seconds"] == pytest.approx(expected_audio)
        assert level["total"]["count"] == requests and level["first_chunk"]["count"] == requests
        if "streaming" in level["mode"]:  # every successful stream is replayed for stalls
            assert level["stalls"]["streams"] == requests
        else:
            assert level["stalls"] is None


def test_triton_offline_and_streaming(stack, tmp_path, capsys):
    manifest = _manifest(tmp_path / "good.jsonl", stack.voices_dir, GOOD_TEXTS)
    doc = _run(tmp_path, "triton", stack.triton.grpc_url, manifest, "--requests", "4", "--seed", "7")
    _check_levels(doc, stack, ["triton/streaming", "triton/offline"], 4, GOOD_TEXTS)
    for level in doc["levels"]:
        chunks = CHUNK_COUNT if level["mode"] == "triton/streaming" else 1
        assert all(len(r["chunk_offsets"]) == chunks for r in level["records"])
    printed = capsys.readouterr().out
    assert "== triton/streaming ==" in printed and "== triton/offline ==" in printed


def test_gateway_audio_stream_and_offline(stack, tmp_path):
    manifest = _manifest(tmp_path / "good.jsonl", stack.voices_dir, GOOD_TEXTS)
    doc = _run(tmp_path, "gateway", stack.gateway_url, manifest, "--requests", "3")
    _check_levels(doc, stack, ["gateway/streaming-audio", "gateway/offline"], 3, GOOD_TEXTS)
    offline = [lv for lv in doc["levels"] if lv["mode"] == "gateway/offline"]
    assert all(len(r["chunk_offsets"]) == 1 for lv in offline for r in lv["records"])  # the whole file at once


def test_gateway_sse_stream(stack, tmp_path):
    manifest = _manifest(tmp_path / "good.jsonl", stack.voices_dir, GOOD_TEXTS)
    doc = _run(tmp_path, "gateway", stack.gateway_url, manifest, "--requests", "3", "--mode", "streaming",
               "--stream-format", "sse")
    _check_levels(doc, stack, ["gateway/streaming-sse"], 3, GOOD_TEXTS)
    for level in doc["levels"]:
        assert all(len(r["chunk_offsets"]) == CHUNK_COUNT for r in level["records"])  # one delta per chunk


@pytest.mark.parametrize(
    ("target", "options", "levels"),
    [("triton", (), 4), ("gateway", (), 4), ("gateway", ("--mode", "streaming", "--stream-format", "sse"), 2)],
    ids=["triton", "gateway-audio", "gateway-sse"],
)
def test_failures_are_counted(stack, tmp_path, target, options, levels):
    texts = {**GOOD_TEXTS, **FAILING_TEXTS}
    manifest = _manifest(tmp_path / "mixed.jsonl", stack.voices_dir, texts)
    url = stack.triton.grpc_url if target == "triton" else stack.gateway_url
    doc = _run(tmp_path, target, url, manifest, "--requests", str(len(texts)), "--warmup", "0", *options)
    produced = stack.produced_samples()
    assert len(doc["levels"]) == levels
    for level in doc["levels"]:
        failed = {r["item_id"] for r in level["records"] if r["error"]}
        assert failed == set(FAILING_TEXTS), level["mode"]
        assert level["errors"] == len(FAILING_TEXTS) and level["requests"] == len(texts)
        good = [r for r in level["records"] if not r["error"]]
        assert level["audio_seconds"] == pytest.approx(
            sum(produced[_tag(texts[r["item_id"]])] for r in good) / OUTPUT_SAMPLE_RATE
        )
        assert level["total"]["count"] == len(GOOD_TEXTS)


def test_gateway_refuses_inputs_with_unknown_voices(stack, tmp_path, capsys):
    write_wav(tmp_path / "stranger.wav", 0.5, freq=440.0)
    manifest = tmp_path / "stranger.jsonl"
    manifest.write_text(json.dumps({"prompt_audio": "stranger.wav", "prompt_text": "who", "target_text": "zqx hi."}))
    assert main(["gateway", "--url", stack.gateway_url, "--manifest", str(manifest), "--concurrency", "1"]) == 2
    assert "does not know 1 voice" in capsys.readouterr().err


def test_open_loop_rates_against_triton(stack, tmp_path, capsys):
    """Seeded Poisson arrivals at two rates: the requests the seed draws from the mix, each streamed, its audio the
    stand-in's, failures counted as errors."""
    texts = {**GOOD_TEXTS, **FAILING_TEXTS}
    manifest = _manifest(tmp_path / "mixed.jsonl", stack.voices_dir, texts)
    out = tmp_path / "open.json"
    argv = ["triton", "--url", stack.triton.grpc_url, "--manifest", str(manifest), "--rates", "5,10",
            "--requests", "8", "--arrival-seed", "4", "--warmup", "0", "--json", str(out)]  # fmt: skip
    assert main(argv) == 0
    doc = json.loads(out.read_text())
    produced = stack.produced_samples()
    picks = draw_requests(list(texts), 8, 4)  # the manifest's ids, in its order
    assert doc["levels"] == [] and doc["rate_search"] is None
    assert [(r["mode"], r["rate"]) for r in doc["rates"]] == [("triton/streaming", 5.0), ("triton/streaming", 10.0)]
    for rate in doc["rates"]:
        assert [r["item_id"] for r in rate["records"]] == picks
        failed = [r for r in rate["records"] if r["error"]]
        assert {r["item_id"] for r in failed} == set(FAILING_TEXTS) & set(picks)
        assert rate["errors"] == len(failed) == sum(p in FAILING_TEXTS for p in picks)
        good = [r for r in rate["records"] if not r["error"]]
        assert all(len(r["chunk_offsets"]) == CHUNK_COUNT for r in good)
        assert rate["audio_seconds"] == pytest.approx(
            sum(produced[_tag(texts[r["item_id"]])] for r in good) / OUTPUT_SAMPLE_RATE)
        assert rate["first_chunk"]["count"] == rate["stalls"]["streams"] == len(good)
        assert rate["achieved_rate"] > 0 and rate["send_lag"]["count"] == 8 and 1 <= rate["max_in_flight"] <= 8
    printed = capsys.readouterr().out
    assert "== triton/streaming, open loop ==" in printed and "p95" in printed


def test_open_loop_rate_search_through_the_gateway(stack, tmp_path, capsys):
    """A short search (three steps of four requests): its steps are rates of the document, each verdict is the
    bound applied to that rate's numbers, and the sustained rate is what the verdicts say."""
    manifest = _manifest(tmp_path / "good.jsonl", stack.voices_dir, GOOD_TEXTS)
    out = tmp_path / "search.json"
    argv = ["gateway", "--url", stack.gateway_url, "--manifest", str(manifest), "--rate-search", "2",
            "--rate-bounds", "1,4", "--search-steps", "3", "--requests", "4", "--json", str(out)]  # fmt: skip
    assert main(argv) == 0
    doc = json.loads(out.read_text())
    search = doc["rate_search"]
    steps = search["steps"]
    assert 1 <= len(steps) <= 3 and steps[0]["rate"] == 2.0
    assert [s["rate"] for s in steps] == [r["rate"] for r in doc["rates"]]
    for step, rate in zip(steps, doc["rates"], strict=True):
        assert rate["mode"] == "gateway/streaming-audio" and rate["requests"] == 4
        met = rate["errors"] == 0 and rate["stalls"]["stalled"] == 0 and rate["first_chunk"]["p95"] <= 0.5
        assert step["met"] == met and (step["misses"] == []) == met
    failed = [s["rate"] for s in steps if not s["met"]]
    passed = [s["rate"] for s in steps if s["met"] and (not failed or s["rate"] < min(failed))]
    assert search["sustained_rate"] == (max(passed) if passed else None)
    assert search["failed_above"] == (min(failed) if failed else None)
    printed = capsys.readouterr().out
    assert "== gateway/streaming-audio, open-loop rate search ==" in printed and "meets" in printed
    assert ("sustained open-loop rate" in printed) == bool(passed)



async def test_the_triton_target_sends_a_served_voice_by_id_and_resends_an_unknown_one(stack, tmp_path):
    from ttsbench.inputs import default_requests
    from ttsbench.targets import TritonTarget

    voices = tmp_path / "voices"
    voices.mkdir()
    write_wav(voices / "cleo.wav", 0.8, freq=260.0)
    (voices / "cleo.txt").write_text("Cleo speaks.", encoding="utf-8")
    first, second, third = default_requests(voices, ["One zqidfirst.", "Two zqidsecond.", "Three zqidthird."])
    target = TritonTarget(stack.triton.grpc_url, streaming=True)
    try:
        for request in (first, second):
            assert [p async for p in target.synthesize(request)]
        # the pipeline lost the voice (a restart, another replica): refused by id, served again with the audio
        voice_cache_entry(stack.marker_dir, first.voice.id).unlink()
        assert [p async for p in target.synthesize(third)]
    finally:
        await target.aclose()
    sent = {}
    for entry in read_request_log(stack.marker_dir):
        if entry.get("tag") in ("zqidfirst", "zqidsecond", "zqidthird"):
            sent.setdefault(entry["tag"], []).append(entry["carries_audio"])
    assert sent == {"zqidfirst": [True], "zqidsecond": [False], "zqidthird": [False, True]}
