import json

import pytest

from ttsbench.report import (
    LevelResult,
    RateResult,
    RequestRecord,
    format_table,
    level_table,
    rate_table,
    render_report,
    report_document,
    summarize_level,
    summarize_rate,
)


def _level(mode="triton/streaming", concurrency=2):
    records = (
        RequestRecord("a", (0.10, 0.30, 0.50), total=1.0, audio_seconds=2.0),
        RequestRecord("b", (0.20,), total=0.6, audio_seconds=1.0),
        RequestRecord("c", (0.05,), total=0.2, audio_seconds=0.0, error="HTTP 500: boom"),
    )
    return LevelResult(mode, concurrency, wall_seconds=1.5, records=records)


def test_record_derived_metrics():
    r = RequestRecord("a", (0.1, 0.35, 0.5), total=1.0, audio_seconds=4.0)
    assert r.first_chunk == 0.1
    assert r.second_chunk == pytest.approx(0.25)  # gap between first and second piece
    assert r.rtf == 0.25
    single = RequestRecord("b", (0.4,), total=0.4, audio_seconds=0.0)
    assert single.second_chunk is None and single.rtf is None
    assert RequestRecord("c", (), total=0.1, audio_seconds=0.0).first_chunk is None


def test_summary_excludes_failures_and_aggregates():
    s = summarize_level(_level())
    assert (s.requests, s.errors) == (3, 1)
    assert s.audio_seconds == 3.0
    assert s.first_chunk.count == 2 and s.first_chunk.avg == pytest.approx(0.15)
    assert s.second_chunk.count == 1 and s.second_chunk.p50 == pytest.approx(0.2)
    assert s.total.p50 == pytest.approx(0.8)
    assert s.rtf.avg == pytest.approx((0.5 + 0.6) / 2)
    assert s.aggregate_rtf == pytest.approx(1.5 / 3.0)
    assert s.audio_seconds_per_second == pytest.approx(2.0)


def test_summary_of_all_failed_level():
    level = LevelResult("m", 1, 0.5, (RequestRecord("x", (), 0.5, 0.0, error="timeout"),))
    s = summarize_level(level)
    assert s.errors == 1 and s.total is None and s.aggregate_rtf is None and s.audio_seconds_per_second == 0.0
    assert "-" in level_table([s]).splitlines()[-1]


def test_format_table_aligns_and_spans_groups():
    text = format_table(["a", "bb"], [["1", "22222"], ["333", "4"]], groups=[("a very long title", 2)])
    lines = text.splitlines()
    assert lines[0].strip() == "a very long title"
    body = lines[1:]
    assert len({len(line) for line in body}) == 1  # header, rule, rows: one width
    assert lines[-1].endswith("    4") and lines[-2].endswith("22222")
    with pytest.raises(ValueError):
        format_table(["a", "b"], [["1", "2"]], groups=[("x", 1)])


def test_level_table_has_a_row_per_level_with_all_columns():
    summaries = [summarize_level(_level(concurrency=c)) for c in (1, 4)]
    lines = level_table(summaries).splitlines()
    header = lines[1].split()
    assert header[:3] == ["conc", "ok", "err"]
    assert header.count("p99") == 4 and header[-3:] == ["RTF", "audio", "s/s"] and "stalled" in header
    rows = [line.split() for line in lines[3:]]
    assert [row[0] for row in rows] == ["1", "4"]
    assert rows[0][1:3] == ["2", "1"]
    assert rows[0][3] == "150.0"  # first chunk avg, ms
    assert all(len(row) == len(rows[0]) == 3 + 4 * 5 + 5 + 2 for row in rows)


def test_render_report_one_table_per_mode():
    text = render_report([summarize_level(_level("triton/offline")), summarize_level(_level("triton/streaming"))])
    assert text.count("== triton/offline ==") == 1 and text.count("== triton/streaming ==") == 1


def test_json_document_shape():
    summary = summarize_level(_level())
    doc = json.loads(json.dumps(report_document([summary], {"target": "triton"})))
    assert doc["schema_version"] == 3 and doc["run"] == {"target": "triton"}
    assert doc["rates"] == [] and doc["rate_search"] is None
    (level,) = doc["levels"]
    assert level["mode"] == "triton/streaming" and level["concurrency"] == 2
    assert level["requests"] == 3 and level["errors"] == 1
    assert set(level["first_chunk"]) == {"count", "avg", "p50", "p90", "p95", "p99"}
    assert level["records"][2]["error"] == "HTTP 500: boom"
    assert level["records"][0]["chunk_offsets"] == [0.1, 0.3, 0.5]
    assert "records" not in report_document([summary], {}, with_records=False)["levels"][0]


def test_streaming_levels_report_playback_stalls_offline_levels_do_not():
    records = (
        # 0.2 s of audio at 0.1, the next at 0.5: a 0.2 s stall
        RequestRecord("late", (0.1, 0.5), total=0.6, audio_seconds=0.4, chunk_seconds=(0.2, 0.2)),
        RequestRecord("smooth", (0.1, 0.2), total=0.3, audio_seconds=2.0, chunk_seconds=(1.0, 1.0)),
        RequestRecord("failed", (0.1, 2.0), total=2.0, audio_seconds=0.0, error="timeout", chunk_seconds=(0.1, 0.1)),
        RequestRecord("unknown", (0.1, 9.0), total=9.0, audio_seconds=1.0),  # no piece durations: not replayed
    )
    streaming = summarize_level(LevelResult("gateway/streaming-sse", 4, 9.0, records, window=(10.0, 19.5)))
    assert (streaming.stalls.streams, streaming.stalls.stalled, streaming.stalls.events) == (2, 1, 1)
    assert streaming.stalls.total == pytest.approx(0.2) and streaming.stalls.max == pytest.approx(0.2)
    assert streaming.window == (10.0, 19.5)
    row = level_table([streaming]).splitlines()[-1].split()
    assert row[3 + 4 * 5 : 3 + 4 * 5 + 5] == ["1/2", "200.0", "100.0", "180.0", "200.0"]
    offline = summarize_level(LevelResult("triton/offline", 4, 9.0, records))
    assert offline.stalls is None
    assert level_table([offline]).splitlines()[-1].split()[3 + 4 * 5 : 3 + 4 * 5 + 5] == ["-"] * 5
    doc = report_document([streaming, offline], {})
    assert doc["levels"][0]["stalls"]["stalled_share"] == 0.5 and doc["levels"][1]["stalls"] is None
    assert doc["levels"][0]["window"] == [10.0, 19.5]
    assert doc["levels"][0]["records"][0]["chunk_seconds"] == [0.2, 0.2]


def _rate(rate, first_chunks, *, errors=0, stall_first=False):
    """A rate whose streams have these first chunks (s) and two 0.5 s chunks; the first may stall, some fail."""
    records = []
    for i, first in enumerate(first_chunks):
        gap = 1.0 if stall_first and i == 0 else 0.2
        records.append(RequestRecord(f"s{i}", (first, first + gap), first + gap, 1.0, chunk_seconds=(0.5, 0.5)))
    records += [RequestRecord(f"e{i}", (), 0.3, 0.0, error="timeout") for i in range(errors)]
    return RateResult("triton/streaming", rate, 0, arrival_seconds=4.0, wall_seconds=5.0, records=tuple(records),
                      send_lags=(0.001, 0.002, 0.004), max_in_flight=3)  # fmt: skip


def test_rate_summary_counts_achieved_rate_stalls_and_errors():
    s = summarize_rate(_rate(2.0, [0.1, 0.2, 0.3, 0.4], errors=2, stall_first=True))
    assert (s.requests, s.errors, s.max_in_flight) == (6, 2, 3)
    assert s.achieved_rate == pytest.approx(6 / 4.0)  # every request sent counts, failed ones too
    assert s.first_chunk.count == 4 and s.first_chunk.p50 == pytest.approx(0.25)
    assert (s.stalls.streams, s.stalls.stalled) == (4, 1)
    assert s.audio_seconds == 4.0 and s.audio_seconds_per_second == pytest.approx(4.0 / 5.0)
    assert s.send_lag.p99 == pytest.approx(0.00396)
    doc = json.loads(json.dumps(report_document([], {}, rates=[s], rate_search={"sustained_rate": 2.0})))
    (rate,) = doc["rates"]
    assert rate["rate"] == 2.0 and rate["achieved_rate"] == 1.5 and rate["stalls"]["stalled_share"] == 0.25
    assert set(rate["first_chunk"]) == {"count", "avg", "p50", "p90", "p95", "p99"} and len(rate["records"]) == 6
    assert doc["rate_search"] == {"sustained_rate": 2.0} and doc["levels"] == []


def test_rate_table_has_a_row_per_rate_with_the_percentiles_a_listener_meets():
    summaries = [summarize_rate(_rate(0.5, [0.1, 0.2])), summarize_rate(_rate(8, [0.3, 0.9], errors=1,
                                                                              stall_first=True))]  # fmt: skip
    lines = rate_table(summaries, verdicts=[True, False]).splitlines()
    assert "first chunk (ms)" in lines[0] and "stalled streams" in lines[0]
    header = lines[1].split()
    assert header == ["rate", "achieved", "ok", "err", "in", "flight", "p50", "p90", "p95", "p99", "stalled",
                      "share", "audio", "s/s", "send", "lag", "p99", "(ms)", "meets"]  # fmt: skip
    rows = [line.split() for line in lines[3:]]
    assert rows[0] == ["0.5", "0.50", "2", "0", "3", "150.0", "190.0", "195.0", "199.0", "0/2", "0%", "0.40", "4.0",
                       "yes"]  # fmt: skip
    assert rows[1][:5] == ["8", "0.75", "2", "1", "3"] and rows[1][9:11] == ["1/2", "50%"] and rows[1][-1] == "no"
    assert "meets" not in rate_table(summaries)
    failed = summarize_rate(_rate(1.0, [], errors=2))
    assert rate_table([failed]).splitlines()[-1].split()[5:11] == ["-"] * 6
    with pytest.raises(ValueError):
        rate_table(summaries, verdicts=[True])
