"""Render a Triton model repository with the stand-in as both pipeline models."""

from __future__ import annotations

from pathlib import Path

import pipeline_contract as contract

STANDIN_SOURCE = Path(__file__).resolve().parent / "standin.py"

_MODEL_PY = '''"""Loads the stand-in test double (tests/gateway/standin_model/standin.py)."""
import importlib.util

_spec = importlib.util.spec_from_file_location("standin_pipeline_model", {source!r})
_module = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_module)
TritonPythonModel = _module.TritonPythonModel
'''


def _config(name: str, decoupled: bool, parameters: dict[str, str]) -> str:
    params = "\n".join(
        f'parameters: {{ key: "{key}" value: {{ string_value: "{value}" }} }}' for key, value in parameters.items()
    )
    policy = "model_transaction_policy { decoupled: true }\n" if decoupled else ""
    return (
        f'name: "{name}"\nbackend: "python"\nmax_batch_size: 0\n{policy}'
        f"{contract.pbtxt_io_block('input', contract.INPUTS)}\n"
        f"{contract.pbtxt_io_block('output', contract.OUTPUTS)}\n"
        f"instance_group [ {{ kind: KIND_CPU count: 1 }} ]\n{params}\n"
    )


def render_standin_repository(
    destination: Path, marker_dir: Path, *, chunk_count: int = 4, chunk_delay_ms: int = 20,
    models: tuple[str, str] = (contract.OFFLINE_MODEL, contract.STREAMING_MODEL),
    sample_rate: int = contract.OUTPUT_SAMPLE_RATE,
) -> Path:
    """Both contract models (offline + decoupled streaming, named by `models`) backed by the stand-in; its audio
    is at `sample_rate` (16000 with the Spark model names stands in for Spark-TTS)."""
    parameters = {"chunk_count": str(chunk_count), "chunk_delay_ms": str(chunk_delay_ms), "marker_dir": str(marker_dir),
                  "sample_rate": str(sample_rate)}
    for name, decoupled in ((models[0], False), (models[1], True)):
        version = destination / name / "1"
        version.mkdir(parents=True, exist_ok=True)
        (version / "model.py").write_text(_MODEL_PY.format(source=str(STANDIN_SOURCE)))
        (destination / name / "config.pbtxt").write_text(_config(name, decoupled, parameters))
    return destination
