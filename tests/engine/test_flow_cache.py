"""Chunk-cached streaming flow (cosyvoice2/flow/cached.py) against the recomputing path.

On the parity oracle's micro flow (upstream weights layout, its prompt and x-vector): over whole streams of at
least three chunks, the cached path's mel equals recomputing prompt + history for every chunk (fp32, 5e-5), and its
first chunk equals upstream's own streaming call. Then through `Token2Wav`: batched streams at different positions,
voice prefixes shared, failed calls leaving caches untouched, and the memory budget.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from cosyvoice2.flow import CausalFlow, FlowConfig
from cosyvoice2.flow.cached import CachedFlowRunner, CachedRow, CachedSegment
from cosyvoice2.flow.packed import LONGEST_HISTORY, PACKED_ROWS, PackedGraphs, keys_needed
from cosyvoice2.streaming import ChunkSchedule, Token2Wav
from tests.conftest import FIXTURES_DIR

PARITY_DIR = FIXTURES_DIR / "parity"
MEL_TOL = 5e-5


def random_tokens(n: int, seed: int) -> torch.Tensor:
    return torch.from_numpy(np.random.default_rng(seed).integers(0, 6561, n)).long()


# ---- the flow alone, on the parity oracle ---------------------------------------------------------------
parity = pytest.mark.skipif(not (PARITY_DIR / "micro" / "flow.pt").exists(), reason="parity data absent")


@pytest.fixture(scope="module")
def oracle() -> tuple[CausalFlow, dict[str, torch.Tensor]]:
    harness = json.loads((PARITY_DIR / "micro" / "harness_config.json").read_text())
    flow = CausalFlow(FlowConfig.from_harness(harness["flow"])).eval()
    flow.load_state_dict(torch.load(PARITY_DIR / "micro" / "flow.pt", weights_only=True), strict=True)
    with np.load(PARITY_DIR / "micro_dump_seed1234.npz") as arrays:
        dump = {k: torch.from_numpy(arrays[k]) for k in arrays.files if k.startswith(("flow_", "in_"))}
    return flow, dump


def recompute(flow: CausalFlow, prompt_tokens, prompt_mel, xvector, tokens, start, final) -> torch.Tensor:
    """The uncached path: the flow over prompt + tokens[:feed], the mel of tokens[start:]."""
    mel = flow.inference(tokens[None], prompt_tokens[None], prompt_mel[None], xvector[None], streaming=not final,
                         finalize=final)[0]
    return mel[:, start * 2 :]


def stream_both_ways(flow: CausalFlow, prompt_tokens, prompt_mel, xvector, tokens, schedule: ChunkSchedule,
                     final_cached: bool):
    """[(chunk, recomputed mel, cached mel)] over a whole stream."""
    runner = CachedFlowRunner(flow)
    spks = runner.project_speaker(xvector[None])[0]
    prefix = runner.prefix(prompt_tokens, prompt_mel, spks)
    own = CachedSegment()
    offset = prompt_tokens.numel()
    out = []
    for chunk in schedule.chunks(tokens.numel()):
        ref = recompute(flow, prompt_tokens, prompt_mel, xvector, tokens[: chunk.feed], chunk.start, chunk.final)
        if chunk.final and not final_cached:
            out.append((chunk, ref, ref))
            continue
        row = CachedRow(torch.cat([prompt_tokens, tokens[: chunk.feed]]), prompt_mel, spks, prefix, own,
                        stop=offset + chunk.stop, final=chunk.final, keep=not chunk.final,
                        emit_from=offset + chunk.start)
        out.append((chunk, ref, runner.run([row])[0]))
    return out, prefix, own


@parity
@pytest.mark.parametrize(("first_hop", "aligned"), [(25, True), (15, True), (25, False), (15, False)])
def test_cached_stream_equals_recompute_on_the_oracle(oracle, first_hop: int, aligned: bool) -> None:
    """Aligned: the first hop padded to the grid (upstream's); unaligned (schedule grid 1, no pad): every chunk may
    end inside a grid chunk, which the next chunk recomputes."""
    flow, dump = oracle
    prompt_tokens = dump["in_prompt_speech_token"][0].long()
    tokens = torch.cat([dump["in_flow_token"][0].long(), random_tokens(200, seed=3)])
    schedule = ChunkSchedule(prompt_tokens=prompt_tokens.numel(), first_hop=first_hop, grid=25 if aligned else 1)
    assert schedule.hop(0) == first_hop + (schedule.prompt_pad if aligned else 0)
    result, prefix, own = stream_both_ways(flow, prompt_tokens, dump["in_prompt_feat"][0], dump["in_xvector"][0],
                                           tokens, schedule, final_cached=False)
    assert sum(not chunk.final for chunk, _, _ in result) >= 3
    for chunk, ref, mel in result:
        assert mel.shape == ref.shape == (80, 2 * (chunk.stop - chunk.start))
        assert (mel - ref).abs().max().item() <= MEL_TOL, chunk
    whole_ref = torch.cat([ref for _, ref, _ in result], dim=1)
    whole = torch.cat([mel for _, _, mel in result], dim=1)
    assert whole.shape == (80, 2 * tokens.numel())
    assert (whole - whole_ref).abs().max().item() <= MEL_TOL
    # the prompt's first whole grid chunk (40 prompt tokens, 3 of lookahead: 25) is the voice's shared prefix
    assert prefix.encoder.tokens == 25 and prefix.estimator.frames == 50
    # the caches cover exactly the grid chunks the non-final chunks completed
    last = [chunk for chunk, _, _ in result if not chunk.final][-1]
    assert own.encoder.tokens == (prompt_tokens.numel() + last.stop) // 25 * 25 - 25


@parity
def test_cached_first_chunk_equals_upstream_streaming_call(oracle) -> None:
    flow, dump = oracle
    prompt_tokens = dump["in_prompt_speech_token"][0].long()
    tokens = dump["in_flow_stream_token"][0].long()  # 35 tokens + 3 lookahead, as upstream's first chunk
    runner = CachedFlowRunner(flow)
    spks = runner.project_speaker(dump["in_xvector"])[0]
    prefix = runner.prefix(prompt_tokens, dump["in_prompt_feat"][0], spks)
    row = CachedRow(torch.cat([prompt_tokens, tokens]), dump["in_prompt_feat"][0], spks, prefix, CachedSegment(),
                    stop=40 + 35, final=False, keep=True)
    mel = runner.run([row])[0]
    assert (mel - dump["flow_mel_stream0"][0]).abs().max().item() <= MEL_TOL


@parity
def test_chunked_final_differs_only_in_the_final_chunk(oracle) -> None:
    """The cheap final chunk (chunk attention over the caches) is not upstream's full-attention final chunk:
    the earlier chunks stay exact, the final one differs by a small, bounded amount (documented figure)."""
    flow, dump = oracle
    prompt_tokens = dump["in_prompt_speech_token"][0].long()
    tokens = torch.cat([dump["in_flow_token"][0].long(), random_tokens(200, seed=3)])
    schedule = ChunkSchedule(prompt_tokens=prompt_tokens.numel())
    result, _, _ = stream_both_ways(flow, prompt_tokens, dump["in_prompt_feat"][0], dump["in_xvector"][0], tokens,
                                    schedule, final_cached=True)
    *earlier, (final_chunk, final_ref, final_mel) = result
    assert final_chunk.final and final_mel.shape == final_ref.shape
    assert all((mel - ref).abs().max().item() <= MEL_TOL for _, ref, mel in earlier)
    deviation = (final_mel - final_ref).abs().max().item()
    scale = final_ref.abs().max().item()
    assert MEL_TOL < deviation < 0.05 * scale  # different attention, same model: close, not equal


@parity
def test_rows_with_different_histories_batch_like_single_calls(oracle) -> None:
    flow, dump = oracle
    runner = CachedFlowRunner(flow)
    prompt_tokens, prompt_mel = dump["in_prompt_speech_token"][0].long(), dump["in_prompt_feat"][0]
    spks = runner.project_speaker(dump["in_xvector"])[0]
    prefix = runner.prefix(prompt_tokens, prompt_mel, spks)
    tokens = random_tokens(300, seed=9)

    def advance(own: CachedSegment, stops: list[int]) -> None:
        for stop in stops:
            runner.run([CachedRow(torch.cat([prompt_tokens, tokens]), prompt_mel, spks, prefix, own, stop=40 + stop,
                                  final=False, keep=True)])

    # three streams at different points: fresh, after one chunk, after two chunks; plus one finishing
    states = [CachedSegment() for _ in range(4)]
    advance(states[1], [35])
    advance(states[2], [35, 85])
    advance(states[3], [35, 85, 185])
    calls = [(35, False), (85, False), (185, False), (230, True)]

    def rows(owns):
        return [CachedRow(torch.cat([prompt_tokens, tokens]), prompt_mel, spks, prefix, own, stop=40 + stop,
                          final=final, keep=not final) for own, (stop, final) in zip(owns, calls)]

    alone = [runner.run_pending([row])[0][0] for row in rows(states)]
    together, updates = runner.run_pending(rows(states))
    for a, b in zip(alone, together):
        assert a.shape == b.shape and (a - b).abs().max().item() <= 1e-5
    assert updates[3] is None and all(u is not None for u in updates[:3])


# ---- through Token2Wav, on the tiny model directory ------------------------------------------------------
def make_engine(tiny_engine, mode: str, budget: int | None = None) -> Token2Wav:
    base = tiny_engine.token2wav_engine
    return Token2Wav(base.flow, base.hift, base.config, flow_cache=mode, cache_budget_bytes=budget)


def stream_audio(engine: Token2Wav, prompt, tokens: list[int], seed: int, step: int = 7) -> np.ndarray:
    stream = engine.open_stream(engine.flow_prompt(prompt), engine.new_generator(seed))
    pieces = []
    for i in range(0, len(tokens), step):
        pieces.extend(stream.push(tokens[i : i + step]))
    pieces.append(stream.finish())
    return np.concatenate(pieces)


@pytest.fixture(scope="module")
def long_tokens() -> list[int]:
    return random_tokens(260, seed=4).tolist()


def test_exact_mode_audio_equals_recompute(tiny_engine, tiny_prompt_unaligned, long_tokens) -> None:
    off = stream_audio(make_engine(tiny_engine, "off"), tiny_prompt_unaligned, long_tokens, seed=1)
    exact_engine = make_engine(tiny_engine, "exact")
    exact = stream_audio(exact_engine, tiny_prompt_unaligned, long_tokens, seed=1)
    assert off.shape == exact.shape == (960 * len(long_tokens),)
    assert np.abs(off - exact).max() < 1e-3  # HiFT turns mel rounding (1e-6) into ~2e-4 here
    assert exact_engine.cache_bytes == 0  # the final chunk released the stream's caches


def test_streams_of_one_voice_share_one_prefix(tiny_engine, tiny_prompt, long_tokens) -> None:
    engine = make_engine(tiny_engine, "chunked")
    calls = []
    original = engine.cached.prefix
    engine.cached.prefix = lambda *args: calls.append(1) or original(*args)
    a = stream_audio(engine, tiny_prompt, long_tokens, seed=2)
    b = stream_audio(engine, tiny_prompt, long_tokens, seed=2)
    assert len(calls) == 1
    np.testing.assert_array_equal(a, b)


def test_failed_call_leaves_flow_caches_untouched(tiny_engine, tiny_prompt_unaligned, long_tokens) -> None:
    engine = make_engine(tiny_engine, "exact")
    reference = stream_audio(make_engine(tiny_engine, "exact"), tiny_prompt_unaligned, long_tokens, seed=3)

    stream = engine.open_stream(engine.flow_prompt(tiny_prompt_unaligned), engine.new_generator(3))
    pieces = stream.push(long_tokens[:100])  # two chunks
    original = engine.vocode_batch

    def failing(*args):
        raise RuntimeError("injected HiFT failure")

    engine.vocode_batch = failing
    stream.extend(long_tokens[100:200])
    chunk = stream.next_chunk(finished=False)
    cached_tokens = stream.flow_cache.own.encoder.tokens
    with pytest.raises(RuntimeError, match="injected"):
        engine.run_chunks([(stream, chunk)])
    assert stream.flow_cache.own.encoder.tokens == cached_tokens and stream.flow_cache.pending is None
    engine.vocode_batch = original
    pieces.extend(engine.run_chunks([(stream, chunk)]))
    pieces.extend(stream.push(long_tokens[200:]))
    pieces.append(stream.finish())
    np.testing.assert_allclose(np.concatenate(pieces), reference, atol=1e-6)


def test_over_budget_stream_freezes_its_caches_and_returns_its_memory(tiny_engine, tiny_prompt_unaligned,
                                                                    long_tokens) -> None:
    exact = stream_audio(make_engine(tiny_engine, "exact"), tiny_prompt_unaligned, long_tokens, seed=4)
    probe = make_engine(tiny_engine, "exact")
    stream = probe.open_stream(probe.flow_prompt(tiny_prompt_unaligned), probe.new_generator(4))
    stream.push(long_tokens[:40])
    one_chunk = probe.cache_bytes
    assert one_chunk > 0
    del stream  # a stream dropped mid-utterance (cancelled) gives its memory back
    assert probe.cache_bytes == 0

    engine = make_engine(tiny_engine, "exact", budget=one_chunk + 1)  # room for the first chunk only
    stream = engine.open_stream(engine.flow_prompt(tiny_prompt_unaligned), engine.new_generator(4))
    pieces = stream.push(long_tokens[:40])
    kept = stream.flow_cache.own.encoder.tokens
    assert kept > 0 and not stream.flow_cache.frozen and engine.book.refused == 0
    for i in range(40, len(long_tokens), 7):
        pieces.extend(stream.push(long_tokens[i : i + 7]))
    # the second chunk's growth was refused: the stream keeps its first chunk's caches (still accounted) and
    # runs every later chunk over them, recomputing only the frames after them
    assert stream.flow_cache.frozen and engine.book.refused == 1
    assert stream.flow_cache.own.encoder.tokens == kept and engine.cache_bytes == one_chunk
    pieces.append(stream.finish())
    assert np.abs(np.concatenate(pieces) - exact).max() < 1e-3
    assert engine.cache_bytes == 0


def emulated_graphs(runner: CachedFlowRunner, frames: tuple[int, ...], rows: int) -> list[tuple[int, int, int]]:
    """Give the runner packed graphs of small buckets, emulated on the CPU (static buffers, padding, run eagerly);
    returns the list the bucket of each call that uses them is appended to."""
    graphs = PackedGraphs(runner.solver, frames=frames, rows=rows)
    graphs.emulate = True
    runner.solver.graphs = graphs
    shapes: list[tuple[int, int, int]] = []
    statics = graphs.statics
    graphs.statics = lambda shape, *args: shapes.append(shape) or statics(shape, *args)
    return shapes


@parity
def test_bucketed_calls_with_static_buffers_equal_recompute(oracle) -> None:
    """The CUDA-graph path's shapes on CPU: staggered streams' calls packed and padded to a frame bucket, their
    histories copied into the graphs' static key buffer (which holds the previous call's keys), run eagerly."""
    flow, dump = oracle
    runner = CachedFlowRunner(flow)
    shapes = emulated_graphs(runner, frames=(128, 256, 512, 1024), rows=4)
    prompt_tokens, prompt_mel = dump["in_prompt_speech_token"][0].long(), dump["in_prompt_feat"][0]
    spks = runner.project_speaker(dump["in_xvector"])[0]
    prefix = runner.prefix(prompt_tokens, prompt_mel, spks)
    counted = (runner.frames_needed, runner.frames_computed)  # the prefix's own call
    shapes.clear()
    chunks = [c for c in ChunkSchedule(prompt_tokens=40).chunks(300) if not c.final]
    streams = [(random_tokens(300, seed=30 + s), CachedSegment()) for s in range(3)]
    worst, rows_seen, needed = 0.0, set(), 0
    for round_ in range(len(chunks) + len(streams) - 1):  # stream s runs chunk i at round i + s
        work = [(s, chunks[round_ - s]) for s in range(len(streams)) if 0 <= round_ - s < len(chunks)]
        rows = [CachedRow(torch.cat([prompt_tokens, streams[s][0][: c.feed]]), prompt_mel, spks, prefix,
                          streams[s][1], stop=40 + c.stop, final=False, keep=True, emit_from=40 + c.start)
                for s, c in work]
        rows_seen.add(len(rows))
        needed += sum(row.stop - row.start for row in rows) * runner.stride
        for (s, chunk), mel in zip(work, runner.run(rows)):
            ref = recompute(flow, prompt_tokens, prompt_mel, dump["in_xvector"][0], streams[s][0][: chunk.feed],
                            chunk.start, final=False)
            assert mel.shape == ref.shape
            worst = max(worst, (mel - ref).abs().max().item())
    assert rows_seen == {1, 2, 3} and len({shape[1] for shape in shapes}) > 1  # several frame buckets
    assert worst <= MEL_TOL
    # the runner counted what the buckets padded: each call's packed frames up to its frame bucket
    assert runner.frames_needed - counted[0] == needed
    assert runner.frames_computed - counted[1] == sum(shape[1] for shape in shapes) > needed


@parity
def test_a_row_beyond_the_buckets_runs_apart_from_the_rows_that_fit(oracle) -> None:
    """An offline utterance longer than the largest frame bucket, in one call with two streams' chunks: the chunks
    still run packed from the graphs (emulated on CPU), the utterance eagerly on its own, and every row's mel
    equals the row run alone."""
    flow, dump = oracle
    runner = CachedFlowRunner(flow)
    shapes = emulated_graphs(runner, frames=(128, 256), rows=4)
    prompt_tokens, prompt_mel = dump["in_prompt_speech_token"][0].long(), dump["in_prompt_feat"][0]
    spks = runner.project_speaker(dump["in_xvector"])[0]
    prefix = runner.prefix(prompt_tokens, prompt_mel, spks)
    first = ChunkSchedule(prompt_tokens=40).chunks(300)[0]
    rows = [CachedRow(torch.cat([prompt_tokens, random_tokens(300, seed=s)[: first.feed]]), prompt_mel, spks, prefix,
                      CachedSegment(), stop=40 + first.stop, final=False, keep=True, emit_from=40 + first.start)
            for s in (1, 2)]
    utterance = random_tokens(200, seed=3)  # 400 new frames: beyond the 256-frame bucket
    rows.insert(1, CachedRow(torch.cat([prompt_tokens, utterance]), prompt_mel, spks, prefix, CachedSegment(),
                             stop=240, final=True, keep=False, emit_from=40))
    assert [runner.fits_graphs(row) for row in rows] == [True, False, True]
    shapes.clear()  # the voice prefix ran from a graph too
    mels, _ = runner.run_pending(rows)
    chunk_frames = 2 * (rows[0].stop - rows[0].start) * runner.stride
    assert len(shapes) == 1 and shapes[0][1] >= chunk_frames  # the two chunks, in one packed call
    assert mels[1].shape[1] == 200 * runner.stride
    for row, mel in zip(rows, mels):
        alone, _ = runner.run_pending([row])
        assert (mel - alone[0]).abs().max().item() <= MEL_TOL


# ---- the CUDA-graph buckets against what the token2wav service forms ------------------------------------
@pytest.mark.parametrize("schedule_params", [{"align_first_hop": "always"}, {"align_first_hop": "never"},
                                             {"first_hop": 15, "align_first_hop": "never"},
                                             {"align_first_hop": "busy", "lone_first_hop": 12}],
                         ids=["upstream", "unaligned", "unaligned-15", "busy-lone-12"])
@pytest.mark.parametrize("max_rows", [None, 32], ids=["rows-default", "rows-32"])
def test_buckets_cover_the_served_schedule(tiny_model_dir, schedule_params, max_rows) -> None:
    """Every cached call the token2wav service can form - at most `max_rows` streams' chunks of the served schedule
    (flow caches `chunked`: the final chunk over the caches too), for every alignment of the voice prompt - fits a
    captured packed-frames bucket of the solve and (rows, new tokens, history tokens) encoder bucket of the engine,
    while the stream's history fits the longest (a longer stream runs eagerly); one row more than the service's cap
    fits none."""
    from cosyvoice2.config import EngineConfig
    from cosyvoice2.flow.cached import EncoderCache
    from cosyvoice2.loading import FLOW_FILE, HIFT_FILE, load_flow, load_hift
    from speech_serving.engines import BatchedToken2Wav
    from speech_serving.schedule import StreamScheduleParams, for_prompt

    config = EngineConfig.for_model_dir(tiny_model_dir)
    params = StreamScheduleParams(**schedule_params)
    engine = BatchedToken2Wav(load_flow(tiny_model_dir / FLOW_FILE, config, torch.device("cpu"), torch.float32),
                              load_hift(tiny_model_dir / HIFT_FILE, config, torch.device("cpu")), config,
                              params.schedule(config), flow_cache="chunked", schedules=params.schedules(config),
                              max_rows=max_rows)
    runner = engine.engine.cached
    graphs, encoder_graphs = runner.solve_graphs, runner.encoder.graphs
    assert max(encoder_graphs.history_tokens) * runner.stride == LONGEST_HISTORY  # one history limit for both
    none = torch.zeros(0)
    checked = 0
    for schedule in params.schedules(config):
        for prompt_tokens in sorted({*range(runner.lookahead, runner.lookahead + runner.grid + 1),
                                     *range(runner.lookahead, LONGEST_HISTORY // runner.stride, 53)}):
            stream_schedule = for_prompt(schedule, prompt_tokens)
            for tokens in range(1, 300):  # every final-chunk size once hops reach 100
                # the rows of the stream's calls, with the caches each one leaves (the same arithmetic as `CachedRow`)
                prefix = CachedSegment(EncoderCache(tokens=runner.prefix_tokens(prompt_tokens)))
                own = CachedSegment()
                for chunk in stream_schedule.chunks(tokens):
                    row = CachedRow(none, none, none, prefix, own, stop=prompt_tokens + chunk.stop, final=chunk.final,
                                    keep=not chunk.final)
                    history, new = row.start * runner.stride, (row.stop - row.start) * runner.stride
                    if history > LONGEST_HISTORY:
                        break
                    for rows in (1, 3, engine.max_rows):  # as many rows of this chunk, packed
                        assert graphs.bucket(rows, rows * new, keys_needed([new] * rows, [history] * rows)) \
                            is not None, (prompt_tokens, tokens, chunk, new, history)
                        # the encoder pass of the same call, in tokens
                        assert encoder_graphs.bucket(rows, row.stop - row.start, row.start) is not None, (
                            prompt_tokens, tokens, chunk, row.start, row.stop)
                    own.encoder.tokens += row.kept_tokens(runner.grid)
                    checked += 1
    assert checked > 30_000
    # the service's cap: the largest bucket of both graphs, the one asked for
    assert engine.max_rows == graphs.row_count == max(encoder_graphs.rows) == (max_rows or PACKED_ROWS)
    assert graphs.bucket(engine.max_rows + 1, min(graphs.frame_sizes), keys_needed([1], [0])) is None
    assert encoder_graphs.bucket(engine.max_rows + 1, 1, 0) is None


def test_encoder_row_buckets_pad_rows_little_and_chunks_are_whole_grid_chunks(tiny_model_dir) -> None:
    """The encoder's row buckets pad a call's rows by at most half again; the calls most streams make (every stream
    but a lone one pads its first hop to the grid) are whole grid chunks of new frames."""
    from cosyvoice2.config import EngineConfig
    from cosyvoice2.flow.cached import encoder_rows
    from speech_serving.schedule import StreamScheduleParams, for_prompt

    config = EngineConfig.for_model_dir(tiny_model_dir)
    stride, grid, lookahead = config.flow.token_mel_ratio, config.flow.encoder.static_chunk_size, config.flow.pre_lookahead_len
    for cap in (1, 5, 16, 20, 32, 48):
        buckets = encoder_rows(cap)
        assert max(buckets) == cap and list(buckets) == sorted(set(buckets)), cap
        for rows in range(1, cap + 1):
            assert min(r for r in buckets if r >= rows) <= 1.5 * rows, (cap, rows)
    schedule = StreamScheduleParams(align_first_hop="always").schedule(config)
    seen = set()
    for prompt_tokens in range(lookahead, lookahead + 2 * grid):
        start = (prompt_tokens - lookahead) // grid * grid  # the voice prefix: whole grid chunks of prompt
        for chunk in for_prompt(schedule, prompt_tokens).chunks(1000):
            if chunk.final:
                break
            stop = prompt_tokens + chunk.stop
            seen.add((stop - start) * stride)
            start = stop // grid * grid
    # first chunks of two and three grid chunks (by the prompt's tail), the second chunk, the later ones
    assert seen == {2 * grid * stride, 3 * grid * stride, 4 * grid * stride}, seen
