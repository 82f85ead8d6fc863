"""Staged, idempotent execution: each stage declares its inputs and outputs; a marker records what it last built.

A stage is skipped when its marker holds the same input fingerprint and all its outputs still exist. A failing
stage is reported and the following stages still run (each checks its own inputs and names what is missing), so
one unavailable tool, e.g. TensorRT-LLM on a machine without it, does not hide the state of everything else.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Literal

from cosyvoice_build.fingerprint import DigestCache, fingerprint
from cosyvoice_build.settings import BuildSettings

log = logging.getLogger("cosyvoice_build")


class StageError(RuntimeError):
    """A stage cannot run or failed; the message says why and what to do."""


@dataclass(frozen=True)
class StageInputs:
    paths: list[Path] = field(default_factory=list)  # files/dirs whose content the stage reads
    values: dict[str, object] = field(default_factory=dict)  # options that change its output


@dataclass(frozen=True)
class Stage:
    name: str
    description: str
    inputs: Callable[[BuildSettings], StageInputs]
    outputs: Callable[[BuildSettings], list[Path]]
    run: Callable[[BuildSettings], None]
    #: False for checks whose effect lives outside the work dir (the smoke test): never skipped.
    cacheable: bool = True


Outcome = Literal["done", "skipped", "failed"]


@dataclass(frozen=True)
class StageResult:
    stage: str
    outcome: Outcome
    detail: str = ""


def select(stages: list[Stage], first: str | None, last: str | None) -> list[Stage]:
    names = [s.name for s in stages]
    for name in (first, last):
        if name is not None and name not in names:
            raise ValueError(f"unknown stage {name!r}; stages are: {', '.join(names)}")
    start = names.index(first) if first else 0
    stop = names.index(last) if last else len(names) - 1
    if start > stop:
        raise ValueError(f"--from {first} comes after --to {last}")
    return stages[start : stop + 1]


def _marker(settings: BuildSettings, stage: Stage) -> Path:
    return settings.state_dir / f"{stage.name}.done.json"


def _check_inputs(inputs: StageInputs) -> None:
    missing = [str(p) for p in inputs.paths if not p.exists()]
    if missing:
        raise StageError(f"missing input: {', '.join(missing)} (run the earlier stages first)")


def run_stage(stage: Stage, settings: BuildSettings, cache: DigestCache, force: bool = False) -> StageResult:
    marker = _marker(settings, stage)
    try:
        inputs = stage.inputs(settings)
        _check_inputs(inputs)
        digest = fingerprint(inputs.paths, {"stage": stage.name, **inputs.values}, cache)
        if stage.cacheable and not force and marker.exists():
            previous = json.loads(marker.read_text())
            if previous.get("fingerprint") == digest and all(p.exists() for p in stage.outputs(settings)):
                log.info("[%s] up to date, skipped (marker %s)", stage.name, marker)
                return StageResult(stage.name, "skipped")
        marker.unlink(missing_ok=True)  # a stage that fails half-way must not look done
        log.info("[%s] %s", stage.name, stage.description)
        started = time.monotonic()
        stage.run(settings)
        elapsed = time.monotonic() - started
    except StageError as exc:
        log.error("[%s] FAILED: %s", stage.name, exc)
        return StageResult(stage.name, "failed", str(exc))
    if stage.cacheable:
        marker.parent.mkdir(parents=True, exist_ok=True)
        record = {"fingerprint": digest, "seconds": round(elapsed, 1), "outputs": [str(p) for p in stage.outputs(settings)]}
        marker.write_text(json.dumps(record, indent=2) + "\n")
    log.info("[%s] done in %.1f s", stage.name, elapsed)
    return StageResult(stage.name, "done")


def run_stages(
    stages: list[Stage], settings: BuildSettings, first: str | None = None, last: str | None = None, force: bool = False
) -> list[StageResult]:
    cache = DigestCache(settings.state_dir / "digests.json")
    return [run_stage(stage, settings, cache, force) for stage in select(stages, first, last)]
