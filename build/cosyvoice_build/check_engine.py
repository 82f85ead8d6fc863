"""``python -m cosyvoice_build.check_engine [BUILD OPTIONS] [-- COMMAND...]``: refuse to start Triton on an engine
built for another GPU or version, then (given a command) start it with what the engine needs.

The TensorRT-LLM containers run it in front of ``tritonserver`` (the tensorrtllm backend loads the engine in C++,
where no Python check can run). It takes the build's options and ``COSYVOICE_*`` environment, so it checks the
engine directory the build wrote. After ``--`` comes the server command, which replaces this process once the
engine passed: for a tensor-parallel engine with ``TRTLLM_ORCHESTRATOR=1`` in its environment, since plain
``tritonserver`` (not launched through MPI) can only drive several ranks in the backend's orchestrator mode, which
spawns one worker process per rank.
"""

from __future__ import annotations

import os
import sys

from cosyvoice_build.cli import build_parser, settings_from_args
from cosyvoice_build.engine_meta import BuildMeta, EngineIncompatibleError, RuntimeInfo, check_engine_compatible

#: The tensorrtllm backend's switch to orchestrator mode (read by the backend at model load).
ORCHESTRATOR_ENV = "TRTLLM_ORCHESTRATOR"


def server_environment(meta: BuildMeta, environ: dict[str, str]) -> dict[str, str]:
    """The environment the server command runs in: `environ`, plus orchestrator mode for a multi-GPU engine
    (unless the operator set the variable, e.g. to 0 when launching through mpirun)."""
    env = dict(environ)
    if int(meta.options.get("tp_size", 1)) > 1:
        env.setdefault(ORCHESTRATOR_ENV, "1")
    return env


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    command: list[str] = []
    if "--" in argv:
        split = argv.index("--")
        argv, command = argv[:split], argv[split + 1 :]
    settings = settings_from_args(build_parser().parse_args(argv))
    try:
        meta = check_engine_compatible(settings.engine_dir, RuntimeInfo.detect())
    except EngineIncompatibleError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    built = meta.built_with
    print(f"engine {settings.engine_dir}: TensorRT-LLM {built.tensorrt_llm_version}, {built.gpu_name} ({built.compute_capability}): ok")
    if command:
        sys.stdout.flush()
        os.execvpe(command[0], command, server_environment(meta, dict(os.environ)))  # noqa: S606 - the server, by design
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
