"""Packed rows (cosyvoice2/flow/packed.py): the rows of one call solved together, each as if alone.

On the parity oracle's micro flow: a call of rows at different points of their streams (fresh, after one and two
chunks, finishing, with and without a voice prefix) gives each row the mel and the new caches the row gets in a call
of its own (tests/engine/test_flow_cache.py holds a row alone equal to recomputing), also through the CUDA-graph
path's static buffers (emulated), and a stream carried on by calls shared with a fresh stream stays equal to the
stream run alone. The layout's index arithmetic is checked on its own (windows, tails, key slots, attention
pieces), and streams through `Token2Wav` batched at staggered points give each stream's audio alone.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from cosyvoice2.flow import CausalFlow, FlowConfig
from cosyvoice2.flow.cached import CachedFlowRunner, CachedRow, CachedSegment
from cosyvoice2.flow.packed import PackedGraphs, PackedLayout
from cosyvoice2.streaming import Token2Wav
from tests.conftest import FIXTURES_DIR

PARITY_DIR = FIXTURES_DIR / "parity"
TOL = 2e-5
parity = pytest.mark.skipif(not (PARITY_DIR / "micro" / "flow.pt").exists(), reason="parity data absent")


def random_tokens(n: int, seed: int) -> torch.Tensor:
    return torch.from_numpy(np.random.default_rng(seed).integers(0, 6561, n)).long()


@pytest.fixture(scope="module")
def oracle():
    harness = json.loads((PARITY_DIR / "micro" / "harness_config.json").read_text())
    flow = CausalFlow(FlowConfig.from_harness(harness["flow"])).eval()
    flow.load_state_dict(torch.load(PARITY_DIR / "micro" / "flow.pt", weights_only=True), strict=True)
    with np.load(PARITY_DIR / "micro_dump_seed1234.npz") as arrays:
        dump = {k: torch.from_numpy(arrays[k]) for k in arrays.files if k.startswith("in_")}
    return flow, dump


def test_layout_indexes_each_row_apart() -> None:
    # two rows: 3 new frames after 50 of history (keeps 2), 4 new frames fresh and final; 2 padding frames
    layout = PackedLayout.of([3, 4], [50, 0], [False, True], [2, 0], chunk=2, device=torch.device("cpu"), frames=9,
                             keys=61)
    tails = 4  # two rows x two tail frames come first in a conv's input sequence
    windows = layout.window.view(-1, 3).tolist()
    assert windows[0] == [0, 1, tails + 0] and windows[1] == [1, tails + 0, tails + 1]  # row 0 reads its tails
    assert windows[3] == [2, 3, tails + 3] and windows[6] == [tails + 4, tails + 5, tails + 6]  # row 1: its own
    assert windows[7] == [tails + 7] * 3  # padding reads itself
    assert layout.tail_at.tolist() == [tails + 0, tails + 1, 2, 3]  # row 0: frames 0, 1; row 1 keeps none
    assert layout.new_key_at.tolist() == [50, 51, 52, 53, 54, 55, 56, 60, 60]  # then the trash slot
    # pieces per guidance row: row 0 in chunks of 2 queries (keys up to the chunk's end), row 1 final, padding
    assert layout.cu_queries.tolist() == [0, 2, 3, 5, 7, 9, 11, 12, 14, 16, 18]
    assert layout.piece_keys.tolist() == [0, 0, 53, 53, 60, 61, 61, 114, 114, 121, 122]
    assert layout.piece_used.tolist() == [52, 53, 4, 4, 1] * 2
    visible = layout.visible()
    assert visible[2].nonzero().flatten().tolist() == list(range(53))  # row 0's third frame: history + 3 new
    assert visible[9 + 4].nonzero().flatten().tolist() == list(range(61 + 53, 61 + 57))  # guidance row 2, row 1


def test_layout_refuses_rows_off_the_grid_and_axes_too_short() -> None:
    cpu = torch.device("cpu")
    with pytest.raises(ValueError, match="grid"):
        PackedLayout.of([3], [49], [False], [0], chunk=50, device=cpu)
    with pytest.raises(ValueError, match="fewer"):
        PackedLayout.of([3, 4], [0, 0], [False, False], [0, 0], chunk=50, device=cpu, frames=6)


def stream_rows(runner: CachedFlowRunner, dump, with_prefix: bool):
    """Four rows of one voice at different points: (own caches, stop, final) after running the earlier chunks."""
    prompt_tokens, prompt_mel = dump["in_prompt_speech_token"][0].long(), dump["in_prompt_feat"][0]
    spks = runner.project_speaker(dump["in_xvector"])[0]
    prefix = runner.prefix(prompt_tokens, prompt_mel, spks) if with_prefix else CachedSegment()
    offset = prompt_tokens.numel()
    tokens = random_tokens(300, seed=9)

    def row(own, stop, final):
        return CachedRow(torch.cat([prompt_tokens, tokens]), prompt_mel, spks, prefix, own, stop=offset + stop,
                         final=final, keep=not final)

    owns = [CachedSegment() for _ in range(4)]
    for own, stops in zip(owns, ([], [35], [35, 85], [35, 85, 185])):
        for stop in stops:
            runner.run([row(own, stop, False)])
    return lambda: [row(own, stop, final) for own, (stop, final) in
                    zip(owns, [(35, False), (85, False), (185, False), (230, True)])]


def solved_alone(runner: CachedFlowRunner, rows):
    """Each row's mel and new estimator caches from a call of its own."""
    out = []
    for row in rows:
        mu, _ = runner._encode([row])
        mels, caches = runner._solve([row], mu)
        out.append((mels[0], caches[0]))
    return [mel for mel, _ in out], [cache for _, cache in out]


@parity
@pytest.mark.parametrize("with_prefix", [True, False])
def test_packed_call_gives_every_row_its_own_mel_and_caches(oracle, with_prefix: bool) -> None:
    flow, dump = oracle
    runner = CachedFlowRunner(flow, graphs=False)
    rows = stream_rows(runner, dump, with_prefix)
    alone_mels, alone_caches = solved_alone(runner, rows())
    mu, _ = runner._encode(rows())
    packed_mels, packed_caches = runner._solve(rows(), mu)
    for a, b in zip(alone_mels, packed_mels):
        assert a.shape == b.shape and (a - b).abs().max().item() <= TOL
    for a, b in zip(alone_caches, packed_caches):
        assert a.frames == b.frames and len(a.kv) == len(b.kv) and len(a.tails) == len(b.tails)
        for x, y in zip(a.kv + a.tails, b.kv + b.tails):
            assert x.shape == y.shape and (x - y).abs().max().item() <= TOL
    assert packed_caches[3].frames == 0 and all(c.frames for c in packed_caches[:3])


@parity
def test_packed_call_through_the_graphs_static_buffers_equals_the_eager_call(oracle) -> None:
    """The CUDA-graph path emulated on the CPU: the call padded to a frame bucket, its index tensors and history in
    the graphs' static buffers, which hold the previous call's keys (a second call must not read them)."""
    flow, dump = oracle
    runner = CachedFlowRunner(flow, graphs=False)
    rows = stream_rows(runner, dump, with_prefix=True)
    mu, _ = runner._encode(rows())
    eager_mels, _ = runner._solve(rows(), mu)
    packed = runner.solver
    packed.graphs = PackedGraphs(packed, frames=(256, 1024), rows=6)
    packed.graphs.emulate = True
    assert packed.bucket([100, 100, 200, 90], [50, 150, 250, 450], mu) == (6, 1024, packed.graphs.key_count)
    needed, computed = runner.frames_needed, runner.frames_computed
    for _ in range(2):
        mels, _ = packed.solve(rows(), mu)
        for a, b in zip(eager_mels, mels):
            assert a.shape == b.shape and (a - b).abs().max().item() <= TOL
    assert runner.frames_computed - computed == 2 * 1024  # the frame bucket, no padding rows
    assert runner.frames_needed - needed == 2 * (100 + 100 + 200 + 90)


@parity
def test_a_stream_carried_on_by_calls_shared_with_another_stays_equal(oracle) -> None:
    """Caches written by packed calls feed the next packed call: three chunks of one stream, each beside a fresh
    stream's first chunk, against the same stream run alone."""
    flow, dump = oracle
    runner = CachedFlowRunner(flow, graphs=False)
    prompt_tokens, prompt_mel = dump["in_prompt_speech_token"][0].long(), dump["in_prompt_feat"][0]
    spks = runner.project_speaker(dump["in_xvector"])[0]
    prefix = runner.prefix(prompt_tokens, prompt_mel, spks)
    offset, tokens = prompt_tokens.numel(), random_tokens(300, seed=4)
    own_alone, own_shared = CachedSegment(), CachedSegment()
    for stop in (35, 85, 185):
        def row(own):
            return CachedRow(torch.cat([prompt_tokens, tokens]), prompt_mel, spks, prefix, own, stop=offset + stop,
                             final=False, keep=True)

        fresh = CachedRow(torch.cat([prompt_tokens, tokens]), prompt_mel, spks, prefix, CachedSegment(),
                          stop=offset + 35, final=False, keep=True)
        reference = runner.run([row(own_alone)])[0]
        mels = runner.run([row(own_shared), fresh])
        assert (reference - mels[0]).abs().max().item() <= TOL


# ---- through Token2Wav, on the tiny model directory: streams batched at different points -----------------
@pytest.mark.parametrize("flow_cache", ["chunked", "exact"])
def test_token2wav_streams_batched_at_staggered_points_give_each_streams_audio_alone(
        tiny_engine, tiny_prompt, tiny_prompt_unaligned, flow_cache: str) -> None:
    base = tiny_engine.token2wav_engine
    tokens = random_tokens(230, seed=6).tolist()
    prompts = [tiny_prompt, tiny_prompt_unaligned, tiny_prompt]
    engine = Token2Wav(base.flow, base.hift, base.config, flow_cache=flow_cache)
    joins = [0, 40, 90]  # stream i gets its first tokens when the clock reaches joins[i]

    def calls(which: list[int]) -> list[np.ndarray]:
        """Streams `which`, one chunk of each per call (`run_chunks`), at staggered points of their schedules."""
        streams = {i: engine.open_stream(engine.flow_prompt(prompts[i]), engine.new_generator(i)) for i in which}
        audio: dict[int, list[np.ndarray]] = {i: [] for i in which}
        for clock in range(0, max(joins) + len(tokens) + 10, 10):
            work = []
            for i, stream in streams.items():
                fed = min(len(tokens), max(0, clock - joins[i]))
                if stream.finished or clock < joins[i]:
                    continue
                stream.extend(tokens[len(stream.tokens) : fed])
                chunk = stream.next_chunk(finished=fed == len(tokens))
                if chunk is not None:
                    work.append((i, stream, chunk))
            pieces = engine.run_chunks([(stream, chunk) for _, stream, chunk in work]) if work else []
            for (i, _, _), piece in zip(work, pieces):
                audio[i].append(piece)
        assert all(stream.finished for stream in streams.values())
        return [np.concatenate(audio[i]) for i in which]

    runner = engine.cached
    needed = runner.frames_needed
    together = calls([0, 1, 2])
    # eager on the CPU: the packed frame axis is the rows' frames, nothing padded
    assert runner.frames_computed == runner.frames_needed > needed
    alone = [calls([i])[0] for i in range(len(prompts))]
    for a, b in zip(alone, together):
        assert a.shape == b.shape == (960 * len(tokens),)
        assert np.abs(a - b).max() < 1e-3  # HiFT turns mel rounding (1e-6) into ~2e-4 here
