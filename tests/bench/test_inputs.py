import json
import sys
import types
from pathlib import Path

import numpy as np
import pytest

from tests.bench.wavfiles import write_wav
from ttsbench.inputs import (
    BenchItem,
    InputError,
    default_requests,
    load_manifest,
    load_seed_tts,
    parse_manifest_line,
    prepare_requests,
)


def test_jsonl_line_resolves_relative_audio_and_defaults_id(tmp_path):
    line = json.dumps({"prompt_audio": "a/b.wav", "prompt_text": "hi", "target_text": "say this"})
    item = parse_manifest_line(line, tmp_path, default_id="m-1")
    assert item == BenchItem("m-1", tmp_path / "a" / "b.wav", "hi", "say this")
    absolute = json.dumps({"id": "x", "prompt_audio": "/abs/p.flac", "prompt_text": "p", "target_text": "t"})
    assert parse_manifest_line(absolute, tmp_path, "d").prompt_audio == Path("/abs/p.flac")


def test_upstream_pipe_line(tmp_path):
    item = parse_manifest_line("utt1|提示文本|wavs/u1.wav|目标文本", tmp_path, "d")
    assert item == BenchItem("utt1", tmp_path / "wavs" / "u1.wav", "提示文本", "目标文本")


@pytest.mark.parametrize("line", ["", "   ", "# a comment"])
def test_blank_and_comment_lines_are_skipped(tmp_path, line):
    assert parse_manifest_line(line, tmp_path, "d") is None


def test_manifest_errors_name_the_line(tmp_path):
    manifest = tmp_path / "set.jsonl"
    good = json.dumps({"prompt_audio": "a.wav", "prompt_text": "p", "target_text": "t"})
    manifest.write_text(good + "\n" + json.dumps({"prompt_audio": "a.wav", "prompt_text": "p"}) + "\n")
    with pytest.raises(InputError, match=r"set.jsonl:2: missing or empty field\(s\): target_text"):
        load_manifest(manifest)
    manifest.write_text("# only a comment\n")
    with pytest.raises(InputError, match="no entries"):
        load_manifest(manifest)
    manifest.write_text("a|b|c\n")
    with pytest.raises(InputError, match="set.jsonl:1"):
        load_manifest(manifest)


def test_load_manifest_and_prepare(tmp_path):
    write_wav(tmp_path / "v.wav", 1.5, rate=24_000, channels=2)
    rows = [
        {"id": "one", "prompt_audio": "v.wav", "prompt_text": "prompt", "target_text": "first"},
        {"prompt_audio": "v.wav", "prompt_text": "prompt", "target_text": "second"},
        {"prompt_audio": "v.wav", "prompt_text": "other transcript", "target_text": "third"},
    ]
    manifest = tmp_path / "m.jsonl"
    manifest.write_text("\n".join(json.dumps(r, ensure_ascii=False) for r in rows) + "\n")
    requests = prepare_requests(load_manifest(manifest))
    assert [r.id for r in requests] == ["one", "m-2", "m-3"]
    assert [r.target_text for r in requests] == ["first", "second", "third"]
    wav = requests[0].voice.samples
    assert wav.dtype == np.float32 and wav.ndim == 1
    assert abs(wav.size - 1.5 * 16_000) <= 160  # resampled to 16 kHz mono
    assert requests[0].voice is requests[1].voice  # same (file, transcript): one voice
    assert requests[2].voice.id != requests[0].voice.id  # the transcript is part of the identity
    assert requests[2].voice.samples is wav  # the file was decoded once


def test_prepare_reports_undecodable_audio(tmp_path):
    (tmp_path / "bad.wav").write_bytes(b"not audio at all")
    with pytest.raises(InputError, match="item x: cannot decode"):
        prepare_requests([BenchItem("x", tmp_path / "bad.wav", "p", "t")])


def test_default_requests_round_robin(voices_dir):
    texts = ["t0", "t1", "t2", "t3", "t4"]
    requests = default_requests(voices_dir, texts)
    assert [r.target_text for r in requests] == texts
    assert [r.voice.name for r in requests] == ["anna", "bo", "anna", "bo", "anna"]
    assert requests[1].voice.transcript == "博说话。"
    assert len({r.id for r in requests}) == len(texts)


def test_default_requests_without_voices(tmp_path):
    with pytest.raises(InputError, match="no reference voices"):
        default_requests(tmp_path, ["x"])


def test_seed_tts_without_datasets_says_what_to_do(monkeypatch):
    monkeypatch.setitem(sys.modules, "datasets", None)  # import fails
    with pytest.raises(InputError, match="needs the 'datasets' package"):
        load_seed_tts("yuekai/seed_tts_cosy2", "wenetspeech4tts")


def _fake_datasets(rows, fail: bool = False) -> types.ModuleType:
    class FakeDataset(list):
        def cast_column(self, name, feature):
            assert name == "prompt_audio" and feature.decode is False
            return self

    module = types.ModuleType("datasets")
    module.Audio = lambda decode=True: types.SimpleNamespace(decode=decode)

    def load_dataset(source, split):
        if fail:
            raise FileNotFoundError(f"Couldn't find '{source}' on the Hub")
        return FakeDataset(rows)

    module.load_dataset = load_dataset
    return module


def test_seed_tts_rows_become_items_with_audio_files(monkeypatch, tmp_path):
    audio = write_wav(tmp_path / "src.wav", 0.5).read_bytes()
    rows = [{"id": "u1", "prompt_audio": {"bytes": audio, "path": "u1.wav"}, "prompt_text": "p", "target_text": "t"}]
    monkeypatch.setitem(sys.modules, "datasets", _fake_datasets(rows))
    (item,) = load_seed_tts("some/dir", "test_zh", audio_dir=tmp_path)
    assert (item.id, item.prompt_text, item.target_text) == ("u1", "p", "t")
    assert item.prompt_audio.read_bytes() == audio and item.prompt_audio.suffix == ".wav"


def test_seed_tts_missing_copy_is_a_clear_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "datasets", _fake_datasets([], fail=True))
    with pytest.raises(InputError, match="cannot be downloaded on this machine"):
        load_seed_tts("yuekai/seed_tts_cosy2", "wenetspeech4tts")
