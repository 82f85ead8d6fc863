"""The chunk schedule object on its own (docs/reference/cosyvoice2.md#streaming-schedule): pure arithmetic, no model."""

from __future__ import annotations

import pytest

from cosyvoice2.streaming import Chunk, ChunkSchedule


def test_spec_worked_example_aligned_prompt_needs_28_tokens() -> None:
    # docs/reference/cosyvoice2.md#flow-inference-and-lengths: P = 75 prompt tokens -> pad 0, the first chunk needs 25
    # + 3 tokens
    schedule = ChunkSchedule(prompt_tokens=75)
    assert schedule.prompt_pad == 0
    assert schedule.next_chunk(0, 0, available=27, finished=False) is None
    assert schedule.next_chunk(0, 0, available=28, finished=False) == Chunk(0, 25, 28, final=False)


@pytest.mark.parametrize(
    ("prompt_tokens", "hops"),
    [
        (75, [25, 50, 100, 100, 100]),
        (40, [35, 50, 100, 100, 100]),  # pad 10: prompt + first hop = 75, on the 25 grid
        (1, [49, 50, 100, 100, 100]),
        (0, [25, 50, 100, 100, 100]),
    ],
)
def test_hops_grow_by_two_capped_at_100_with_prompt_pad(prompt_tokens: int, hops: list[int]) -> None:
    schedule = ChunkSchedule(prompt_tokens=prompt_tokens)
    assert [schedule.hop(i) for i in range(5)] == hops
    assert (prompt_tokens + schedule.hop(0)) % 25 == 0


def test_configurable_first_hop_keeps_doubling_from_it() -> None:
    schedule = ChunkSchedule(prompt_tokens=50, first_hop=15)
    assert [schedule.hop(i) for i in range(5)] == [15, 30, 60, 100, 100]


@pytest.mark.parametrize("prompt_tokens", [0, 1, 40, 75])
def test_unaligned_served_schedule_needs_first_hop_plus_lookahead(prompt_tokens: int) -> None:
    """Unpadded ("never", and a lone stream's under "busy"): no prompt pad whatever the prompt's length; the rest
    of the schedule is unchanged. "always" has no other schedule for a lone stream."""
    from cosyvoice2.config import EngineConfig
    from speech_serving.schedule import StreamScheduleParams, for_prompt

    engine = EngineConfig()
    for first_hop in (15, 25):
        aligned = for_prompt(StreamScheduleParams(first_hop, align_first_hop="always").schedule(engine), prompt_tokens)
        busy = StreamScheduleParams(first_hop, align_first_hop="busy")
        assert busy.schedule(engine) == StreamScheduleParams(first_hop, align_first_hop="always").schedule(engine)
        assert StreamScheduleParams(first_hop, align_first_hop="always").lone_schedule(engine) is None
        never = StreamScheduleParams(first_hop, align_first_hop="never")
        assert never.lone_schedule(engine) is None and never.schedules(engine) == [never.schedule(engine)]
        for free in (for_prompt(never.schedule(engine), prompt_tokens), for_prompt(busy.lone_schedule(engine),
                                                                                   prompt_tokens)):
            assert free.prompt_pad == 0 and free.hop(0) == first_hop
            assert free.next_chunk(0, 0, available=first_hop + 2, finished=False) is None
            assert free.next_chunk(0, 0, available=first_hop + 3, finished=False) == Chunk(
                0, first_hop, first_hop + 3, final=False)
            assert [free.hop(i) for i in range(1, 5)] == [aligned.hop(i) for i in range(1, 5)]
        assert aligned.hop(0) == first_hop + (-prompt_tokens % 25)
    with pytest.raises(ValueError, match="align_first_hop"):
        StreamScheduleParams(align_first_hop="sometimes")


@pytest.mark.parametrize("align", ["always", "busy", "never"])
def test_a_lone_stream_may_start_with_a_shorter_first_hop(align: str) -> None:
    """`lone_first_hop`: only a stream that starts alone gets it (unpadded unless "always" pads every first hop);
    the busy streams' schedule and every later hop are unchanged, and both schedules are served (graph buckets)."""
    from cosyvoice2.config import EngineConfig
    from speech_serving.schedule import StreamScheduleParams, for_prompt

    engine = EngineConfig()
    plain = StreamScheduleParams(25, align_first_hop=align)
    params = StreamScheduleParams(25, align_first_hop=align, lone_first_hop=12)
    assert params.schedule(engine) == plain.schedule(engine)
    lone = params.lone_schedule(engine)
    light = [] if params.light_schedule(engine) is None else [params.light_schedule(engine)]
    assert lone is not None and params.schedules(engine) == [params.schedule(engine), *light, lone]
    for prompt_tokens in (0, 7, 40):
        first = for_prompt(lone, prompt_tokens)
        assert first.hop(0) == 12 + (first.prompt_pad if align == "always" else 0)
        assert first.prompt_pad == (-prompt_tokens % 25 if align == "always" else 0)
        assert [first.hop(i) for i in range(1, 5)] == [for_prompt(plain.schedule(engine), prompt_tokens).hop(i)
                                                       for i in range(1, 5)]
    # the same hop as everyone's changes nothing
    assert StreamScheduleParams(25, align_first_hop=align, lone_first_hop=25).lone_schedule(engine) == \
        plain.lone_schedule(engine)
    with pytest.raises(ValueError, match="lone_first_hop"):
        StreamScheduleParams(lone_first_hop=0)


@pytest.mark.parametrize("busy_streams", [2, 3, 24])
def test_busy_alignment_pads_only_from_busy_streams_on(busy_streams: int) -> None:
    """"busy": streams that start beside fewer than `busy_streams` others-and-itself get the unpadded first hop
    (`light_schedule`), the others the padded one; with `busy_streams` 2 no stream sits between lone and busy.
    Every schedule a stream may follow is served once (`schedules`: what token2wav's graph buckets cover)."""
    from cosyvoice2.config import EngineConfig
    from speech_serving.schedule import StreamScheduleParams, for_prompt, unaligned

    engine = EngineConfig()
    params = StreamScheduleParams(25, align_first_hop="busy", busy_streams=busy_streams, lone_first_hop=12)
    light = params.light_schedule(engine)
    if busy_streams == 2:
        assert light is None
    else:
        assert light == unaligned(params.schedule(engine))
        for prompt_tokens in (0, 7, 40):
            first = for_prompt(light, prompt_tokens)
            assert first.prompt_pad == 0 and first.hop(0) == 25
            assert for_prompt(params.schedule(engine), prompt_tokens).hop(0) == 25 + (-prompt_tokens % 25)
    served = params.schedules(engine)
    assert len(served) == len(set(served)) == (2 if light is None else 3)
    for align in ("always", "never"):
        assert StreamScheduleParams(25, align_first_hop=align, busy_streams=busy_streams).light_schedule(engine) is None
    with pytest.raises(ValueError, match="busy_streams"):
        StreamScheduleParams(busy_streams=1)


def test_chunks_of_a_finished_stream() -> None:
    # P = 40: hops 35, 50, 100; 300 tokens -> 35 (needs 38), 50 (needs 88), 100 (needs 188);
    # the next 100-hop needs 288 <= 300 so it runs too (ends at 285); the 15 left form the final chunk.
    chunks = ChunkSchedule(prompt_tokens=40).chunks(300)
    assert chunks == [
        Chunk(0, 35, 38, False),
        Chunk(35, 85, 88, False),
        Chunk(85, 185, 188, False),
        Chunk(185, 285, 288, False),
        Chunk(285, 300, 300, True),
    ]


@pytest.mark.parametrize("n_tokens", [0, 1, 27, 28, 29, 77, 78, 181, 182, 500])
def test_chunks_tile_the_tokens_and_the_final_rest_is_short(n_tokens: int) -> None:
    schedule = ChunkSchedule(prompt_tokens=75)
    chunks = schedule.chunks(n_tokens)
    assert [c.final for c in chunks] == [False] * (len(chunks) - 1) + [True]
    assert chunks[0].start == 0 and chunks[-1].stop == n_tokens
    for previous, chunk in zip(chunks, chunks[1:]):
        assert chunk.start == previous.stop
    for index, chunk in enumerate(chunks[:-1]):
        assert chunk.hop == schedule.hop(index) and chunk.feed == chunk.stop + 3
    # the final chunk exists because a further non-final one was impossible
    assert chunks[-1].hop < schedule.hop(len(chunks) - 1) + 3


def test_too_short_stream_is_one_final_chunk_like_offline() -> None:
    assert ChunkSchedule(prompt_tokens=75).chunks(27) == [Chunk(0, 27, 27, True)]


def test_waiting_until_enough_tokens_then_final_when_finished() -> None:
    schedule = ChunkSchedule(prompt_tokens=75)
    assert schedule.next_chunk(25, 1, available=77, finished=False) is None  # hop 50 needs 78
    assert schedule.next_chunk(25, 1, available=77, finished=True) == Chunk(25, 77, 77, True)


def test_rejects_first_hop_below_the_hift_cache() -> None:
    with pytest.raises(ValueError, match="first_hop"):
        ChunkSchedule(first_hop=3)


@pytest.mark.parametrize(("prompt_tokens", "first_hop", "growth"), [(40, 25, 2), (75, 15, 2), (1, 5, 3), (0, 25, 1)])
def test_boundaries_are_exactly_the_counts_at_which_a_chunk_becomes_runnable(prompt_tokens, first_hop, growth) -> None:
    """Tokens arriving one at a time: a chunk runs exactly when the count reaches the next boundary."""
    schedule = ChunkSchedule(prompt_tokens=prompt_tokens, first_hop=first_hop, growth=growth)
    runnable_at = []
    start = index = 0
    for available in range(1, 701):
        while chunk := schedule.next_chunk(start, index, available, finished=False):
            runnable_at.append(available)
            start, index = chunk.stop, index + 1
    assert schedule.boundaries(700) == runnable_at
    assert schedule.boundaries(runnable_at[2]) == runnable_at[:3]  # inclusive limit
    assert schedule.boundaries(runnable_at[0] - 1) == []
