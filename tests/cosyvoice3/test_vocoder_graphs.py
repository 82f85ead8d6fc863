"""CosyVoice3's vocoder graphs (`cosyvoice3.vocoder_graphs`), checked on the CPU: a non-final windowed-vocoder call
padded to its bucket - more rows, windows further left-padded, all through the static buffers - gives the samples
and the stream states of the unpadded eager call (`WindowGraphs.emulate` runs the padded path eagerly); calls that
fit no bucket, and final calls, run eagerly and are counted; and every non-final call the streams of the served
schedules make fits a bucket of the engine's vocoder graphs. tests/gpu/test_cosyvoice3_graphs.py replays captured
graphs on a GPU."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from cosyvoice3.hift import CausalHiFT, VocoderState
from cosyvoice3.token2wav import CosyVoice3Token2Wav, runtime_schedule
from cosyvoice3.vocoder_graphs import WindowBuckets, WindowGraphs, window_calls
from tests.cosyvoice3.conftest import make_voice, open_stream, run_rounds, stream_tokens
from tests.cosyvoice3.test_windowed_vocoder import AUDIO_ATOL, mels, tiny_hift

RATIO = 2  # mel frames per token
# small row buckets: calls of 3 rows pad to 4, calls of 5 fit none
ROWS = (1, 2, 4)

# per stream: the round its first chunk runs in, its chunks' new mel frames, its final chunk's. Streams at
# different chunk indices share calls: first chunks of one length together (from frame 0, 3 rows -> 4 in round 2),
# windowed rows of different window lengths together (round 3: windows of 105, 105 and 85 frames, 3 rows, padded
# to the longest, then to the bucket of 4 rows x 160 frames).
STREAMS = {
    "a": (0, [30, 50, 100, 60], 40),
    "b": (0, [30, 50, 100], 17),
    "c": (1, [30, 50, 60], 90),
    "d": (2, [30, 50, 100], 3),
    "e": (2, [30, 50], 60),
    "f": (1, [30, 50, 40], 5),
    "g": (2, [30], 11),
}


def run_streams(hift: CausalHiFT, graphs: WindowGraphs | None
                ) -> tuple[dict[str, list[torch.Tensor]], dict[str, list[VocoderState]]]:
    """Every stream of `STREAMS`, one chunk of each live stream per `stream_chunks` call -> each stream's audio per
    chunk and state after it."""
    chunks = {name: [(mel, False) for mel in mels(sizes, seed=ord(name))]
              + [(mels([final], seed=ord(name) + 50)[0], True)] for name, (_, sizes, final) in STREAMS.items()}
    states = {name: hift.stream_start() for name in STREAMS}
    audio: dict[str, list[torch.Tensor]] = {name: [] for name in STREAMS}
    after: dict[str, list[VocoderState]] = {name: [] for name in STREAMS}
    round_ = 0
    while any(len(audio[name]) < len(chunks[name]) for name in STREAMS):
        live = [name for name, (first, _, _) in STREAMS.items()
                if first <= round_ and len(audio[name]) < len(chunks[name])]
        rows = [(states[name], *chunks[name][len(audio[name])]) for name in live]
        for name, (samples, state) in zip(live, hift.stream_chunks(rows, graphs)):
            audio[name].append(samples)
            after[name].append(state)
            states[name] = state
        round_ += 1
    return audio, after


def schedule_buckets(hift: CausalHiFT) -> WindowBuckets:
    return WindowBuckets.covering(hift, [runtime_schedule()], RATIO, ROWS)


def recording(graphs: WindowGraphs) -> list[tuple[tuple[int, int, bool, bool], object]]:
    """Record every (rows, frames, windowed, final) a call asks `graphs` for, with the bucket it got."""
    calls: list = []
    bucket = graphs.bucket

    def wrapped(rows: int, frames: int, windowed: bool, finalize: bool, device: torch.device):
        shape = bucket(rows, frames, windowed, finalize, device)
        calls.append(((rows, frames, windowed, finalize), shape))
        return shape

    graphs.bucket = wrapped  # type: ignore[method-assign]
    return calls


def assert_same_states(ours: VocoderState, theirs: VocoderState) -> None:
    assert (ours.frames, ours.sent, ours.phase_frame) == (theirs.frames, theirs.sent, theirs.phase_frame)
    assert torch.equal(ours.mel, theirs.mel)
    assert (ours.phase is None) == (theirs.phase is None)
    if ours.phase is not None:
        torch.testing.assert_close(ours.phase, theirs.phase, rtol=0, atol=1e-9)


@pytest.mark.parametrize("voiced", [True, False], ids=["voiced", "unvoiced"])
def test_emulated_buckets_give_the_eager_samples_and_states(voiced: bool) -> None:
    hift = tiny_hift(voiced)
    eager_audio, eager_states = run_streams(hift, None)
    graphs = WindowGraphs(hift, schedule_buckets(hift))
    graphs.emulate = True
    calls = recording(graphs)
    audio, states = run_streams(hift, graphs)
    for name in STREAMS:
        for k, (ours, theirs) in enumerate(zip(audio[name], eager_audio[name], strict=True)):
            assert ours.shape == theirs.shape, (name, k)
            torch.testing.assert_close(ours, theirs, rtol=0, atol=AUDIO_ATOL, msg=f"{name} chunk {k}")
        for ours, theirs in zip(states[name], eager_states[name], strict=True):
            assert_same_states(ours, theirs)
    replayed = [(call, shape) for call, shape in calls if shape is not None]
    # every non-final call replays; the padding is real: rows (3 -> 4), windows (to the bucket), and windows of
    # different lengths in one call
    assert all(shape is not None for (_, _, _, final), shape in calls if not final)
    assert any(rows < shape[0] and windowed for (rows, _, windowed, _), shape in replayed)
    assert any(rows < shape[0] and not windowed for (rows, _, windowed, _), shape in replayed)
    assert any(windowed and frames < shape[1] for (_, frames, windowed, _), shape in replayed)
    assert any(not windowed for (_, _, windowed, _), _ in replayed)
    finals = sum(final for (_, _, _, final), _ in calls)
    assert (graphs.replayed_calls, graphs.eager_calls) == (len(replayed), finals) and finals >= 3
    assert graphs.buffer_bytes == graphs.planned_bytes(torch.float32) > 0  # every bucket views the shared buffers


@torch.inference_mode()
def test_calls_that_fit_no_bucket_run_eagerly_and_are_counted() -> None:
    """Five rows (more than the largest row bucket), a window longer than the longest bucket, a call from frame 0
    of a frame count no bucket has, and a final call: each runs eagerly, with the eager call's samples."""
    hift = tiny_hift(voiced=True)
    buckets = schedule_buckets(hift)
    small = WindowBuckets(buckets.rows, buckets.windows[:1], buckets.starts)  # windows up to a 100-frame chunk's
    graphs = WindowGraphs(hift, small)
    graphs.emulate = True
    states = []
    for name, sizes in {"first": [], "second": [30], "third": [30, 50], "fourth": [30, 50, 100]}.items():
        state = hift.stream_start()
        for mel in mels(sizes, seed=len(name)):
            state = hift.stream_chunks([(state, mel, False)])[0][1]
        states.append(state)
    fresh, second, third, fourth = states
    calls = {
        "five rows": [(third, mel, False) for mel in mels([60] * 5, seed=1)],
        "long window": [(fourth, mels([200], seed=2)[0], False)],
        "first chunk of 20 frames": [(fresh, mels([20], seed=3)[0], False)],
        "final": [(second, mels([50], seed=4)[0], True)],
    }
    for name, rows in calls.items():
        before = graphs.eager_calls
        ours, theirs = hift.stream_chunks(rows, graphs), hift.stream_chunks(rows)
        for (a, state), (b, eager_state) in zip(ours, theirs, strict=True):
            assert torch.equal(a, b), name  # the same eager call
            assert_same_states(state, eager_state)
        assert graphs.eager_calls == before + 1, name
    assert graphs.replayed_calls == 0 and graphs.count == 0
    assert small.fit(4, 145, True) == (4, small.windows[0], 1) and small.fit(5, 145, True) is None
    assert small.fit(1, 30, False) == (1, 30, 0) and small.fit(1, 31, False) is None
    # on the CPU nothing is captured, and a graph set that does not emulate replays nothing there
    plain = WindowGraphs(hift, buckets)
    assert plain.bucket(1, 145, True, False, torch.device("cpu")) is None
    with pytest.raises(ValueError, match="CUDA"):
        plain.capture_all(torch.device("cpu"))


@pytest.mark.parametrize("hops", [(15, 25), (10, 20)])
def test_the_buckets_cover_every_non_final_call_of_the_schedule(tiny_parts, hops) -> None:
    """A stream cut by the schedule, run through the real `stream_chunks` with its hops' mel frames: every non-final
    call (while the chunk's new frames are within the flow graphs' longest) fits a bucket of the engine's vocoder
    graphs for that schedule, at every row count of the flow's buckets; and the walk the buckets are computed from
    (`window_calls`) is the calls' own."""
    flow, hift = tiny_parts
    schedule = runtime_schedule(*hops, lookahead=flow.config.pre_lookahead_len)
    engine = CosyVoice3Token2Wav(flow, hift, schedule)
    graphs = engine.vocoder_graphs
    assert graphs.buckets == engine.vocoder_buckets([schedule]) and graphs.buckets.rows == engine.graphs.buckets.rows
    graphs.emulate = True
    calls = recording(graphs)
    limit = max(engine.graphs.buckets.frames)  # the flow's longest chunk bucket: longer chunks run eagerly there too
    sizes = []
    for index in range(64):
        new = RATIO * schedule.hop(index)
        if new > limit:
            break
        sizes.append(new)
    state = hift.stream_start()
    for mel in mels(sizes + [7], seed=9):
        state = hift.stream_chunks([(state, mel, mel.shape[2] == 7)], graphs)[0][1]
    non_final = [call for call, _ in calls if not call[3]]
    assert len(non_final) == len(sizes) >= 5
    assert [(windowed, frames) for _, frames, windowed, _ in non_final] == window_calls(hift, schedule, RATIO)
    assert any(windowed for _, _, windowed, _ in non_final) and any(not w for _, _, w, _ in non_final)
    for _, frames, windowed, _ in non_final:
        for rows in graphs.buckets.rows:
            assert graphs.buckets.fit(rows, frames, windowed) is not None, (rows, frames, windowed)
    assert all(shape is not None for (_, _, _, final), shape in calls if not final)


def test_served_streams_replay_every_non_final_vocoder_call(token2wav: CosyVoice3Token2Wav) -> None:
    """Cached streams of two voices through `run_chunks`, with the engine's own vocoder graphs emulated: the same
    audio as with them eager, every non-final call replayed, only the final chunks' calls eager."""
    voices = [make_voice(3, 20), make_voice(4, 56)]
    tokens = [stream_tokens(1, 100), stream_tokens(2, 60)]

    def run() -> list[np.ndarray]:
        streams = [open_stream(token2wav, voice, ours) for voice, ours in zip(voices, tokens)]
        rounds = run_rounds(token2wav, streams, [0, 1])
        return [np.concatenate(pieces) for pieces in rounds.pieces]

    graphs = token2wav.vocoder_graphs
    eager = run()
    graphs.emulate = True
    calls = recording(graphs)
    try:
        replayed = run()
    finally:
        graphs.emulate = False
        del graphs.bucket  # the class's own again
    for ours, theirs in zip(replayed, eager, strict=True):
        assert ours.shape == theirs.shape
        np.testing.assert_allclose(ours, theirs, rtol=0, atol=AUDIO_ATOL)  # the same mel: the vocoder's rounding
    non_final = [shape for (_, _, _, final), shape in calls if not final]
    assert len(non_final) >= 5 and all(shape is not None for shape in non_final)
    assert any(windowed for (_, _, windowed, final), _ in calls if not final)
    assert graphs.replayed_calls == len(non_final) and graphs.eager_calls == len(calls) - len(non_final) >= 1
