"""Render adapter and smoke test: audio checks, the adapter's contract, and one request through a real tritonserver.

The CosyVoice2 repository is rendered by triton_repo's tool; here the smoke test runs against the pipeline
contract's stand-in model (tests/gateway/standin_model), which exercises everything up to the model itself.
"""

from __future__ import annotations

import sys
import types
from pathlib import Path

import numpy as np
import pytest

from cosyvoice_build import smoke, triton_render
from cosyvoice_build.pipeline import StageError
from cosyvoice_build.settings import BuildSettings, TrtllmOptions
import pipeline_contract as contract


def test_check_audio_accepts_sound_and_rejects_empty_nonfinite_and_silent() -> None:
    tone = np.sin(np.linspace(0, 100, 4800)).astype(np.float32)
    smoke.check_audio(tone)
    with pytest.raises(StageError, match="no audio"):
        smoke.check_audio(np.zeros(0, np.float32))
    with pytest.raises(StageError, match="NaN"):
        smoke.check_audio(np.where(np.arange(4800) == 7, np.nan, tone).astype(np.float32))
    with pytest.raises(StageError, match="silent"):
        smoke.check_audio(np.full(4800, 1e-6, np.float32))


def test_synthetic_reference_is_a_valid_prompt() -> None:
    reference = smoke.synthetic_reference(2.0)
    assert reference.dtype == np.float32 and reference.size == 2 * contract.REFERENCE_SAMPLE_RATE
    assert np.all(np.isfinite(reference)) and 0.1 < np.abs(reference).max() <= 1.0
    np.testing.assert_array_equal(reference, smoke.synthetic_reference(2.0))  # deterministic


def fake_render_module(monkeypatch: pytest.MonkeyPatch, render) -> None:
    module = types.ModuleType(triton_render.RENDER_MODULE)
    if render is not None:
        setattr(module, triton_render.RENDER_FUNCTION, render)
    monkeypatch.setitem(sys.modules, triton_render.RENDER_MODULE, module)


def test_render_tool_missing_stops_the_stage(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setitem(sys.modules, triton_render.RENDER_MODULE, None)  # import fails
    with pytest.raises(StageError, match="render tool missing"):
        triton_render.render_triton_repository(BuildSettings(work_dir=tmp_path))
    fake_render_module(monkeypatch, None)
    with pytest.raises(StageError, match="render tool missing"):
        triton_render.render_triton_repository(BuildSettings(work_dir=tmp_path))


def test_render_adapter_passes_the_build_outputs(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    calls = []

    def render_repository(output_dir, model_dir, llm_backend="pytorch", llm_dir=None, engine_dir=None, layout="single", **options):
        calls.append(dict(output_dir=output_dir, model_dir=model_dir, llm_backend=llm_backend, llm_dir=llm_dir, engine_dir=engine_dir, layout=layout, **options))

    fake_render_module(monkeypatch, render_repository)
    trt = TrtllmOptions(max_batch_size=8, max_seq_len=2048, max_input_len=1024)
    settings = BuildSettings(work_dir=tmp_path, model_source="local", model_dir=tmp_path / "weights", trtllm=trt)
    assert triton_render.render_triton_repository(settings) == tmp_path / "triton_repo" / "trtllm_single"
    torch_settings = BuildSettings(work_dir=tmp_path, llm_backend="torch", triton_device="cuda", triton_dtype="bf16")
    triton_render.render_triton_repository(torch_settings)
    trt_call, torch_call = calls
    assert trt_call["model_dir"] == tmp_path / "weights" and trt_call["llm_backend"] == "trtllm"
    assert trt_call["engine_dir"] == settings.engine_dir and trt_call["llm_dir"] == settings.hf_llm_dir
    assert (trt_call["max_batch"], trt_call["max_seq_len"]) == (8, 2048)  # the shapes the engine was built for
    assert "device" not in trt_call  # left to the render tool's default
    assert torch_call["engine_dir"] is None and torch_call["llm_dir"] is None
    assert (torch_call["device"], torch_call["dtype"]) == ("cuda", "bf16")
    assert torch_call["output_dir"] == tmp_path / "triton_repo" / "torch_single"


def test_render_tool_refusal_is_a_stage_error(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    def render_repository(**arguments):
        raise ValueError("cannot render the Triton repository: --engine-dir holds no TensorRT-LLM engine")

    fake_render_module(monkeypatch, render_repository)
    with pytest.raises(StageError, match="holds no TensorRT-LLM engine"):
        triton_render.render_triton_repository(BuildSettings(work_dir=tmp_path))


def test_render_tool_with_another_signature_is_reported(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    fake_render_module(monkeypatch, lambda destination: None)
    with pytest.raises(StageError, match="does not take"):
        triton_render.render_triton_repository(BuildSettings(work_dir=tmp_path))


@pytest.fixture(scope="module")
def standin_settings(tmp_path_factory: pytest.TempPathFactory) -> BuildSettings:
    standin = pytest.importorskip("tests.gateway.standin_model.repository")
    root = tmp_path_factory.mktemp("smoke")
    settings = BuildSettings(work_dir=root, llm_backend="torch")
    standin.render_standin_repository(settings.triton_repo_dir, root / "markers", chunk_count=2, chunk_delay_ms=1)
    return settings


@pytest.mark.triton
def test_smoke_test_synthesizes_through_tritonserver(standin_settings: BuildSettings, caplog) -> None:
    caplog.set_level("INFO", logger="cosyvoice_build")
    smoke.run_smoke_test(standin_settings)
    assert "smoke test:" in caplog.text and "s of audio" in caplog.text


@pytest.mark.triton
def test_smoke_test_reports_a_failing_model(standin_settings: BuildSettings) -> None:
    from dataclasses import replace

    failing = replace(standin_settings, smoke_text="failstart please")  # the stand-in errors on this word
    with pytest.raises(StageError, match=f"request to {contract.OFFLINE_MODEL}"):
        smoke.run_smoke_test(failing)


@pytest.mark.triton
@pytest.mark.slow
def test_cli_builds_renders_and_smoke_tests_a_tiny_model_end_to_end(tmp_path: Path) -> None:
    """Every stage with the real render tool and tritonserver: tiny random model, PyTorch LLM backend, CPU."""
    pytest.importorskip("triton_repo.render")
    from cosyvoice2.testing import write_tiny_model
    from cosyvoice_build import cli

    model_dir = write_tiny_model(tmp_path / "tiny")
    args = ["--work-dir", str(tmp_path / "work"), "--model-source", "local", "--model-dir", str(model_dir)]
    args += ["--llm-backend", "torch", "--triton-device", "cpu", "--smoke-text", "Hi."]
    assert cli.main(args) == 0
    log = (tmp_path / "work" / ".build" / "logs" / "build.log").read_text()
    assert "[render] done" in log and "smoke test:" in log and "[smoke] done" in log
    assert (tmp_path / "work" / "triton_repo" / "torch_single" / contract.OFFLINE_MODEL / "config.pbtxt").is_file()
