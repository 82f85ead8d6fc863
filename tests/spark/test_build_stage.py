"""The ``spark-weights`` build stage: never fetches by default, needs the licence accepted for a hub download,
prints the licence, fetches only the files the engine reads (from a local fake hub directory, never the network),
verifies them, and the engine loads the result."""

from __future__ import annotations

import fnmatch
import shutil
from pathlib import Path

import pytest

from cosyvoice_build import spark_weights
from cosyvoice_build.cli import build_parser, settings_from_args
from cosyvoice_build.pipeline import StageError, run_stages
from cosyvoice_build.settings import BuildSettings
from cosyvoice_build.stages import STAGES
from spark_tts import layout
from tests.spark.conftest import MICRO_DIR, needs_parity_data


@pytest.fixture()
def fake_hub(tmp_path: Path) -> Path:
    """A hub repository on disk: the micro model in the released layout plus files the engine never reads."""
    hub = tmp_path / "hub" / "SparkAudio" / "Spark-TTS-0.5B"
    shutil.copytree(MICRO_DIR, hub)
    (hub / "README.md").write_text("model card")
    (hub / "src").mkdir()
    (hub / "src" / "figure.png").write_bytes(b"\x89PNG")
    return hub


def hub_download(hub_root: Path, calls: list):
    """Serves repositories from ``hub_root/<repo id>`` with the hub's allow-pattern (fnmatch) semantics."""

    def download(repo_id: str, revision: str | None, local_dir: Path, allow_patterns: list[str]) -> None:
        calls.append((repo_id, revision))
        source = hub_root / repo_id
        if not source.is_dir():
            raise StageError(f"download of {repo_id} failed: 404")
        for path in source.rglob("*"):
            name = path.relative_to(source).as_posix()
            if path.is_file() and any(fnmatch.fnmatch(name, p) for p in allow_patterns):
                (local_dir / name).parent.mkdir(parents=True, exist_ok=True)
                shutil.copy(path, local_dir / name)

    return download


def test_default_settings_never_fetch(tmp_path: Path) -> None:
    calls: list = []
    settings = BuildSettings(work_dir=tmp_path)
    assert settings.spark_source == "off"
    assert spark_weights.fetch_spark_weights(settings, hubs={"hf": hub_download(tmp_path, calls)}) is None
    assert calls == [] and not (tmp_path / "Spark-TTS-0.5B").exists()
    args = build_parser().parse_args(["--work-dir", str(tmp_path)])
    assert settings_from_args(args).spark_source == "off"


def test_hub_download_needs_the_licence_accepted(tmp_path: Path, fake_hub: Path) -> None:
    calls: list = []
    settings = BuildSettings(work_dir=tmp_path, spark_source="hf")
    with pytest.raises(StageError, match="CC-BY-NC-SA-4.0.*--accept-spark-license"):
        spark_weights.fetch_spark_weights(settings, hubs={"hf": hub_download(fake_hub.parents[1], calls)})
    assert calls == []


@needs_parity_data
def test_download_prints_the_licence_and_fetches_only_what_the_engine_reads(tmp_path: Path, fake_hub: Path) -> None:
    calls: list = []
    printed: list[str] = []
    settings = BuildSettings(work_dir=tmp_path / "work", spark_source="hf", spark_revision="r1",
                             accept_spark_license=True)
    target = spark_weights.fetch_spark_weights(settings, hubs={"hf": hub_download(fake_hub.parents[1], calls)},
                                               say=printed.append)
    assert target == tmp_path / "work" / "Spark-TTS-0.5B"
    assert calls == [("SparkAudio/Spark-TTS-0.5B", "r1")]
    assert len(printed) == 1 and "CC-BY-NC-SA-4.0" in printed[0] and "non-commercial" in printed[0]
    fetched = {p.relative_to(target).as_posix() for p in target.rglob("*") if p.is_file()}
    assert set(layout.MODEL_FILES) <= fetched
    assert "README.md" not in fetched and "src/figure.png" not in fetched and "harness_config.json" not in fetched
    from spark_tts.engine import SparkTTS

    assert SparkTTS.load(target).sample_rate == 16000


@needs_parity_data
def test_truncated_download_names_the_file(tmp_path: Path, fake_hub: Path) -> None:
    weights = fake_hub / layout.BICODEC_WEIGHTS_FILE
    weights.write_bytes(weights.read_bytes()[:1000])
    (fake_hub / layout.LLM_CONFIG_FILE).write_text("{")
    settings = BuildSettings(work_dir=tmp_path / "work", spark_source="hf", accept_spark_license=True)
    with pytest.raises(StageError, match="BiCodec/model.safetensors: unreadable.*LLM/config.json: unreadable"):
        spark_weights.fetch_spark_weights(settings, hubs={"hf": hub_download(fake_hub.parents[1], [])},
                                          say=lambda _: None)


def test_local_source_needs_a_directory_and_is_verified(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="spark-model-dir"):
        BuildSettings(work_dir=tmp_path, spark_source="local")
    settings = BuildSettings(work_dir=tmp_path, spark_source="local", spark_model_dir=tmp_path / "missing")
    with pytest.raises(StageError, match="does not exist"):
        spark_weights.fetch_spark_weights(settings, say=lambda _: None)


@needs_parity_data
def test_the_stage_runs_only_when_asked(tmp_path: Path, fake_hub: Path, monkeypatch) -> None:
    calls: list = []
    monkeypatch.setitem(spark_weights.HUBS, "hf", hub_download(fake_hub.parents[1], calls))
    stage = [s for s in STAGES if s.name == "spark-weights"]
    off = BuildSettings(work_dir=tmp_path / "a")
    [result] = run_stages(stage, off, None, None, False)
    assert result.outcome == "done" and calls == []
    args = build_parser().parse_args(["--work-dir", str(tmp_path / "b"), "--spark-source", "hf",
                                      "--accept-spark-license"])
    [result] = run_stages(stage, settings_from_args(args), None, None, False)
    assert result.outcome == "done", result.detail
    assert len(calls) == 1 and (tmp_path / "b" / "Spark-TTS-0.5B" / layout.LLM_WEIGHTS_FILE).is_file()


def test_spark_trtllm_commands_build_the_hf_llm_with_spark_shapes(tmp_path: Path) -> None:
    convert, build = spark_weights.spark_trtllm_commands(tmp_path / "Spark-TTS-0.5B", tmp_path / "work")
    assert convert[convert.index("--model_dir") + 1] == str(tmp_path / "Spark-TTS-0.5B" / "LLM")
    assert convert[convert.index("--dtype") + 1] == "bfloat16"
    assert build[build.index("--checkpoint_dir") + 1] == convert[convert.index("--output_dir") + 1]
    shapes = {flag: int(build[build.index(flag) + 1]) for flag in ("--max_input_len", "--max_seq_len", "--max_batch_size")}
    assert shapes == {"--max_input_len": 1536, "--max_seq_len": 1536 + 512, "--max_batch_size": 16}
