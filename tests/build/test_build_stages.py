"""Stage runner and the download stage: skip-if-done, re-run on changed inputs, clear errors, fake hubs."""

from __future__ import annotations

import importlib.util
import json
import shutil
import sys
from pathlib import Path

import pytest

from cosyvoice_build import cli, weights
from cosyvoice_build.pipeline import Stage, StageError, StageInputs, run_stages, select
from cosyvoice_build.settings import BuildSettings
from cosyvoice_build.stages import STAGES


def counting_stage(name: str, source: Path, output: Path, runs: list[str], fail: bool = False) -> Stage:
    def run(settings: BuildSettings) -> None:
        runs.append(name)
        if fail:
            raise StageError(f"{name} cannot run here")
        output.write_text(source.read_text().upper())

    return Stage(name, f"stage {name}", lambda s: StageInputs(paths=[source], values={"v": 1}), lambda s: [output], run)


def test_completed_stage_is_skipped_until_its_input_changes(tmp_path: Path) -> None:
    settings = BuildSettings(work_dir=tmp_path / "work")
    source, output, runs = tmp_path / "in.txt", tmp_path / "out.txt", []
    source.write_text("a")
    stages = [counting_stage("one", source, output, runs)]
    assert [r.outcome for r in run_stages(stages, settings)] == ["done"]
    assert [r.outcome for r in run_stages(stages, settings)] == ["skipped"]
    source.write_text("b")
    assert [r.outcome for r in run_stages(stages, settings)] == ["done"]
    assert output.read_text() == "B"
    output.unlink()  # an output that disappeared is rebuilt
    assert [r.outcome for r in run_stages(stages, settings)] == ["done"]
    assert [r.outcome for r in run_stages(stages, settings, force=True)] == ["done"]
    assert runs == ["one"] * 4


def test_failed_stage_does_not_stop_the_others_and_is_retried(tmp_path: Path) -> None:
    settings = BuildSettings(work_dir=tmp_path / "work")
    source, runs = tmp_path / "in.txt", []
    source.write_text("a")
    stages = [
        counting_stage("broken", source, tmp_path / "x.txt", runs, fail=True),
        counting_stage("fine", source, tmp_path / "y.txt", runs),
    ]
    results = run_stages(stages, settings)
    assert [(r.stage, r.outcome) for r in results] == [("broken", "failed"), ("fine", "done")]
    assert "broken cannot run here" in results[0].detail
    assert [r.outcome for r in run_stages(stages, settings)] == ["failed", "skipped"]
    assert runs == ["broken", "fine", "broken"]


def test_missing_input_is_named(tmp_path: Path) -> None:
    settings = BuildSettings(work_dir=tmp_path / "work")
    missing = tmp_path / "nowhere" / "llm.pt"
    stage = Stage("s", "d", lambda s: StageInputs(paths=[missing]), lambda s: [], lambda s: None)
    [result] = run_stages([stage], settings)
    assert result.outcome == "failed" and str(missing) in result.detail


def test_stage_selection() -> None:
    assert [s.name for s in STAGES] == ["download", "convert", "engine", "render", "smoke", "spark-weights",
                                        "cosyvoice3-weights"]
    assert [s.name for s in select(STAGES, "convert", "render")] == ["convert", "engine", "render"]
    with pytest.raises(ValueError, match="comes after"):
        select(STAGES, "render", "convert")


# download ----------------------------------------------------------------------------------------------------
def test_local_directory_is_verified(micro_model_dir: Path) -> None:
    weights.verify_model_dir(micro_model_dir)


@pytest.mark.parametrize(
    ("damage", "message"),
    [
        (lambda d: (d / "hift.pt").unlink(), "hift.pt: missing"),
        (lambda d: (d / "flow.pt").write_bytes(b"\0" * 64), "flow.pt: not a torch.save archive"),
        (lambda d: (d / "campplus.onnx").write_bytes(b""), "campplus.onnx: empty"),
        (lambda d: (d / "CosyVoice-BlankEN" / "vocab.json").write_text("{"), "vocab.json: invalid JSON"),
        (lambda d: (d / "CosyVoice-BlankEN" / "merges.txt").unlink(), "merges.txt: missing"),
    ],
)
def test_damaged_model_directory_names_the_file(micro_model_dir: Path, tmp_path: Path, damage, message: str) -> None:
    model = tmp_path / "model"
    shutil.copytree(micro_model_dir, model)
    damage(model)
    with pytest.raises(StageError, match=message):
        weights.verify_model_dir(model)


def test_hub_download_goes_through_the_injected_function(micro_model_dir: Path, tmp_path: Path) -> None:
    calls = []

    def fake_hub(repo_id: str, revision: str | None, local_dir: Path, allow_patterns: list[str]) -> None:
        calls.append((repo_id, revision, allow_patterns))
        shutil.copytree(micro_model_dir, local_dir, dirs_exist_ok=True)

    settings = BuildSettings(work_dir=tmp_path, model_source="hf", model_revision="abc123")
    assert weights.fetch_weights(settings, hubs={"hf": fake_hub}) == tmp_path / "CosyVoice2-0.5B"
    [(repo_id, revision, patterns)] = calls
    assert (repo_id, revision) == ("FunAudioLLM/CosyVoice2-0.5B", "abc123")
    assert set(weights.REQUIRED_FILES) <= set(patterns) and "flow.cache.pt" not in patterns


def test_incomplete_hub_download_is_reported(tmp_path: Path) -> None:
    def empty_hub(repo_id, revision, local_dir, allow_patterns) -> None:
        (local_dir / "llm.pt").write_bytes(b"")

    settings = BuildSettings(work_dir=tmp_path, model_source="modelscope")
    with pytest.raises(StageError, match="llm.pt: empty"):
        weights.fetch_weights(settings, hubs={"modelscope": empty_hub})


def test_a_failed_first_download_leaves_no_empty_weights_directory(tmp_path: Path) -> None:
    def offline_hub(repo_id, revision, local_dir, allow_patterns) -> None:
        (local_dir / ".cache" / "huggingface").mkdir(parents=True)  # what the hub client creates before failing
        raise StageError("download of FunAudioLLM/CosyVoice2-0.5B from the Hugging Face hub failed: offline")

    settings = BuildSettings(work_dir=tmp_path, model_source="hf")
    with pytest.raises(StageError, match="offline"):
        weights.fetch_weights(settings, hubs={"hf": offline_hub})
    assert not settings.weights_dir.exists()


def test_a_failed_download_keeps_partial_files_and_existing_directories(tmp_path: Path) -> None:
    def interrupted_hub(repo_id, revision, local_dir, allow_patterns) -> None:
        (local_dir / "llm.pt").write_bytes(b"partial")
        raise StageError("connection reset")

    settings = BuildSettings(work_dir=tmp_path, model_source="hf")
    with pytest.raises(StageError, match="connection reset"):
        weights.fetch_weights(settings, hubs={"hf": interrupted_hub})
    assert (settings.weights_dir / "llm.pt").read_bytes() == b"partial"  # the next try resumes from it
    mine = BuildSettings(work_dir=tmp_path / "mine", model_source="hf")
    mine.weights_dir.mkdir(parents=True)  # made by the user before the download

    def failing_hub(repo_id, revision, local_dir, allow_patterns) -> None:
        raise StageError("offline")

    with pytest.raises(StageError, match="offline"):
        weights.fetch_weights(mine, hubs={"hf": failing_hub})
    assert mine.weights_dir.is_dir()  # only what the download created is removed


def test_modelscope_without_the_package_says_what_to_install(monkeypatch, tmp_path: Path) -> None:
    monkeypatch.setitem(sys.modules, "modelscope", None)  # import fails as when it is not installed
    with pytest.raises(StageError, match="pip install modelscope"):
        weights.modelscope_download("iic/CosyVoice2-0.5B", None, tmp_path, [])


# CLI end to end on the micro model ------------------------------------------------------------------------------
def test_cli_runs_torch_backend_stages_and_skips_them_the_second_time(micro_model_dir: Path, tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("COSYVOICE_LLM_BACKEND", "torch")  # settings from the environment, as compose passes them
    args = ["--work-dir", str(tmp_path), "--model-source", "local", "--model-dir", str(micro_model_dir), "--to", "engine"]
    assert cli.main(args) == 0
    markers = sorted(p.name for p in (tmp_path / ".build").glob("*.done.json"))
    assert markers == ["convert.done.json", "download.done.json", "engine.done.json"]
    assert not (tmp_path / "cosyvoice2_llm_hf").exists()  # the torch backend reads llm.pt directly
    assert cli.main(args) == 0
    log = (tmp_path / ".build" / "logs" / "build.log").read_text()
    assert log.count("[download] up to date, skipped") == 1


@pytest.mark.skipif(importlib.util.find_spec("tensorrt_llm") is not None, reason="TensorRT-LLM is installed here")
def test_cli_trtllm_backend_converts_then_stops_at_the_engine_without_tensorrt_llm(micro_model_dir: Path, tmp_path: Path) -> None:
    args = ["--work-dir", str(tmp_path), "--model-source", "local", "--model-dir", str(micro_model_dir), "--to", "engine"]
    assert cli.main(args) == 1
    layout = json.loads((tmp_path / "cosyvoice2_llm_hf" / "cosyvoice2_llm.json").read_text())
    assert layout["speech_offset"] == 512
    log = (tmp_path / ".build" / "logs" / "build.log").read_text()
    assert "tensorrt_llm is not importable" in log and "tritonserver:25.06-trtllm-python-py3" in log


def test_cli_rejects_a_bad_environment_value(monkeypatch, capsys) -> None:
    monkeypatch.setenv("COSYVOICE_MODEL_SOURCE", "dropbox")
    with pytest.raises(SystemExit):
        cli.main([])
    assert "dropbox" in capsys.readouterr().err
