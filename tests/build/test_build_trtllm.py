"""TensorRT-LLM command lines for several option sets, the missing-TRT-LLM stop, and engine metadata checks."""

from __future__ import annotations

import importlib.util
import json
import sys
from dataclasses import asdict, replace
from pathlib import Path

import pytest

from cosyvoice_build import trtllm, trtllm_convert
from cosyvoice_build.engine_meta import (
    BUILD_META_FILE,
    BuildMeta,
    EngineIncompatibleError,
    RuntimeInfo,
    check_engine_compatible,
    write_build_meta,
)
from cosyvoice_build.pipeline import StageError
from cosyvoice_build.settings import BuildSettings, TrtllmOptions

HF, CKPT, ENGINE = Path("/m/hf"), Path("/m/ckpt"), Path("/m/engine")


def flag_values(cmd: list[str]) -> dict[str, str | None]:
    """--flag value pairs (None for a bare switch)."""
    values: dict[str, str | None] = {}
    for i, token in enumerate(cmd):
        if token.startswith("--"):
            nxt = cmd[i + 1] if i + 1 < len(cmd) else None
            values[token] = None if nxt is None or nxt.startswith("--") else nxt
    return values


@pytest.mark.parametrize(
    ("options", "expected"),
    [
        (TrtllmOptions(), {"--dtype": "bfloat16", "--tp_size": "1"}),
        (TrtllmOptions(dtype="float16", tp_size=2), {"--dtype": "float16", "--tp_size": "2"}),
        (TrtllmOptions(weight_only="int8"), {"--use_weight_only": None, "--weight_only_precision": "int8"}),
        (TrtllmOptions(dtype="float16", weight_only="int4"), {"--dtype": "float16", "--weight_only_precision": "int4"}),
    ],
)
def test_convert_command(options: TrtllmOptions, expected: dict[str, str | None]) -> None:
    cmd = trtllm.convert_command(options, HF, CKPT, python="python3")
    assert cmd[:3] == ["python3", "-m", "cosyvoice_build.trtllm_convert"]
    flags = flag_values(cmd)
    assert flags["--model_dir"] == str(HF) and flags["--output_dir"] == str(CKPT)
    assert expected.items() <= flags.items()
    assert ("--use_weight_only" in flags) == (options.weight_only != "none")
    # The converter module parses exactly these flags.
    parsed = trtllm_convert.parse_args(cmd[3:])
    assert (parsed.dtype, parsed.tp_size, parsed.use_weight_only) == (options.dtype, options.tp_size, options.weight_only != "none")


@pytest.mark.parametrize(
    "options",
    [
        TrtllmOptions(),
        TrtllmOptions(dtype="float16", max_batch_size=64, max_num_tokens=16384, max_seq_len=8192, max_input_len=4096),
        TrtllmOptions(weight_only="int4", tp_size=2, max_batch_size=8),
    ],
)
def test_build_command(options: TrtllmOptions) -> None:
    cmd = trtllm.build_command(options, CKPT, ENGINE)
    assert cmd[0] == "trtllm-build"
    flags = flag_values(cmd)
    assert flags["--checkpoint_dir"] == str(CKPT) and flags["--output_dir"] == str(ENGINE)
    assert flags["--max_batch_size"] == str(options.max_batch_size)
    assert flags["--max_num_tokens"] == str(options.max_num_tokens)
    assert flags["--max_seq_len"] == str(options.max_seq_len)
    assert flags["--max_input_len"] == str(options.max_input_len)
    assert flags["--gemm_plugin"] == flags["--gpt_attention_plugin"] == options.dtype
    for switch in ("--paged_kv_cache", "--remove_input_padding", "--context_fmha"):
        assert flags[switch] == "enable"
    assert flags["--logits_dtype"] == "float32"  # the logits bias is added in fp32
    assert flags["--workers"] == str(options.tp_size)


def test_engine_directory_is_named_by_build_options_not_gpu() -> None:
    assert BuildSettings(work_dir=Path("/w")).engine_dir == Path("/w/trtllm/engine_bfloat16_tp1")
    settings = BuildSettings(work_dir=Path("/w"), trtllm=TrtllmOptions(dtype="float16", weight_only="int8", tp_size=2))
    assert settings.engine_dir.name == "engine_float16_woint8_tp2"
    assert settings.trtllm_checkpoint_dir.name == "checkpoint_float16_woint8_tp2"


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"tp_size": 3}, "power of two"),
        ({"max_input_len": 5000, "max_seq_len": 4096}, "max_input_len"),
        ({"max_num_tokens": 1000, "max_input_len": 2048}, "max_num_tokens"),
        ({"max_batch_size": 0}, "max_batch_size"),
    ],
)
def test_inconsistent_options_are_refused(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        TrtllmOptions(**kwargs)


def test_tensor_parallel_size_must_divide_the_heads(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"num_attention_heads": 14}))
    trtllm.check_tensor_parallel(TrtllmOptions(tp_size=2), tmp_path)
    with pytest.raises(StageError, match="tp_size 4 does not divide the model's 14 attention heads"):
        trtllm.check_tensor_parallel(TrtllmOptions(tp_size=4), tmp_path)


@pytest.mark.skipif(importlib.util.find_spec("tensorrt_llm") is not None, reason="TensorRT-LLM is installed here")
def test_missing_tensorrt_llm_stops_the_stage_with_what_to_install(tmp_path: Path) -> None:
    with pytest.raises(StageError, match=r"nvcr\.io/nvidia/tritonserver:25\.06-trtllm-python-py3"):
        trtllm.build_engine(BuildSettings(work_dir=tmp_path), source_fingerprint="x")
    assert not (tmp_path / "trtllm").exists()  # stopped before doing anything


def test_engine_stage_fingerprint_covers_the_machine(monkeypatch, tmp_path: Path) -> None:
    from cosyvoice_build.stages import STAGES

    engine_stage = next(s for s in STAGES if s.name == "engine")
    settings = BuildSettings(work_dir=tmp_path)
    monkeypatch.setattr(trtllm, "build_environment", lambda: {"tensorrt_llm": "0.20.0", "gpus": "NVIDIA H200, 9.0"})
    on_h200 = engine_stage.inputs(settings).values
    monkeypatch.setattr(trtllm, "build_environment", lambda: {"tensorrt_llm": "0.20.0", "gpus": "NVIDIA L20, 8.9"})
    assert engine_stage.inputs(settings).values != on_h200
    assert on_h200["max_batch_size"] == settings.trtllm.max_batch_size


def test_build_environment_without_gpu_tools_is_empty_not_an_error(monkeypatch) -> None:
    monkeypatch.setenv("PATH", "/nonexistent")
    env = trtllm.build_environment()
    assert env["gpus"] is None and set(env) == {"tensorrt_llm", "gpus"}


def test_failing_tool_names_its_log(tmp_path: Path) -> None:
    log_path = tmp_path / "engine.log"
    with pytest.raises(StageError, match="exited with 3"):
        trtllm.run_command([sys.executable, "-c", "print('boom'); raise SystemExit(3)"], log_path)
    assert "boom" in log_path.read_text()


# build_meta.json ------------------------------------------------------------------------------------------------
H200 = RuntimeInfo(tensorrt_llm_version="0.20.0", tensorrt_version="10.10.0.31", gpu_name="NVIDIA H200", compute_capability="9.0")


@pytest.fixture
def engine_dir(tmp_path: Path) -> Path:
    meta = BuildMeta(
        built_with=H200,
        options=asdict(TrtllmOptions()),
        source_fingerprint="f" * 64,
        vocab_layout={"speech_offset": 151663},
        commands=[["trtllm-build", "--checkpoint_dir", "x"]],
        created_at="2026-11-21T00:00:00+00:00",
    )
    write_build_meta(tmp_path, meta)
    return tmp_path


def test_matching_runtime_is_accepted(engine_dir: Path) -> None:
    meta = check_engine_compatible(engine_dir, H200)
    assert meta.built_with == H200 and meta.vocab_layout["speech_offset"] == 151663


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"tensorrt_llm_version": "0.21.0"}, "TensorRT-LLM version: engine built with '0.20.0', this machine has '0.21.0'"),
        ({"tensorrt_version": "10.11.0"}, "TensorRT version"),
        ({"gpu_name": "NVIDIA L20", "compute_capability": "8.9"}, "GPU compute capability.*GPU model"),
        ({"gpu_name": "NVIDIA H100 80GB HBM3"}, "GPU model: engine built with 'NVIDIA H200'"),
    ],
)
def test_mismatching_runtime_is_refused(engine_dir: Path, change: dict, message: str) -> None:
    with pytest.raises(EngineIncompatibleError, match=message) as info:
        check_engine_compatible(engine_dir, replace(H200, **change))
    assert "rebuild" in str(info.value)


def test_engine_without_metadata_is_refused(tmp_path: Path) -> None:
    with pytest.raises(EngineIncompatibleError, match="build_meta.json is missing"):
        check_engine_compatible(tmp_path, H200)
    (tmp_path / BUILD_META_FILE).write_text(json.dumps({"format": 99}))
    with pytest.raises(EngineIncompatibleError, match="format 99"):
        check_engine_compatible(tmp_path, H200)


def test_check_engine_command_refuses_a_foreign_engine(engine_dir: Path, tmp_path: Path, monkeypatch, capsys) -> None:
    from cosyvoice_build import check_engine

    settings = BuildSettings(work_dir=tmp_path / "work")
    settings.engine_dir.mkdir(parents=True)
    (settings.engine_dir / BUILD_META_FILE).write_text((engine_dir / BUILD_META_FILE).read_text())
    monkeypatch.setattr(RuntimeInfo, "detect", classmethod(lambda cls: H200))
    assert check_engine.main(["--work-dir", str(settings.work_dir)]) == 0
    monkeypatch.setattr(RuntimeInfo, "detect", classmethod(lambda cls: replace(H200, gpu_name="NVIDIA A10G", compute_capability="8.6")))
    assert check_engine.main(["--work-dir", str(settings.work_dir)]) == 1
    assert "GPU model" in capsys.readouterr().err


@pytest.mark.parametrize(("tp_size", "preset", "expected"), [(1, None, None), (2, None, "1"), (2, "0", "0")])
def test_check_engine_starts_the_server_in_orchestrator_mode_for_a_tensor_parallel_engine(
    tmp_path: Path, monkeypatch, tp_size: int, preset: str | None, expected: str | None
) -> None:
    """Plain tritonserver drives a multi-GPU engine only with TRTLLM_ORCHESTRATOR=1 (an operator's value wins)."""
    from cosyvoice_build import check_engine

    settings = BuildSettings(work_dir=tmp_path / "work", trtllm=TrtllmOptions(tp_size=tp_size))
    settings.engine_dir.mkdir(parents=True)
    meta = BuildMeta(
        built_with=H200, options=asdict(settings.trtllm), source_fingerprint="f" * 64, vocab_layout={},
        commands=[], created_at="2026-11-21T00:00:00+00:00",
    )  # fmt: skip
    write_build_meta(settings.engine_dir, meta)
    monkeypatch.setattr(RuntimeInfo, "detect", classmethod(lambda cls: H200))
    if preset is None:
        monkeypatch.delenv(check_engine.ORCHESTRATOR_ENV, raising=False)
    else:
        monkeypatch.setenv(check_engine.ORCHESTRATOR_ENV, preset)
    started: list[tuple[str, list[str], dict[str, str]]] = []
    monkeypatch.setattr(check_engine.os, "execvpe", lambda file, args, env: started.append((file, args, env)))
    argv = ["--work-dir", str(settings.work_dir), "--trt-tp-size", str(tp_size), "--", "tritonserver", "--model-repository=/r"]
    assert check_engine.main(argv) == 0
    [(file, args, env)] = started
    assert file == "tritonserver" and args == ["tritonserver", "--model-repository=/r"]
    assert env.get(check_engine.ORCHESTRATOR_ENV) == expected


# -- the Spark LLM's engine (cosyvoice_build.spark_trtllm) ----------------------------------------------
@pytest.fixture(scope="module")
def spark_dir(tmp_path_factory) -> Path:
    from spark_tts.testing import write_tiny_model

    return write_tiny_model(tmp_path_factory.mktemp("spark"), seed=1)


def test_spark_engine_builds_with_float32_logits_for_the_benchmark_bias(spark_dir: Path) -> None:
    """The shapes are `spark_weights.spark_trtllm_commands`' (tests/spark/test_build_stage.py); the converter parses
    its flags, and the logits are float32, the type benchmark mode's embedding bias must have."""
    from cosyvoice_build import spark_weights

    convert, build = spark_weights.spark_trtllm_commands(spark_dir, Path("/m"))
    assert convert[1:3] == ["-m", "cosyvoice_build.trtllm_convert"]
    assert trtllm_convert.parse_args(convert[3:]).model_dir == str(spark_dir / "LLM")
    assert flag_values(build)["--logits_dtype"] == "float32"


def test_spark_engine_prints_its_commands_and_stops_without_tensorrt_llm(spark_dir, tmp_path, capsys) -> None:
    from cosyvoice_build import spark_trtllm

    argv = ["--spark-dir", str(spark_dir), "--work-dir", str(tmp_path / "out"), "--max-batch-size", "32"]
    assert spark_trtllm.main([*argv, "--print"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 2 and "cosyvoice_build.trtllm_convert" in lines[0] and "--max_batch_size 32" in lines[1]
    assert f"--model_dir {spark_dir / 'LLM'}" in lines[0] and f"--output_dir {tmp_path / 'out' / 'trtllm'}" in lines[1]
    assert spark_trtllm.main([*argv, "--tp-size", "8"]) == 1  # the tiny LLM's 4 heads do not split 8 ways
    assert "does not divide" in capsys.readouterr().err
    assert spark_trtllm.main(["--spark-dir", str(tmp_path / "none"), "--print"]) == 1
    if importlib.util.find_spec("tensorrt_llm") is None:
        assert spark_trtllm.main(argv) == 1
        assert "tensorrt_llm is not importable" in capsys.readouterr().err
