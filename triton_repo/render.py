"""Render a concrete Triton model repository for the CosyVoice2 pipeline from `templates/`.

    python -m triton_repo.render --model-dir models/CosyVoice2-0.5B --out models/triton_repo \\
        [--llm-backend pytorch|tensorrt_llm] [--engine-dir DIR --llm-dir DIR] [--device cpu|cuda] \\
        [--dtype fp32|fp16|bf16] [--max-batch 16] [--max-seq-len 4096] [--instances cosyvoice2_stream=2] \\
        [--first-hop 25] [--chunk-growth 2] [--layout colocated|single] [--llm-delivery chunk|token] \
        [--token2wav unet|dit --dit-dir models/Step-Audio-2-mini/token2wav] [--spark-dir models/Spark-TTS-0.5B] \
        [--cosyvoice3-dir models/Fun-CosyVoice3-0.5B-2512]

Both pipeline models (`cosyvoice2` offline, `cosyvoice2_stream` decoupled) are always rendered, so
switching between offline and streaming never needs a re-render. With `--spark-dir` the Spark-TTS models
(`spark_tts`, `spark_tts_stream` and their internal models, `triton_repo.spark_render`) are rendered beside
them, and with `--cosyvoice3-dir` CosyVoice3's (`cosyvoice3`, `cosyvoice3_stream` and their internal models,
`triton_repo.cosyvoice3_render`). Every option is checked before anything is written; the result is validated
(no unresolved placeholder, every config parses as Triton's ModelConfig, values consistent); the same options give
byte-identical output, and re-rendering replaces a previously rendered repository atomically (other
directories are refused).

This module is the command line and the writing; the options, the checks, the templates and the models are
modules of their own (docs/triton.md#render): an option is one field of `render_options.RenderOptions`, and its
flag here is built from that field.
"""

from __future__ import annotations

import argparse
import dataclasses
import shutil
import sys
import tempfile
import typing
from pathlib import Path
from typing import Any, Sequence

from triton_repo.model_params import optional_type
from triton_repo.render_checks import check_options
from triton_repo.render_models import MARKER, expected_models, render_files
from triton_repo.render_options import (
    TOKEN2WAVS,
    CosyVoice3RenderOptions,
    RenderError,
    RenderOptions,
    SparkRenderOptions,
    flag_of,
)
from triton_repo.render_trtllm import check_trtllm_config
from triton_repo.render_validate import validate_repository

# the render tool's interface, whichever module of it defines the name
__all__ = [
    "MARKER", "TOKEN2WAVS", "CosyVoice3RenderOptions", "RenderError", "RenderOptions", "SparkRenderOptions",
    "check_trtllm_config",
    "main", "render_repository", "write_repository",
]  # fmt: skip


# -- writing ---------------------------------------------------------------------------------------
def write_repository(opts: RenderOptions) -> Path:
    check_options(opts)
    files = render_files(opts)
    out = opts.out
    if out.exists() and any(out.iterdir()) and not (out / MARKER).is_file():
        raise RenderError(f"--out {out} exists and was not rendered by this tool; refusing to replace it")
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out.name}.render-", dir=out.parent))
    try:
        for rel, content in files.items():
            path = staging / rel
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(content)
        validate_repository(staging, expected_models(opts))
        if out.exists():
            old = out.with_name(f".{out.name}.old-{staging.name.rsplit('-', 1)[-1]}")
            out.rename(old)
            staging.rename(out)
            shutil.rmtree(old)
        else:
            staging.rename(out)
    finally:
        if staging.exists():
            shutil.rmtree(staging)
    return out


def render_repository(output_dir: Path, model_dir: Path, **options: object) -> Path:
    """Library entry point (the build tooling's `render` stage calls this): `RenderOptions` fields by name."""
    return write_repository(RenderOptions(model_dir=Path(model_dir), out=Path(output_dir), **options))  # type: ignore[arg-type]


# -- command line: one flag per options field that has help (`render_options.option`) ---------------------------
def _dest(f: dataclasses.Field, prefix: str) -> str:
    return flag_of(f, prefix)[2:].replace("-", "_")


def add_option_flags(parser: argparse.ArgumentParser, cls: type, prefix: str = "") -> None:
    """A flag for every field of `cls` with help, its kind from the field's type; nested options (Spark's) with
    their flags' prefix. Flags left out keep the field's default (argparse sets nothing: `SUPPRESS`)."""
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        kind, _ = optional_type(hints[f.name])
        if dataclasses.is_dataclass(kind) and hasattr(kind, "FLAG_PREFIX"):
            add_option_flags(parser, kind, kind.FLAG_PREFIX)
            continue
        if f.metadata.get("help") is None:
            continue
        spec: dict[str, Any] = {"dest": _dest(f, prefix), "help": f.metadata["help"], "default": argparse.SUPPRESS}
        for key in ("choices", "metavar"):
            if f.metadata.get(key) is not None:
                spec[key] = f.metadata[key]
        if kind is bool:
            spec["action"] = argparse.BooleanOptionalAction
        elif typing.get_origin(kind) is dict:
            spec["action"] = "append"  # MODEL=COUNT, repeatable; the options parse the strings
        elif kind in (int, float, Path):
            spec["type"] = kind
        required = f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
        parser.add_argument(flag_of(f, prefix), required=required and not prefix, **spec)


def option_values(args: argparse.Namespace, cls: type, prefix: str = "") -> dict[str, Any]:
    """The fields of `cls` given on the command line. Nested options exist when all their required flags are
    given; a flag of theirs without those is refused."""
    given = vars(args)
    hints = typing.get_type_hints(cls)
    values: dict[str, Any] = {}
    for f in dataclasses.fields(cls):
        kind, _ = optional_type(hints[f.name])
        if dataclasses.is_dataclass(kind) and hasattr(kind, "FLAG_PREFIX"):
            nested = option_values(args, kind, kind.FLAG_PREFIX)
            needed = [g for g in dataclasses.fields(kind)
                      if g.default is dataclasses.MISSING and g.default_factory is dataclasses.MISSING]
            if nested and any(g.name not in nested for g in needed):
                flags = ", ".join(flag_of(g, kind.FLAG_PREFIX) for g in dataclasses.fields(kind) if g.name in nested)
                raise RenderError(f"{flags} need {' and '.join(flag_of(g, kind.FLAG_PREFIX) for g in needed)}")
            if nested:
                values[f.name] = kind(**nested)
        elif _dest(f, prefix) in given:
            values[f.name] = given[_dest(f, prefix)]
    return values


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m triton_repo.render", description=__doc__.split("\n\n")[0])
    add_option_flags(parser, RenderOptions)
    args = parser.parse_args(argv)
    try:
        out = write_repository(RenderOptions(**option_values(args, RenderOptions)))
    except RenderError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"rendered {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
