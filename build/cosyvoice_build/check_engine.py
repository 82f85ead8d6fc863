"""``python -m cosyvoice_build.check_engine``: refuse to start Triton on an engine built for another GPU or version.

The TensorRT-LLM containers run it before ``tritonserver`` (the tensorrtllm backend loads the engine in C++,
where no Python check can run). It takes the build's options and ``COSYVOICE_*`` environment, so it checks the
engine directory the build wrote.
"""

from __future__ import annotations

import sys

from cosyvoice_build.cli import build_parser, settings_from_args
from cosyvoice_build.engine_meta import EngineIncompatibleError, RuntimeInfo, check_engine_compatible


def main(argv: list[str] | None = None) -> int:
    settings = settings_from_args(build_parser().parse_args(argv))
    try:
        meta = check_engine_compatible(settings.engine_dir, RuntimeInfo.detect())
    except EngineIncompatibleError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    built = meta.built_with
    print(f"engine {settings.engine_dir}: TensorRT-LLM {built.tensorrt_llm_version}, {built.gpu_name} ({built.compute_capability}): ok")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
