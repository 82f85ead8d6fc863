"""The token2wav service's call order (`token2wav_policy.SchedulePolicy`), pure: starving streams, then first
chunks, then earliest deadline; ties keep their arrival order; a call holds at most `max_rows` jobs."""

from __future__ import annotations

import pytest

from speech_serving.token2wav_policy import PendingJob, SchedulePolicy, Urgency

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


def test_a_stream_is_starving_only_when_its_audio_runs_out_before_the_call_could_end():
    policy = SchedulePolicy()
    job = PendingJob(queued_at=99.0, first_chunk=False, runs_dry_at=NOW + 0.5)
    assert policy.urgency(job, NOW, call_s=0.4) == Urgency.SCHEDULED
    assert policy.urgency(job, NOW, call_s=0.6) == Urgency.STARVING
    assert policy.urgency(job, NOW + 0.2, call_s=0.4) == Urgency.STARVING  # later, the same call would be too late


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
