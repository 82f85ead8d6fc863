"""``build_meta.json`` beside a TensorRT-LLM engine, and the check a loader runs before using the engine.

A TensorRT engine only works with the TensorRT (and TensorRT-LLM) version that built it and on GPUs of the
architecture it was built for. Upstream names engines after one GPU model and, on a version mismatch, serves
silence (CosyVoice issue #1831). We record what built the engine and refuse a mismatch with a message that says
how to rebuild.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

BUILD_META_FILE = "build_meta.json"
FORMAT_VERSION = 1
REBUILD_HINT = "rebuild the engine on this machine: cosyvoice-build --from engine --to engine --force"


class EngineIncompatibleError(RuntimeError):
    """The engine was built for another GPU or another TensorRT(-LLM) version, or has no metadata."""


@dataclass(frozen=True)
class RuntimeInfo:
    """What an engine is bound to."""

    tensorrt_llm_version: str
    tensorrt_version: str
    gpu_name: str
    compute_capability: str  # "major.minor", e.g. "9.0"

    @classmethod
    def detect(cls, device: int = 0) -> RuntimeInfo:
        """Of this process's environment (imports tensorrt_llm, tensorrt and torch.cuda)."""
        import tensorrt  # noqa: PLC0415 - only present in the TensorRT-LLM image
        import tensorrt_llm  # noqa: PLC0415
        import torch  # noqa: PLC0415

        major, minor = torch.cuda.get_device_capability(device)
        return cls(
            tensorrt_llm_version=str(tensorrt_llm.__version__),
            tensorrt_version=str(tensorrt.__version__),
            gpu_name=torch.cuda.get_device_name(device),
            compute_capability=f"{major}.{minor}",
        )


@dataclass(frozen=True)
class BuildMeta:
    built_with: RuntimeInfo
    options: dict[str, Any]  # TrtllmOptions as a dict
    source_fingerprint: str  # content fingerprint of the HF checkpoint the engine was built from
    vocab_layout: dict[str, Any]  # SpeechVocabLayout.to_json() of that checkpoint
    commands: list[list[str]]
    created_at: str

    def to_json(self) -> dict[str, Any]:
        return {"format": FORMAT_VERSION, **asdict(self)}


def write_build_meta(engine_dir: Path, meta: BuildMeta) -> Path:
    path = Path(engine_dir) / BUILD_META_FILE
    path.write_text(json.dumps(meta.to_json(), indent=2) + "\n")
    return path


def read_build_meta(engine_dir: Path) -> BuildMeta:
    path = Path(engine_dir) / BUILD_META_FILE
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError as exc:
        raise EngineIncompatibleError(f"{path} is missing: the engine was not built by cosyvoice-build; {REBUILD_HINT}") from exc
    except json.JSONDecodeError as exc:
        raise EngineIncompatibleError(f"{path} is not valid JSON ({exc}); {REBUILD_HINT}") from exc
    if data.get("format") != FORMAT_VERSION:
        raise EngineIncompatibleError(f"{path} has format {data.get('format')!r}, expected {FORMAT_VERSION}; {REBUILD_HINT}")
    data.pop("format")
    return BuildMeta(**{**data, "built_with": RuntimeInfo(**data["built_with"])})


def check_engine_compatible(engine_dir: Path, runtime_info: RuntimeInfo) -> BuildMeta:
    """Return the engine's metadata if it can run under ``runtime_info``; raise naming every mismatch otherwise."""
    meta = read_build_meta(engine_dir)
    built = meta.built_with
    mismatches = [
        f"{label}: engine built with {getattr(built, name)!r}, this machine has {getattr(runtime_info, name)!r}"
        for name, label in (
            ("tensorrt_llm_version", "TensorRT-LLM version"),
            ("tensorrt_version", "TensorRT version"),
            ("compute_capability", "GPU compute capability"),
            ("gpu_name", "GPU model"),
        )
        if getattr(built, name) != getattr(runtime_info, name)
    ]
    if mismatches:
        raise EngineIncompatibleError(f"engine {engine_dir} does not match this runtime: " + "; ".join(mismatches) + f"; {REBUILD_HINT}")
    return meta
