"""The rendered repository validated before it replaces the old one: the expected models, every config a
Triton ModelConfig named after its directory with its version directory and adapter, single-instance models
single, and every tensorrtllm model consistent with the backend's facts and what its callers send."""

from __future__ import annotations

from pathlib import Path

from triton_repo import internal_io as io
from triton_repo import spark_io, spark_render
from triton_repo import trtllm_backend_facts as facts
from triton_repo.render_models import SINGLE_INSTANCE
from triton_repo.render_options import RenderError
from triton_repo.render_trtllm import check_trtllm_config


def validate_repository(repo: Path, expected: set[str]) -> None:
    """Structural check of a rendered repository holding the models `expected`; raises RenderError naming every problem."""
    from google.protobuf import text_format  # noqa: PLC0415 - only needed here
    from tritonclient.grpc import model_config_pb2  # noqa: PLC0415

    errors: list[str] = []
    models = sorted(p.parent.name for p in repo.glob("*/config.pbtxt"))
    if set(models) != expected:
        errors.append(f"models {models} != expected {sorted(expected)}")
    for name in models:
        path = repo / name / "config.pbtxt"
        text = path.read_text()
        if "${" in text:
            errors.append(f"{path}: unresolved placeholder")
        config = model_config_pb2.ModelConfig()
        try:
            text_format.Parse(text, config)
        except text_format.ParseError as exc:
            errors.append(f"{path}: not a valid ModelConfig ({exc})")
            continue
        if config.name != name:
            errors.append(f"{path}: name {config.name!r} != directory {name!r}")
        if not (repo / name / "1").is_dir():
            errors.append(f"{repo / name}: missing version directory 1/")
        if config.backend == "python" and not (repo / name / "1" / "model.py").is_file():
            errors.append(f"{repo / name}/1/model.py missing")
        if name in SINGLE_INSTANCE and (len(config.instance_group) != 1 or config.instance_group[0].count != 1):
            errors.append(f"{path}: {name} must have exactly one instance")
        if config.backend == "tensorrtllm":
            spark = name == spark_render.LLM
            errors += check_trtllm_config(config, facts.PINNED, spark_io.TRTLLM_INPUTS if spark else io.LLM_INPUTS,
                                          spark_io.TRTLLM_OUTPUTS if spark else io.LLM_OUTPUTS)
    if errors:
        raise RenderError("invalid Triton repository:\n  - " + "\n  - ".join(errors))
