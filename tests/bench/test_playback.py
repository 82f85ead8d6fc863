"""Playback stalls from hand-built arrival sequences (times in seconds)."""

import pytest

from ttsbench.playback import StreamStalls, stream_stalls, summarize_stalls


def test_chunks_arriving_before_the_audio_runs_out_never_stall():
    # 1 s of audio at t=0.2, the next second at 1.0 (still 0.2 s buffered), the last at 2.2 (exactly on time)
    assert stream_stalls([0.2, 1.0, 2.2], [1.0, 1.0, 0.5]) == StreamStalls(0, 0.0)


def test_one_late_chunk_is_one_stall_of_its_lateness():
    # playback 0.1 .. 0.6; the second chunk comes at 0.9: 0.3 s of silence, then 0.9 .. 1.4; third on time
    stalls = stream_stalls([0.1, 0.9, 1.2], [0.5, 0.5, 0.5])
    assert stalls.count == 1 and stalls.seconds == pytest.approx(0.3)


def test_several_stalls_add_up_and_playback_resumes_from_the_late_arrival():
    # 0.0 .. 0.2 | stall 0.3 | 0.5 .. 0.7 | stall 0.1 | 0.8 .. 1.8 | 1.0 fits | stall 0.2 (buffer ended 2.8)
    stalls = stream_stalls([0.0, 0.5, 0.8, 1.0, 3.0], [0.2, 0.2, 1.0, 1.0, 0.4])
    assert stalls.count == 3 and stalls.seconds == pytest.approx(0.3 + 0.1 + 0.2)
    assert stalls.late_pieces == (2, 3, 5)  # the pieces that came after the audio before them had played


def test_a_single_chunk_cannot_stall():
    assert stream_stalls([0.7], [3.0]) == StreamStalls(0, 0.0)
    assert stream_stalls([], []) == StreamStalls(0, 0.0)


def test_pieces_without_audio_neither_start_playback_nor_end_a_stall():
    # a header at 0.0 (no audio): playback starts with the audio at 0.4 and runs until 0.6
    assert stream_stalls([0.0, 0.4, 0.5], [0.0, 0.2, 0.1]) == StreamStalls(0, 0.0)
    # a silent piece at 0.8 does not end the stall that started at 0.6; the audio at 1.0 does
    stalls = stream_stalls([0.4, 0.8, 1.0], [0.2, 0.0, 0.5])
    assert stalls.count == 1 and stalls.seconds == pytest.approx(0.4)
    assert stalls.late_pieces == (2,)  # counted among the pieces with audio: the silent one is not a chunk


@pytest.mark.parametrize(
    ("arrivals", "durations"), [([0.1, 0.2], [0.1]), ([0.1], [-0.1]), ([0.5, 0.2], [0.1, 0.1])]
)
def test_inconsistent_inputs_are_refused(arrivals, durations):
    with pytest.raises(ValueError):
        stream_stalls(arrivals, durations)


def test_summary_over_streams():
    streams = [StreamStalls(0, 0.0), StreamStalls(2, 0.3, (2, 4)), StreamStalls(0, 0.0), StreamStalls(1, 0.1, (2,))]
    s = summarize_stalls(streams)
    assert (s.streams, s.stalled, s.events) == (4, 2, 3)
    assert s.stalled_share == 0.5
    assert s.total == pytest.approx(0.4)
    assert s.p50 == pytest.approx(0.05)  # between 0.0 and 0.1
    assert s.p90 == pytest.approx(0.24)  # 0.1 + 0.7 x (0.3 - 0.1)
    assert s.max == pytest.approx(0.3)
    assert s.to_dict()["stalled_share"] == 0.5
    assert s.by_piece == {2: 2, 4: 1} and s.describe_pieces() == "at chunk 2: 2, chunk 4: 1"
    assert summarize_stalls(streams[:1]).describe_pieces() == ""
    assert summarize_stalls([]) is None
