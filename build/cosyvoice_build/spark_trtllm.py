"""The Spark LLM as a TensorRT-LLM engine, for `render --spark-engine-dir` (the `spark_llm` model).

    python -m cosyvoice_build.spark_trtllm --spark-dir models/Spark-TTS-0.5B [--work-dir models] [--print]

Spark-TTS-0.5B's `LLM/` directory is a plain Hugging Face Qwen2 checkpoint (Qwen2.5-0.5B with Spark's added
tokens, tied embeddings, 166,000 rows), so it goes through the same two commands as CosyVoice2's engine stage
(`cosyvoice_build.trtllm`): our wrapper of TensorRT-LLM's Qwen converter, then `trtllm-build` with the same plugins
and float32 logits (benchmark mode sends an embedding bias that keeps the stop id from being drawn, and the
backend needs the bias in the logits' type). Only the shapes differ: `spark_weights.spark_trtllm_options`.

`--print` writes the commands and exits (a machine without TensorRT-LLM can still show what would run); without
it both run here, which needs NVIDIA's TensorRT-LLM image (`trtllm.MISSING_TRTLLM` says where). The checkpoint
and engine land under WORK_DIR/trtllm/ (`spark_weights.spark_trtllm_commands`), the log beside them.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import replace
from pathlib import Path

from cosyvoice_build.spark_weights import spark_trtllm_commands, spark_trtllm_options, verify_spark_dir
from cosyvoice_build.trtllm import add_engine_arguments, run_engine_tool
from spark_tts import layout


def build_parser() -> argparse.ArgumentParser:
    defaults = spark_trtllm_options()
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--spark-dir", type=Path, required=True, help="the Spark-TTS-0.5B directory (released layout)")
    add_engine_arguments(parser, defaults, "prompt tokens; the sequence limit is this + 512 (the render's "
                                           "--spark-max-seq-len may not exceed it)")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        options = replace(spark_trtllm_options(args.max_batch_size, args.max_input_len), dtype=args.dtype,
                          weight_only=args.weight_only, tp_size=args.tp_size)  # fmt: skip
    except ValueError as exc:
        print(f"spark_trtllm: {exc}", file=sys.stderr)
        return 2
    steps = spark_trtllm_commands(args.spark_dir, args.work_dir, options)

    def prepare() -> Path:
        verify_spark_dir(args.spark_dir)
        return args.spark_dir / layout.LLM_DIR

    return run_engine_tool("spark_trtllm", prepare, options, steps, args.print,
                           f"--spark-dir {args.spark_dir} --spark-engine-dir {{engine}}")


if __name__ == "__main__":
    raise SystemExit(main())
