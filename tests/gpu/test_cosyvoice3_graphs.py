"""CosyVoice3's flow step graphs (`cosyvoice3.graphs`) replayed on CUDA give the eager batched solve's mel, caches
and audio, for mixed streams (different prompts, chunk and history lengths; rows padded up to a bucket), on the
machine's last GPU (so a machine with several checks a device other than the current one). TF32 is off: fp32
compares fp32. The tiny model with small buckets checks the padding and the static buffers fast; the released size
(marked slow) captures every bucket a server captures and compares calls of 1 and 16 streams at the real shapes,
then hands its GPU memory back (`frees_cuda_memory`). The windowed vocoder's graphs (`cosyvoice3.vocoder_graphs`),
captured there with the served schedule's buckets, replay what its eager calls give (samples and stream states).
tests/cosyvoice3/test_flow_graphs.py and tests/cosyvoice3/test_vocoder_graphs.py check the same buckets emulated on
the CPU."""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch

from cosyvoice3.config import CosyVoice3Config
from cosyvoice3.flow import CosyVoice3Flow
from cosyvoice3.graphs import FlowStepGraphs
from cosyvoice3.hift import CausalHiFT
from cosyvoice3.loading import load_config, load_flow, load_hift
from cosyvoice3.testing import write_tiny_model
from cosyvoice3.token2wav import CosyVoice3Token2Wav, VoicePrompt, runtime_schedule
from cosyvoice3.vocoder_graphs import WindowBuckets, WindowGraphs
from tests.cosyvoice3.test_flow_graphs import BUCKETS, MIXES, recording, run_plans
from tests.cosyvoice3.test_vocoder_graphs import ROWS, STREAMS, run_streams
from tests.cosyvoice3.test_vocoder_graphs import recording as vocoder_recording
from tests.cosyvoice3.test_windowed_vocoder import tiny_hift

REPLAY_ATOL = 1e-4  # fp32 mel
AUDIO_OF_SCALE = 5e-3


def last_gpu(gpus: int) -> torch.device:
    return torch.device("cuda", gpus - 1)


@pytest.mark.parametrize("final_over_cache", [False, True], ids=["cached", "chunked"])
def test_replayed_graphs_equal_eager_on_the_tiny_model(gpus, no_tf32, tmp_path, final_over_cache) -> None:
    """Both flow-cache modes: with `final_over_cache` the streams' final chunks replay from the buckets too."""
    device = last_gpu(gpus)
    path = write_tiny_model(tmp_path / "cv3", seed=5, text_frontend=False)
    config = load_config(path)
    token2wav = CosyVoice3Token2Wav(load_flow(path / "flow.pt", config, device),
                                    load_hift(path / "hift.pt", config, device), final_over_cache=final_over_cache)
    graphs = FlowStepGraphs(token2wav.flow.estimator, BUCKETS)
    assert graphs.capture_all(device, torch.float32) == len(BUCKETS.shapes())
    for name, plans in MIXES.items():
        eager = run_plans(token2wav, plans, None)
        calls = recording(graphs)
        replayed = run_plans(token2wav, plans, graphs)
        assert any(shape is not None for _, shape in calls), name
        for stream in range(len(plans)):
            for a, b in zip(eager.mels[stream], replayed.mels[stream], strict=True):
                assert a.shape == b.shape and float((a - b).abs().max()) <= REPLAY_ATOL, name
            ours, theirs = np.concatenate(replayed.pieces[stream]), np.concatenate(eager.pieces[stream])
            assert float(np.abs(ours - theirs).max()) <= AUDIO_OF_SCALE * float(np.abs(theirs).max()), name


def test_vocoder_graphs_replay_the_eager_calls_on_the_tiny_model(gpus, no_tf32) -> None:
    """Every bucket of the served schedule (rows 1, 2, 4) captured on the last GPU; streams of several chunks in
    shared calls (rows and windows padded) replay the eager calls' samples and leave the same stream states; only
    the final calls run eagerly."""
    device = last_gpu(gpus)
    hift = tiny_hift(voiced=True).to(device)
    graphs = WindowGraphs(hift, WindowBuckets.covering(hift, [runtime_schedule()], 2, ROWS))
    assert graphs.capture_all(device) == len(graphs.shapes()) == graphs.count
    eager_audio, eager_states = run_streams(hift, None)
    calls = vocoder_recording(graphs)
    audio, states = run_streams(hift, graphs)
    non_final = [shape for (_, _, _, final), shape in calls if not final]
    assert non_final and all(shape is not None for shape in non_final)
    assert (graphs.replayed_calls, graphs.eager_calls) == (len(non_final), len(calls) - len(non_final))
    for name in STREAMS:
        for k, (ours, theirs) in enumerate(zip(audio[name], eager_audio[name], strict=True)):
            assert ours.device == device and ours.shape == theirs.shape, (name, k)
            worst = float((ours - theirs).abs().max()) if ours.numel() else 0.0
            assert worst <= 1e-3 * float(theirs.abs().max()), (name, k, worst)
        for ours, theirs in zip(states[name], eager_states[name], strict=True):
            assert (ours.frames, ours.sent, ours.phase_frame) == (theirs.frames, theirs.sent, theirs.phase_frame)
            assert torch.equal(ours.mel, theirs.mel) and (ours.phase is None) == (theirs.phase is None)
            if ours.phase is not None:
                torch.testing.assert_close(ours.phase, theirs.phase, rtol=0, atol=1e-5)


@pytest.fixture
def released_fp32(gpus, frees_cuda_memory):
    """The released-size token2wav (random weights) in fp32 on the last GPU. Its step graphs' shared static buffers
    take 15.7 GiB in fp32 (`StaticPlan`); at teardown they are dropped first, then `frees_cuda_memory` hands the
    rest back."""
    torch.manual_seed(0)
    config = CosyVoice3Config()
    device = last_gpu(gpus)
    flow = CosyVoice3Flow(config.flow).to(device, torch.float32).eval()
    hift = CausalHiFT(config.hift)
    hift.fold_weight_norm()
    engine = CosyVoice3Token2Wav(flow, hift.to(device).eval())
    yield engine
    engine.graphs.clear()


@torch.inference_mode()
def first_chunks(engine: CosyVoice3Token2Wav, voice: VoicePrompt, tokens: list[int], streams: int, chunks: int):
    """`streams` fresh cached streams advanced by `chunks` chunks (eagerly), with their next chunk."""
    graphs, engine.graphs = engine.graphs, None
    try:
        work = []
        for _ in range(streams):
            stream = engine.open_stream(voice, cached=True)
            stream.extend(tokens)
            for _ in range(chunks):
                stream.run(stream.next_chunk(finished=False))
            work.append((stream, stream.next_chunk(finished=False)))
        return work
    finally:
        engine.graphs = graphs


def next_mels(engine: CosyVoice3Token2Wav, voice: VoicePrompt, tokens: list[int], streams: int, chunks: int,
              graphs: bool) -> list[torch.Tensor]:
    """The mel of the next chunk of `streams` streams advanced by `chunks` chunks, all in one `run_chunks` call,
    replayed (`graphs`, every solve in a bucket) or eager. Only the mels outlive the call: 16 streams' fp32 flow
    caches take about 20 GB, so the two modes' streams never coexist."""
    work = first_chunks(engine, voice, tokens, streams, chunks)
    saved = engine.graphs
    calls = recording(saved)
    if not graphs:
        engine.graphs = None  # type: ignore[assignment]
    try:
        engine.run_chunks(work)
    finally:
        engine.graphs = saved
    if graphs:
        assert calls and all(shape is not None for _, shape in calls), calls
    return [stream.last_mel for stream, _ in work]


@pytest.mark.slow
def test_released_size_replays_equal_eager(released_fp32: CosyVoice3Token2Wav, no_tf32) -> None:
    """fp32 at the released size with every served bucket (120 graphs); calls of 1 and 16 streams at their first
    chunks (history bucket 256) and of 8 streams at their third (512, longer chunks). 16 streams' third chunks run
    eagerly in fp32 do not fit an 80 GB GPU beside the graphs' pools (out of memory on an H100)."""
    engine = released_fp32
    device = engine.flow_device
    started = time.perf_counter()
    count = engine.graphs.capture_all(device, torch.float32)
    plan = engine.graphs.plan(torch.float32)
    print(f"captured {count} graphs in {time.perf_counter() - started:.1f} s; static buffers {plan.describe()}; "
          f"{torch.cuda.memory_allocated(device) / 2**30:.2f} GiB allocated, "
          f"{torch.cuda.memory_reserved(device) / 2**30:.2f} GiB reserved")
    assert count == len(engine.graphs.buckets.shapes())
    assert engine.graphs.static_bytes() == plan.total
    gen = torch.Generator().manual_seed(1)
    voice = VoicePrompt(torch.randint(0, 6561, (150,), generator=gen), torch.randn(300, 80, generator=gen),
                        torch.randn(192, generator=gen))
    tokens = torch.randint(0, 6561, (400,), generator=gen).tolist()
    for streams, chunks in ((1, 0), (16, 0), (8, 2)):
        eager = next_mels(engine, voice, tokens, streams, chunks, graphs=False)
        replayed = next_mels(engine, voice, tokens, streams, chunks, graphs=True)
        worst = max(float((a - b).abs().max()) for a, b in zip(eager, replayed, strict=True))
        assert worst <= REPLAY_ATOL, (streams, chunks, worst)
    print(f"peak {torch.cuda.max_memory_allocated(device) / 2**30:.2f} GiB allocated")
