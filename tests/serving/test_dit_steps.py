"""DiTBatchedToken2Wav in step mode (micro random DiT): chunks advance one Euler step at a time, each at its own
step, so a new stream's first chunk joins a running chunk at its next step - and every chunk still gets the audio
it gets when run alone (eager, and through the step-graph buckets emulated on CPU)."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from cosyvoice2.dit.graphs import DiTGraphBuckets
from cosyvoice2.dit.loading import load_dit_token2wav
from cosyvoice2.streaming import ChunkSchedule
from cosyvoice2.testing.dit import write_dit_model
from cosyvoice2_serving.engines import DiTBatchedToken2Wav
from cosyvoice2_serving.io_struct import PromptTensors
from cosyvoice2_serving.token2wav import Token2WavService, Work

AUDIO_ATOL = 5e-3
SCHEDULE = ChunkSchedule(first_hop=10, growth=2)


@pytest.fixture(scope="module")
def engine(tmp_path_factory) -> DiTBatchedToken2Wav:
    return DiTBatchedToken2Wav(load_dit_token2wav(write_dit_model(tmp_path_factory.mktemp("dit_steps"), seed=6)))


def prompt(rng: np.random.Generator, tokens: int) -> PromptTensors:
    return PromptTensors(rng.integers(0, 6561, tokens).astype(np.int32),
                         (rng.standard_normal((2 * tokens, 80)) - 5).astype(np.float32),
                         rng.standard_normal(192).astype(np.float32))


def work(state, tokens: np.ndarray, index: int) -> Work:
    plan = SCHEDULE.chunks(tokens.size)
    sent = plan[index - 1].feed if index else 0
    return Work(state, tokens[sent:plan[index].feed], plan[index])


@pytest.mark.parametrize("emulate", [False, True])
def test_a_first_chunk_joins_a_running_chunk_at_the_next_step(engine: DiTBatchedToken2Wav, emulate: bool) -> None:
    rng = np.random.default_rng(0)
    voices = [prompt(rng, 14), prompt(rng, 22)]
    running, new = rng.integers(0, 6561, 60).astype(np.int32), rng.integers(0, 6561, 30).astype(np.int32)

    # alone, whole calls: the running stream's first two chunks, the new stream's first chunk
    a, b = engine.open(voices[0], 3), engine.open(voices[1], 4)
    engine.run([work(a, running, 0)])
    alone_running = engine.run([work(a, running, 1)])[0]
    alone_new = engine.run([work(b, new, 0)])[0]

    original = engine.engine.graphs
    if emulate:  # the step graphs' padding and static buffers, run eagerly on CPU
        engine.engine.use_graph_buckets(DiTGraphBuckets(rows=(1, 2, 4), chunk_frames=(32, 64), cache_frames=(128,)))
        engine.engine.graphs.emulate = True
    try:
        a, b = engine.open(voices[0], 3), engine.open(voices[1], 4)
        engine.run([work(a, running, 0)])
        assert engine.steppable(work(a, running, 1)) and not engine.steppable(Work(a, running[:5], None))
        [handle_a] = engine.admit([work(a, running, 1)])
        for _ in range(4):  # the running chunk is 4 Euler steps in when the new stream's first chunk arrives
            assert engine.step([handle_a]) == [None]
        [handle_b] = engine.admit([work(b, new, 0)])
        outputs: dict[int, np.ndarray] = {}
        shared_steps = []
        while len(outputs) < 2:
            handles = [h for i, h in enumerate((handle_a, handle_b)) if i not in outputs]
            shared_steps.append(tuple(h.step for h in handles))
            for handle, result in zip(handles, engine.step(handles)):
                assert not isinstance(result, Exception), result
                if result is not None:
                    outputs[(handle_a, handle_b).index(handle)] = result
        if emulate:
            assert engine.engine.graphs.static_bytes() > 0  # the buckets were used
    finally:
        engine.engine.graphs = original
    steps = engine.engine.flow.config.solver.n_timesteps
    # the new chunk joined at the running chunk's next step; the two then shared every step until one finished
    assert shared_steps[0] == (4, 0) and shared_steps[steps - 5] == (steps - 1, steps - 5)
    assert len(shared_steps) == steps
    for got, want in ((outputs[0], alone_running), (outputs[1], alone_new)):
        assert got.shape == want.shape and np.abs(got - want).max() <= AUDIO_ATOL


def test_a_failing_chunk_fails_alone_in_step_mode(engine: DiTBatchedToken2Wav) -> None:
    rng = np.random.default_rng(1)
    tokens = rng.integers(0, 6561, 40).astype(np.int32)
    good, bad = engine.open(prompt(rng, 12), 1), engine.open(prompt(rng, 12), 2)
    bad_tokens = tokens.copy()
    bad_tokens[3] = 10**6  # outside the flow's vocabulary
    handles = engine.admit([work(good, tokens, 0), work(bad, bad_tokens, 0)])
    assert isinstance(handles[1], Exception) and not isinstance(handles[0], Exception)
    out = [None]
    while out[0] is None:
        out = engine.step([handles[0]])
    assert isinstance(out[0], np.ndarray) and out[0].size > 0


async def test_the_service_steps_dit_chunks(engine: DiTBatchedToken2Wav) -> None:
    """`Token2WavService(scheduling="step")` takes the DiT engine as a step engine: two streams' chunks run one Euler
    step at a time and give the audio of whole calls."""
    rng = np.random.default_rng(2)
    voices = [prompt(rng, 10), prompt(rng, 16)]
    streams = [rng.integers(0, 6561, 45).astype(np.int32), rng.integers(0, 6561, 33).astype(np.int32)]
    plans = [SCHEDULE.chunks(t.size) for t in streams]
    whole = []
    for seed, (v, tokens, plan) in enumerate(zip(voices, streams, plans)):
        state = engine.open(v, seed)
        whole.append(np.concatenate([engine.run([work(state, tokens, i)])[0] for i in range(len(plan))]))

    service = Token2WavService(engine, scheduling="step")
    try:
        assert service.scheduling == "step"

        async def run(request_id: str, seed: int) -> np.ndarray:
            tokens, plan = streams[seed], plans[seed]
            out, sent = [], 0
            for i, chunk in enumerate(plan):
                out.append(await service.process(request_id, tokens[sent:chunk.feed], voices[seed] if i == 0 else None,
                                                  chunk, seed=seed))
                sent = chunk.feed
            return np.concatenate(out)

        stepped = await asyncio.gather(run("A", 0), run("B", 1))
    finally:
        service.shutdown()
    steps = engine.engine.flow.config.solver.n_timesteps
    assert len(service.step_trace) >= steps and all(len(step) >= 1 for step in service.step_trace)
    for got, want in zip(stepped, whole):
        assert got.shape == want.shape and np.abs(got - want).max() <= AUDIO_ATOL
