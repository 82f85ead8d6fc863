"""HiFT's CUDA-graph buckets (`cosyvoice2.hift.generator.HiFTGraphs`), checked on the CPU: a call padded to its
bucket - rows, mel frames, the cache source to the buckets' fixed length, all through the static buffers -
gives the audio and source of the unpadded eager call (`HiFTGraphs.emulate` runs the padded path eagerly); a call
that fits no bucket runs eagerly and is counted; and every HiFT call the token2wav service forms for the served
schedules fits a bucket. tests/gpu/test_hift_graphs.py replays the captured graphs on a GPU."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from cosyvoice2.hift import HiFTGenerator
from cosyvoice2.hift.generator import HiFTBuckets
from tests.engine.micro_modules import TINY_HIFT, randomized

TOL = dict(rtol=1e-5, atol=1e-5)
OVERLAP = 8 * 480  # source samples a chunk leaves to the next (8 mel frames)
BUCKETS = HiFTBuckets(rows=(1, 2, 4), frames=(32, 64), cache_samples=OVERLAP)


@pytest.fixture(scope="module")
def eager() -> HiFTGenerator:
    return randomized(lambda: HiFTGenerator(TINY_HIFT), seed=4)


@pytest.fixture
def padded(eager) -> HiFTGenerator:
    """The same weights, every call that fits `BUCKETS` run through the padded path."""
    hift = HiFTGenerator(TINY_HIFT).eval()
    hift.load_state_dict(eager.state_dict())
    hift.cuda_graphs.use_buckets(BUCKETS)
    hift.cuda_graphs.emulate = True
    return hift


def hift_rows(hift: HiFTGenerator, frames: list[int], caches: list[int], seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    mels = [torch.randn(1, 80, m, generator=gen) * 2 for m in frames]
    cache_sources = [torch.randn(1, 1, c, generator=gen) * 0.5 if c else None for c in caches]
    noises = [hift.draw_noise(1, m, torch.Generator().manual_seed(seed + i)) for i, m in enumerate(frames)]
    return mels, cache_sources, noises


def assert_same(got, want) -> None:
    assert len(got) == len(want)
    for (audio, source), (want_audio, want_source) in zip(got, want):
        assert audio.shape == want_audio.shape and source.shape == want_source.shape
        assert want_audio.abs().max() > 0.05  # a real signal, not silence
        torch.testing.assert_close(audio, want_audio, **TOL)
        torch.testing.assert_close(source, want_source, **TOL)


@pytest.mark.parametrize("frames, caches", [
    ([40, 21, 33], [OVERLAP, 0, OVERLAP]),  # 3 rows -> 4, 40 frames -> 64, caches padded to the fixed length
    ([58], [0]),  # a first chunk: no cache source at all, padded to the fixed length
    ([9, 17], [0, 0]),  # short rows -> 32 frames
    ([64, 64, 64, 64], [OVERLAP] * 4),  # exactly a bucket
], ids=["rows-frames-cache", "no-cache", "short", "exact"])
@torch.inference_mode()
def test_a_call_padded_to_its_bucket_gives_the_unpadded_audio(eager, padded, frames, caches) -> None:
    inputs = hift_rows(eager, frames, caches)
    want = eager.inference_batch(*inputs)
    got = padded.inference_batch(*inputs)
    assert_same(got, want)
    graphs = padded.cuda_graphs
    assert (graphs.replayed_calls, graphs.eager_calls) == (1, 0)


@torch.inference_mode()
def test_the_static_buffers_keep_nothing_of_an_earlier_larger_call(eager, padded) -> None:
    """A larger call fills more of the shared buffers; a smaller one after it must see only its own rows."""
    big = hift_rows(eager, [64, 60, 50, 30], [OVERLAP] * 4, seed=1)
    small = hift_rows(eager, [20, 12], [OVERLAP, 0], seed=2)
    padded.inference_batch(*big)
    assert_same(padded.inference_batch(*small), eager.inference_batch(*small))
    assert padded.cuda_graphs.replayed_calls == 2


@torch.inference_mode()
def test_rows_longer_than_every_bucket_run_eagerly_beside_the_replayed_ones(eager, padded) -> None:
    """An offline utterance (longer than the longest bucket) in a call of streaming chunks: the chunks still replay,
    the utterance runs in an eager forward of its own; each row equals its unpadded eager result."""
    inputs = hift_rows(eager, [40, 150, 21], [OVERLAP, 0, 0], seed=3)
    assert_same(padded.inference_batch(*inputs), eager.inference_batch(*inputs))
    graphs = padded.cuda_graphs
    assert (graphs.replayed_calls, graphs.eager_calls) == (1, 1)


@torch.inference_mode()
def test_calls_that_fit_no_bucket_run_eagerly_and_are_counted(eager, padded) -> None:
    five_rows = hift_rows(eager, [30] * 5, [0] * 5)  # more rows than the largest bucket
    long_cache = hift_rows(eager, [40], [2 * OVERLAP])  # a cache source longer than the buckets' fixed one
    assert_same(padded.inference_batch(*five_rows), eager.inference_batch(*five_rows))
    assert_same(padded.inference_batch(*long_cache), eager.inference_batch(*long_cache))
    graphs = padded.cuda_graphs
    assert (graphs.replayed_calls, graphs.eager_calls, graphs.count) == (0, 2, 0)  # and nothing was captured


def test_buckets_are_rounded_up_and_ordered_largest_first() -> None:
    buckets = HiFTBuckets.covering([2, 16, 17, 108, 208, 212], rows=(4, 1, 2), cache_samples=OVERLAP, frame_step=16)
    assert buckets.rows == (1, 2, 4) and buckets.frames == (16, 32, 112, 208, 224)
    assert buckets.fit(3, 100, OVERLAP) == (4, 112)
    assert buckets.fit(3, 100, OVERLAP + 1) is None and buckets.fit(5, 10, 0) is None and buckets.fit(1, 225, 0) is None
    shapes = buckets.shapes()
    assert shapes[0] == (4, 224) and shapes[-1] == (1, 16) and len(shapes) == 15
    hift = HiFTGenerator(TINY_HIFT)
    with pytest.raises(ValueError, match="shorter than the cache source"):
        hift.cuda_graphs.use_buckets(HiFTBuckets((1,), (4,), OVERLAP))  # 4 frames hold 1920 samples


# ---- the buckets against what the token2wav service forms ---------------------------------------------------
@pytest.mark.parametrize("schedule_params", [{"align_first_hop": "always"}, {"align_first_hop": "never"},
                                             {"align_first_hop": "busy"},
                                             {"first_hop": 15, "align_first_hop": "never"},
                                             {"align_first_hop": "busy", "lone_first_hop": 12}],
                         ids=["upstream", "unaligned", "busy", "unaligned-15", "busy-lone-12"])
def test_buckets_cover_every_call_of_the_served_schedules(tiny_model_dir, schedule_params) -> None:
    """Every HiFT call the token2wav service can form - up to `max_rows` streams' chunks of any of the schedules the
    orchestrator cuts by, for every alignment of the voice prompt, streams of 1 to 300 tokens - fits a bucket of the
    engine's HiFT graphs. A chunk's HiFT input is its tokens' mel frames after the 8 the previous chunk withheld,
    with that chunk's last 3840 source samples (`Token2WavStream.hift_input`); rows are padded to the call's
    longest, the cache source to the longest present."""
    from cosyvoice2.config import EngineConfig
    from cosyvoice2.loading import FLOW_FILE, HIFT_FILE, load_flow, load_hift
    from speech_serving.engines import BatchedToken2Wav
    from speech_serving.schedule import StreamScheduleParams, for_prompt

    config = EngineConfig.for_model_dir(tiny_model_dir)
    params = StreamScheduleParams(**schedule_params)
    engine = BatchedToken2Wav(load_flow(tiny_model_dir / FLOW_FILE, config, torch.device("cpu"), torch.float32),
                              load_hift(tiny_model_dir / HIFT_FILE, config, torch.device("cpu")), config,
                              params.schedule(config), schedules=params.schedules(config))
    buckets = engine.engine.hift.cuda_graphs.buckets
    ratio, withheld = config.flow.token_mel_ratio, config.streaming.mel_cache_len
    overlap = withheld * config.hift.samples_per_frame
    assert buckets.cache_samples == overlap
    checked = 0
    for schedule in params.schedules(config):
        for prompt_tokens in range(25):
            for tokens in range(1, 301):
                for index, chunk in enumerate(for_prompt(schedule, prompt_tokens).chunks(tokens)):
                    frames = ratio * (chunk.stop - chunk.start) + (withheld if index else 0)
                    if frames == 0:  # an empty stream: nothing to vocode
                        continue
                    for rows in (1, 3, engine.max_rows):
                        assert buckets.fit(rows, frames, overlap) is not None, (prompt_tokens, tokens, chunk, frames)
                    checked += 1
    assert checked > 20_000
    assert max(buckets.rows) == engine.max_rows  # the service's cap is the largest bucket of rows
    assert buckets.fit(engine.max_rows + 1, min(buckets.frames), 0) is None


@torch.inference_mode()
def test_served_streams_replay_every_hift_call(tiny_model_dir) -> None:
    """Streams of different voice prompts (so different first hops), batched the way the service batches them, on
    an engine whose HiFT runs every call through the padded path: no call runs eagerly, and every stream's audio
    equals that of an engine without graphs."""
    from dataclasses import replace

    from cosyvoice2.config import EngineConfig
    from cosyvoice2.loading import FLOW_FILE, HIFT_FILE, load_flow, load_hift
    from speech_serving.engines import BatchedToken2Wav
    from speech_serving.io_struct import PromptTensors
    from speech_serving.schedule import StreamScheduleParams
    from speech_serving.token2wav import Work

    config = EngineConfig.for_model_dir(tiny_model_dir)
    params = StreamScheduleParams(align_first_hop="always")

    def engine(emulate: bool) -> BatchedToken2Wav:
        flow = load_flow(tiny_model_dir / FLOW_FILE, config, torch.device("cpu"), torch.float32)
        built = BatchedToken2Wav(flow, load_hift(tiny_model_dir / HIFT_FILE, config, torch.device("cpu")), config,
                                 params.schedule(config), schedules=params.schedules(config))
        built.engine.hift.cuda_graphs.emulate = emulate
        return built

    rng = np.random.default_rng(5)
    prompts = [PromptTensors(rng.integers(0, 100, p).astype(np.int32), rng.standard_normal((2 * p, 80)).astype(np.float32),
                             rng.standard_normal(192).astype(np.float32)) for p in (7, 13, 30)]
    tokens = [rng.integers(0, 100, n).astype(np.int32) for n in (90, 260, 41)]

    calls = []

    def run(t2w: BatchedToken2Wav) -> list[np.ndarray]:
        states = [t2w.open(prompt, seed=3) for prompt in prompts]
        plans = [replace(t2w.schedule, prompt_tokens=len(p.speech_tokens)).chunks(len(t)) for p, t in zip(prompts, tokens)]
        outputs: list[list[np.ndarray]] = [[] for _ in prompts]
        sent = [0] * len(prompts)
        for round_ in range(max(len(plan) for plan in plans)):
            live = [s for s, plan in enumerate(plans) if round_ < len(plan)]
            work = []
            for s in live:
                chunk = plans[s][round_]
                work.append(Work(states[s], tokens[s][sent[s] : chunk.feed], chunk))
                sent[s] = chunk.feed
            calls.append(len(work))
            for s, result in zip(live, t2w.run(work)):
                assert not isinstance(result, Exception), result
                outputs[s].append(result)
        return [np.concatenate(out) for out in outputs]

    replayed, plain = engine(emulate=True), engine(emulate=False)
    for ours, theirs, n in zip(run(replayed), run(plain), (90, 260, 41)):
        assert ours.size == theirs.size == 960 * n
        np.testing.assert_allclose(ours, theirs, atol=1e-4)
    graphs = replayed.engine.hift.cuda_graphs
    assert len(calls) == 2 * 4 and max(calls) == 3  # 4 calls per engine, one HiFT forward each
    assert (graphs.replayed_calls, graphs.eager_calls) == (4, 0)
    assert replayed.hift_calls() == (graphs.replayed_calls, 0)
