"""The token2wav service's call order (`token2wav_policy.SchedulePolicy`), pure: starving streams, then first
chunks, then earliest deadline; ties keep their arrival order; a call holds at most `max_rows` jobs."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from speech_serving.token2wav_policy import CallTimes, PendingJob, SchedulePolicy, Urgency

NOW, CALL_S = 100.0, 0.2


def test_starving_streams_then_first_chunks_then_the_earliest_deadline():
    policy = SchedulePolicy(max_defer_s=0.25)
    jobs = [
        PendingJob(queued_at=99.0, first_chunk=False, runs_dry_at=103.0),  # 0: plays 3 s more
        PendingJob(queued_at=99.9, first_chunk=True),  # 1: a new stream
        PendingJob(queued_at=99.5, first_chunk=False, runs_dry_at=100.1),  # 2: runs dry during this call
        PendingJob(queued_at=99.8, first_chunk=False, runs_dry_at=101.0),  # 3: plays 1 s more
        PendingJob(queued_at=99.2, first_chunk=True),  # 4: an earlier new stream
        PendingJob(queued_at=99.6, first_chunk=False, runs_dry_at=99.0),  # 5: already ran dry
        PendingJob(queued_at=99.9, first_chunk=False),  # 6: offline (nothing playing): due at 100.15
        PendingJob(queued_at=99.7, first_chunk=False),  # 7: offline, overdue since 99.95
    ]
    assert [policy.urgency(job, NOW, CALL_S) for job in jobs] == [
        Urgency.SCHEDULED, Urgency.FIRST_CHUNK, Urgency.STARVING, Urgency.SCHEDULED, Urgency.FIRST_CHUNK,
        Urgency.STARVING, Urgency.SCHEDULED, Urgency.STARVING]
    # starving by deadline (5 ran dry first, then the overdue offline job), first chunks by arrival, the rest by
    # deadline (the offline job is due before the streams that still have audio buffered)
    assert policy.order(jobs, NOW, CALL_S) == [5, 7, 2, 4, 1, 6, 3, 0]


def test_a_stream_is_starving_once_its_audio_runs_out_within_starving_calls_expected_calls():
    job = PendingJob(queued_at=99.0, first_chunk=False, runs_dry_at=NOW + 0.5)
    strict = SchedulePolicy(starving_calls=1.0)  # only once this very call would end too late
    assert strict.urgency(job, NOW, call_s=0.4) == Urgency.SCHEDULED
    assert strict.urgency(job, NOW, call_s=0.6) == Urgency.STARVING
    assert strict.urgency(job, NOW + 0.2, call_s=0.4) == Urgency.STARVING  # later, the same call would be too late
    served = SchedulePolicy()  # the served default: three expected calls ahead
    assert served.starving_calls == 3.0
    assert served.urgency(job, NOW, call_s=0.16) == Urgency.SCHEDULED  # 0.48 s of calls fit in 0.5 s of audio
    assert served.urgency(job, NOW, call_s=0.17) == Urgency.STARVING
    assert served.urgency(job, NOW + 0.2, call_s=0.12) == Urgency.STARVING


def test_a_first_chunk_never_counts_as_overdue_and_an_offline_job_does_once_past_its_deadline():
    policy = SchedulePolicy(max_defer_s=0.25)
    first = PendingJob(queued_at=90.0, first_chunk=True)
    offline = PendingJob(queued_at=99.8, first_chunk=False)
    assert policy.urgency(first, NOW, CALL_S) == Urgency.FIRST_CHUNK
    assert policy.urgency(offline, NOW, CALL_S) == Urgency.SCHEDULED  # due at 100.05
    assert policy.urgency(offline, NOW + 0.1, CALL_S) == Urgency.STARVING
    assert policy.order([first, offline], NOW + 0.1, CALL_S) == [1, 0]


def test_ties_keep_the_given_order():
    policy = SchedulePolicy(max_defer_s=0.0)
    same_first = [PendingJob(queued_at=99.0, first_chunk=True) for _ in range(4)]
    assert policy.order(same_first, NOW, CALL_S) == [0, 1, 2, 3]
    same_deadline = [PendingJob(queued_at=float(i), first_chunk=False, runs_dry_at=105.0) for i in range(4)]
    assert policy.order(same_deadline, NOW, CALL_S) == [0, 1, 2, 3]
    starving = [PendingJob(queued_at=99.0, first_chunk=False, runs_dry_at=99.5) for _ in range(3)]
    assert policy.order(starving, NOW, CALL_S) == [0, 1, 2]


def test_the_next_call_takes_the_most_urgent_jobs_up_to_the_row_cap():
    jobs = [PendingJob(queued_at=99.0, first_chunk=False, runs_dry_at=110.0 - i) for i in range(5)]
    assert SchedulePolicy(max_rows=3).next_call(jobs, NOW, CALL_S) == [4, 3, 2]  # earliest deadlines
    assert SchedulePolicy(max_rows=1).next_call(jobs, NOW, CALL_S) == [4]
    assert SchedulePolicy().next_call(jobs, NOW, CALL_S) == [4, 3, 2, 1, 0]  # no cap
    assert SchedulePolicy(max_rows=3).next_call([], NOW, CALL_S) == []
    assert [SchedulePolicy(max_rows=3).call_rows(n) for n in (1, 3, 7)] == [1, 3, 3]
    assert SchedulePolicy().call_rows(7) == 7


def test_while_first_chunks_wait_a_call_holds_only_them_and_the_starving():
    jobs = [PendingJob(queued_at=99.0, first_chunk=False, runs_dry_at=110.0 - i) for i in range(5)]
    jobs += [PendingJob(queued_at=99.9, first_chunk=True), PendingJob(queued_at=99.0, first_chunk=False,
                                                                     runs_dry_at=NOW + 0.1)]
    assert SchedulePolicy(max_rows=8).next_call(jobs, NOW, CALL_S) == [6, 5]  # starving, first chunk; no others
    assert SchedulePolicy(max_rows=1).next_call(jobs, NOW, CALL_S) == [6]
    first_chunks = [PendingJob(queued_at=99.0 + i / 10, first_chunk=True) for i in range(5)]
    assert SchedulePolicy(max_rows=3).next_call(first_chunks + jobs[:5], NOW, CALL_S) == [0, 1, 2]


@pytest.mark.parametrize("max_rows, max_defer_s, message", [(0, 0.25, "max_rows"), (4, -1.0, "max_defer_s")])
def test_bad_settings_are_refused(max_rows, max_defer_s, message):
    with pytest.raises(ValueError, match=message):
        SchedulePolicy(max_rows=max_rows, max_defer_s=max_defer_s)


def test_starving_calls_2_lets_a_later_chunk_into_the_last_call_that_is_on_time():
    """While first chunks wait, a call holds only them and the starving. A later chunk due in 1.5 calls: with
    `starving_calls` 1 it is held back from this call (it could still make it) and so misses its deadline in the
    next; with 2 it goes into this one, ahead of the first chunks' remainder."""
    later = PendingJob(queued_at=99.0, first_chunk=False, runs_dry_at=NOW + 1.5 * CALL_S)
    firsts = [PendingJob(queued_at=99.5 + i / 100, first_chunk=True) for i in range(3)]
    jobs = [*firsts, later]
    strict, early = SchedulePolicy(max_rows=2, starving_calls=1.0), SchedulePolicy(max_rows=2, starving_calls=2.0)
    assert strict.urgency(later, NOW, CALL_S) == Urgency.SCHEDULED
    assert strict.next_call(jobs, NOW, CALL_S) == [0, 1]
    assert early.urgency(later, NOW, CALL_S) == Urgency.STARVING
    assert early.next_call(jobs, NOW, CALL_S) == [3, 0]
    # one call later the strict policy takes it, but that call ends after its listener ran dry
    assert strict.urgency(later, NOW + CALL_S, CALL_S) == Urgency.STARVING
    assert NOW + 2 * CALL_S > later.runs_dry_at > NOW + CALL_S


def _first_late_call(policy: SchedulePolicy, calls: int, call_s: float) -> float | None:
    """Back-to-back calls of `call_s` under a steady stream of first chunks (two new ones per call, a call holds
    two jobs), and one playing stream whose next chunk is queued at t=0 with 0.84 s of audio left: how late its
    chunk's call ends after its listener ran dry (None: on time)."""
    later = PendingJob(queued_at=0.0, first_chunk=False, runs_dry_at=0.84)
    waiting = [PendingJob(queued_at=-0.01, first_chunk=True), PendingJob(queued_at=-0.005, first_chunk=True)]
    now = 0.0
    for call in range(calls):
        jobs = [*waiting, later]
        chosen = policy.next_call(jobs, now, call_s)
        now += call_s
        if len(jobs) - 1 in chosen:
            return max(0.0, now - later.runs_dry_at) or None
        waiting = [job for i, job in enumerate(waiting) if i not in chosen]
        waiting += [PendingJob(queued_at=now - 0.01, first_chunk=True), PendingJob(queued_at=now, first_chunk=True)]
    raise AssertionError("the later chunk never ran")


@pytest.mark.parametrize("call_s", [0.12, 0.15, 0.2, 0.25])
def test_under_steady_first_chunks_a_later_chunk_is_late_with_1_and_on_time_with_2_or_the_default(call_s):
    assert _first_late_call(SchedulePolicy(max_rows=2, starving_calls=1.0), 20, call_s) is not None
    assert _first_late_call(SchedulePolicy(max_rows=2, starving_calls=2.0), 20, call_s) is None
    assert _first_late_call(SchedulePolicy(max_rows=2), 20, call_s) is None


def test_starving_calls_below_one_is_refused():
    with pytest.raises(ValueError, match="starving_calls"):
        SchedulePolicy(starving_calls=0.5)


def test_call_times_answer_the_running_mean_until_calls_of_two_sizes_were_seen():
    times = CallTimes(initial_s=0.2, weight=0.5)
    assert times.expected(1) == times.expected(16) == 0.2
    times.observe(4, 0.1)
    times.observe(4, 0.3)
    assert times.expected(1) == times.expected(16) == pytest.approx(0.5 * (0.5 * 0.2 + 0.5 * 0.1) + 0.5 * 0.3)


def test_call_times_follow_the_line_of_seconds_against_rows():
    times = CallTimes(initial_s=0.2, weight=0.1)
    for _ in range(5):
        times.observe(4, 0.05)
    assert times.expected(16) == pytest.approx(times.mean_s)  # one size seen: no line yet, the mean
    for rows in [1, 8, 16, 2, 12, 4] * 20:
        times.observe(rows, 0.04 + 0.005 * rows)
    assert times.expected(1) == pytest.approx(0.045, abs=1e-6)
    assert times.expected(16) == pytest.approx(0.12, abs=1e-6)
    assert times.expected(16) > times.mean_s > times.expected(1)


def test_call_times_refuse_a_weight_outside_0_to_1():
    with pytest.raises(ValueError, match="weight"):
        CallTimes(initial_s=0.2, weight=0.0)


def _late_in_a_burst(expect: Callable[[CallTimes, int], float]) -> float | None:
    """Calls of 20 ms + 10 ms a row, at most 8 rows. First small calls (one first chunk each) teach the estimate,
    then a burst keeps 8 first chunks waiting at every call; one playing stream's next chunk is queued as the burst
    begins with 0.5 s of audio left. How late its call ends after its listener ran dry (None: on time). `expect`:
    the seconds the policy is told a call of that many rows takes."""
    policy = SchedulePolicy(max_rows=8)  # the served margin, 3 expected calls
    times = CallTimes(initial_s=0.2, weight=0.2)
    now = 0.0
    for _ in range(30):
        chosen = policy.next_call([PendingJob(queued_at=now, first_chunk=True)], now, expect(times, 1))
        times.observe(len(chosen), 0.02 + 0.01 * len(chosen))
        now += 0.03
    later = PendingJob(queued_at=now, first_chunk=False, runs_dry_at=now + 0.5)
    for call in range(20):
        waiting = [PendingJob(queued_at=now - 0.01 * i, first_chunk=True) for i in range(8)]
        jobs = [*waiting, later]
        chosen = policy.next_call(jobs, now, expect(times, policy.call_rows(len(jobs))))
        took = 0.02 + 0.01 * len(chosen)
        times.observe(len(chosen), took)
        now += took
        if len(jobs) - 1 in chosen:
            return max(0.0, now - later.runs_dry_at) or None
    raise AssertionError("the later chunk never ran")


def test_in_a_burst_of_first_chunks_the_estimate_by_rows_keeps_a_later_chunk_on_time():
    """The running mean of all calls, taught by small calls, expects 30 ms a call while the burst's full calls take
    100 ms: the 3-call margin (90 ms) lets the later chunk in too late. By rows the margin is three full calls."""
    assert _late_in_a_burst(lambda times, rows: times.mean_s) is not None
    assert _late_in_a_burst(CallTimes.expected) is None
