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
import shlex
import sys
from dataclasses import replace
from pathlib import Path

from cosyvoice_build.pipeline import StageError
from cosyvoice_build.spark_weights import spark_trtllm_commands, spark_trtllm_options, verify_spark_dir
from cosyvoice_build.trtllm import check_tensor_parallel, require_tensorrt_llm, run_command
from spark_tts import layout


def build_parser() -> argparse.ArgumentParser:
    defaults = spark_trtllm_options()
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--spark-dir", type=Path, required=True, help="the Spark-TTS-0.5B directory (released layout)")
    parser.add_argument("--work-dir", type=Path, default=Path("models"), help="trtllm/ goes here (default models)")
    parser.add_argument("--dtype", choices=("bfloat16", "float16"), default=defaults.dtype)
    parser.add_argument("--weight-only", choices=("none", "int8", "int4"), default=defaults.weight_only)
    parser.add_argument("--tp-size", type=int, default=defaults.tp_size)
    parser.add_argument("--max-batch-size", type=int, default=defaults.max_batch_size,
                        help="sequences decoded together (the render's --max-batch may not exceed it)")
    parser.add_argument("--max-input-len", type=int, default=defaults.max_input_len,
                        help="prompt tokens; the sequence limit is this + 512 (the render's --spark-max-seq-len "
                             "may not exceed it)")
    parser.add_argument("--print", action="store_true", help="print the commands instead of running them")
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
    engine = Path(steps[1][steps[1].index("--output_dir") + 1])
    try:
        verify_spark_dir(args.spark_dir)
        check_tensor_parallel(options, args.spark_dir / layout.LLM_DIR)
        if args.print:
            print("\n".join(shlex.join(cmd) for cmd in steps))
            return 0
        require_tensorrt_llm()
        for cmd in steps:
            run_command(cmd, engine.parent / "spark_engine.log")
    except StageError as exc:
        print(f"spark_trtllm: {exc}", file=sys.stderr)
        return 1
    print(f"engine: {engine} (render --spark-dir {args.spark_dir} --spark-engine-dir {engine})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
