"""The DiT flow's step graphs (`cosyvoice2.dit.graphs`): calls padded to (rows, chunk frames, cache frames) buckets
give every stream what the eager path gives it, a call outside the buckets runs eagerly, and the buckets cover
every chunk of the served schedule. On CPU the buckets run emulated (static buffers, padding, no capture); the
replay itself is checked on a GPU by tests/gpu/test_dit_graphs.py."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from cosyvoice2.config import EngineConfig
from cosyvoice2.dit.flow import FlowState
from cosyvoice2.dit.graphs import DiTGraphBuckets, DiTStepGraphs, max_prompt_frames
from speech_lm.graph_buckets import concrete_device
from cosyvoice2.dit.loading import load_dit_token2wav
from cosyvoice2.dit.token2wav import DiTToken2Wav
from cosyvoice2.streaming import Chunk, ChunkSchedule
from cosyvoice2.testing.dit import write_dit_model
from speech_serving.engines import DiTBatchedToken2Wav
from speech_serving.schedule import StreamScheduleParams, for_prompt

MEL_ATOL = 5e-5
AUDIO_ATOL = 5e-3
# small buckets for the micro model: every dimension of the test calls gets padded
BUCKETS = DiTGraphBuckets(rows=(1, 2, 4, 8), chunk_frames=(32, 64, 96), cache_frames=(64, 128, 192, 256))


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> DiTToken2Wav:
    return load_dit_token2wav(write_dit_model(tmp_path_factory.mktemp("dit_graphs"), seed=5))


def voice(seed: int, tokens: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    return (rng.integers(0, 6561, tokens), rng.standard_normal((2 * tokens, 80)).astype(np.float32) - 5,
            rng.standard_normal(192).astype(np.float32))


def speech(n: int, seed: int) -> list[int]:
    return np.random.default_rng(1000 + seed).integers(0, 6561, n).tolist()


# (prompt tokens, first hop, tokens) per stream: chunk lengths, cache lengths and prompts all differ
MIXES = {
    "one stream": [(20, 9, 50)],
    "three streams pad to four rows": [(9, 5, 40), (20, 12, 70), (33, 25, 100)],
    "five streams pad to eight rows": [(12, 6, 45), (30, 10, 50), (7, 4, 36), (25, 16, 64), (18, 8, 41)],
}


def plans(mix) -> list[list[Chunk]]:
    return [ChunkSchedule(first_hop=hop, growth=2, max_hop=40).chunks(n) for _, hop, n in mix]


def run_flow(engine: DiTToken2Wav, mix, graphs: DiTStepGraphs | None):
    """Every stream of `mix` chunk by chunk, all streams' next chunks in one `DiTFlow.chunks` call per round ->
    per stream its chunks' mels and its last flow state."""
    prompts = [engine.prompt_cache(*voice(i, p)) for i, (p, _, _) in enumerate(mix)]
    tokens = [speech(n, i) for i, (_, _, n) in enumerate(mix)]
    chunk_plans = plans(mix)
    states = [FlowState.start(p) for p in prompts]
    mels: list[list[torch.Tensor]] = [[] for _ in mix]
    for index in range(max(map(len, chunk_plans))):
        active = [i for i, plan in enumerate(chunk_plans) if index < len(plan)]
        chunks = [chunk_plans[i][index] for i in active]
        results = engine.flow.chunks(
            [torch.tensor(tokens[i][c.start:c.feed], device=engine.flow_device)[None] for i, c in zip(active, chunks)],
            [states[i] for i in active], [c.final for c in chunks], graphs)
        for i, (_, mel, state) in zip(active, results):
            mels[i].append(mel)
            states[i] = state
    return mels, states


def recording(graphs: DiTStepGraphs) -> list[tuple[int, int, int]]:
    """The buckets `graphs` runs steps in, recorded from now on."""
    shapes: list[tuple[int, int, int]] = []
    run = graphs.run

    def spy(shape, *args):
        shapes.append(shape)
        return run(shape, *args)

    graphs.run = spy  # type: ignore[method-assign]
    return shapes


@pytest.mark.parametrize("name", list(MIXES))
def test_emulated_buckets_give_the_eager_mel_and_caches(engine: DiTToken2Wav, name: str) -> None:
    mix = MIXES[name]
    assert all(len(plan) >= 3 for plan in plans(mix))
    eager_mels, eager_states = run_flow(engine, mix, None)
    graphs = DiTStepGraphs(engine.flow.decoder, BUCKETS)
    graphs.emulate = True
    shapes = recording(graphs)
    mels, states = run_flow(engine, mix, graphs)
    rows = len(mix)
    steps = engine.flow.config.solver.n_timesteps
    assert len(shapes) == steps * max(map(len, plans(mix)))  # every round went through the buckets
    assert shapes[0][0] == BUCKETS.fit(rows, 1, 1)[0] and shapes[0][0] >= rows
    assert any(shape[1] > max(mel.shape[2] for mel in eager_mels[0]) for shape in shapes)  # frames padded
    for stream_eager, stream in zip(eager_mels, mels):
        for a, b in zip(stream_eager, stream, strict=True):
            assert a.shape == b.shape
            assert (a - b).abs().max() <= MEL_ATOL
    for a, b in zip(eager_states, states):
        assert a.estimator.kv.shape == b.estimator.kv.shape and a.estimator.conv.shape == b.estimator.conv.shape
        assert (a.estimator.kv - b.estimator.kv).abs().max() <= MEL_ATOL
        assert (a.estimator.conv - b.estimator.conv).abs().max() <= MEL_ATOL


def test_stale_static_buffers_do_not_leak(engine: DiTToken2Wav) -> None:
    """A call after larger ones (longer caches and chunks, more rows left in the static buffers) is unaffected."""
    graphs = DiTStepGraphs(engine.flow.decoder, BUCKETS)
    graphs.emulate = True
    run_flow(engine, MIXES["five streams pad to eight rows"], graphs)
    small = [(9, 5, 30), (11, 6, 30)]
    eager, _ = run_flow(engine, small, None)
    replayed, _ = run_flow(engine, small, graphs)
    for a_stream, b_stream in zip(eager, replayed):
        for a, b in zip(a_stream, b_stream):
            assert (a - b).abs().max() <= MEL_ATOL


def test_audio_through_run_chunks(engine: DiTToken2Wav) -> None:
    mix = MIXES["three streams pad to four rows"]
    prompts = [engine.prompt_cache(*voice(i, p)) for i, (p, _, _) in enumerate(mix)]

    def audio() -> list[np.ndarray]:
        streams = [engine.open_stream(p, engine.new_generator(7 + i)) for i, p in enumerate(prompts)]
        for i, (stream, (_, _, n)) in enumerate(zip(streams, mix)):
            stream.extend(speech(n, i))
        pieces: list[list[np.ndarray]] = [[] for _ in mix]
        chunk_plans = plans(mix)
        for index in range(max(map(len, chunk_plans))):
            work = [(streams[i], plan[index]) for i, plan in enumerate(chunk_plans) if index < len(plan)]
            for (stream, _), out in zip(work, engine.run_chunks(work)):
                pieces[streams.index(stream)].append(out)
        return [np.concatenate(p) for p in pieces]

    original = engine.graphs
    try:
        engine.use_graph_buckets(DiTGraphBuckets())  # no bucket: every call eager
        eager = audio()
        engine.use_graph_buckets(BUCKETS)
        engine.graphs.emulate = True
        shapes = recording(engine.graphs)
        emulated = audio()
    finally:
        engine.graphs = original
    assert shapes
    for a, b in zip(eager, emulated):
        assert a.shape == b.shape and np.abs(a - b).max() <= AUDIO_ATOL


def test_a_call_outside_the_buckets_runs_eagerly(engine: DiTToken2Wav) -> None:
    mix = MIXES["three streams pad to four rows"]
    graphs = DiTStepGraphs(engine.flow.decoder, DiTGraphBuckets(rows=(1, 2, 4), chunk_frames=(96,),
                                                                cache_frames=(32,)))  # prompts are longer
    graphs.emulate = True
    shapes = recording(graphs)
    eager, _ = run_flow(engine, mix, None)
    outside, _ = run_flow(engine, mix, graphs)
    assert shapes == [] and graphs.static_bytes() == 0
    assert graphs.bucket(3, 20, 40, torch.zeros(1)) is None and graphs.bucket(3, 20, 30, torch.zeros(1)) == (4, 96, 32)
    for a_stream, b_stream in zip(eager, outside):
        assert all(torch.equal(a, b) for a, b in zip(a_stream, b_stream))  # the very same eager computation


def test_graphs_are_used_only_once_captured(engine: DiTToken2Wav) -> None:
    """Off emulation, a bucket replays only after `capture_all` (on CPU nothing is ever captured)."""
    graphs = DiTStepGraphs(engine.flow.decoder, BUCKETS)
    assert graphs.bucket(2, 40, 60, torch.zeros(1)) is None
    assert graphs.capture_all(torch.device("cpu"), torch.float32) == 0  # CPU: nothing to capture
    assert graphs.bucket(2, 40, 60, torch.zeros(1)) is None


def steady_shapes(schedule, prompt_tokens: int, tokens: int, ratio: int, window: int) -> list[tuple[int, int]]:
    """(chunk frames, cached frames before the chunk) of every chunk of a stream: the cache holds the prompt's
    frames, grows by each chunk and is trimmed back to prompt + window."""
    prompt = ratio * prompt_tokens
    cached, out = prompt, []
    for chunk in schedule.chunks(tokens):
        frames = ratio * ((chunk.feed if chunk.final else chunk.stop) - chunk.start)
        out.append((frames, cached))
        cached = min(cached + frames, prompt + window)
    return out


@pytest.mark.parametrize("schedule_params", [{"align_first_hop": "busy"}, {"align_first_hop": "always"},
                                             {"align_first_hop": "never"},
                                             {"align_first_hop": "busy", "lone_first_hop": 12}],
                         ids=["busy", "always", "never", "busy-lone-12"])
def test_buckets_cover_the_served_schedule(engine: DiTToken2Wav, schedule_params: dict) -> None:
    params = StreamScheduleParams(**schedule_params)
    batched = DiTBatchedToken2Wav(engine, schedules=params.schedules(EngineConfig()))
    buckets = batched.engine.graphs.buckets
    assert batched.max_rows == max(buckets.rows)  # the token2wav service's cap on jobs per call
    config = engine.flow.config
    longest_prompt = max_prompt_frames() // config.token_mel_ratio
    lookahead = config.pre_lookahead_len
    prompt_lengths = sorted({*range(lookahead, lookahead + 25), *range(lookahead, longest_prompt + 1, 37),
                             longest_prompt})
    checked = 0
    for served in params.schedules(EngineConfig()):
        for prompt_tokens in prompt_lengths:
            schedule = for_prompt(served, prompt_tokens)
            for tokens in (*range(1, 260), 600):
                for frames, cached in steady_shapes(schedule, prompt_tokens, tokens, config.token_mel_ratio,
                                                    config.solver.window_extra_frames):
                    for rows in (1, 3, max(buckets.rows)):
                        assert buckets.fit(rows, frames, cached) is not None, (prompt_tokens, tokens, frames, cached)
                    checked += 1
    assert checked > 10_000
    # and the engine's own schedule (`DiTStream.push`) by default
    own = engine.graph_buckets([engine.schedule])
    for prompt_tokens in (lookahead, 100, longest_prompt):
        for tokens in range(1, 300):
            for frames, cached in steady_shapes(engine.schedule, prompt_tokens, tokens, config.token_mel_ratio,
                                                config.solver.window_extra_frames):
                assert own.fit(max(own.rows), frames, cached) is not None
    assert buckets.fit(max(buckets.rows) + 1, 10, 10) is None  # more streams than the largest bucket: eager


def test_a_failed_capture_leaves_the_server_eager(engine: DiTToken2Wav, monkeypatch, caplog) -> None:
    served = DiTBatchedToken2Wav(engine)
    original_graphs = engine.graphs
    engine.use_graph_buckets(BUCKETS)

    def fail(device, dtype):
        raise RuntimeError("operation not permitted when stream is capturing")

    monkeypatch.setattr(engine.graphs, "capture_all", fail)
    monkeypatch.setattr(engine, "flow_device", torch.device("cuda"))  # as on a GPU; nothing reaches CUDA
    try:
        with caplog.at_level("ERROR"):
            assert served.capture_graphs()[0] == 0
        assert "runs eagerly" in caplog.text
        monkeypatch.undo()
        assert engine.graphs.static_bytes() == 0 and engine.graphs.captured == 0
        stream = engine.open_stream(engine.prompt_cache(*voice(0, 12)), engine.new_generator(0))
        assert len(stream.push(speech(40, 0))) >= 1  # the flow still runs
    finally:
        engine.graphs = original_graphs


def test_an_index_less_cuda_device_names_the_current_one(monkeypatch) -> None:
    """Tensors report `cuda:N`; a device given as plain `cuda` must compare equal to them, or the step graphs
    would drop their buffers and graphs (and with them their memory pool) on every capture."""
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    assert concrete_device(torch.device("cuda")) == torch.device("cuda", 3)
    assert concrete_device(torch.device("cuda", 1)) == torch.device("cuda", 1)
    assert concrete_device(torch.device("cpu")) == torch.device("cpu")
