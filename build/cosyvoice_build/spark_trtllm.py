"""The Spark LLM as a TensorRT-LLM engine, for `render --spark-engine-dir` (the `spark_llm` model).

    python -m cosyvoice_build.spark_trtllm --spark-dir models/Spark-TTS-0.5B --out models/spark-trtllm [--print]

Spark-TTS-0.5B's `LLM/` directory is a plain Hugging Face Qwen2 checkpoint (Qwen2.5-0.5B with Spark's added
tokens, tied embeddings, 166,000 rows), so it goes through the same two commands as CosyVoice2's engine stage
(`cosyvoice_build.trtllm`): our wrapper of TensorRT-LLM's Qwen converter (`cosyvoice_build.trtllm_convert`), then
`trtllm-build` with the same plugins and float32 logits (benchmark mode sends an embedding bias that keeps the
stop id from being drawn, and the backend needs the bias in the logits' type). Only the shapes differ: a Spark
sequence is a prompt (global tokens, the reference's semantic tokens, text) plus at most 512 new tokens.

`--print` writes the commands and exits (a machine without TensorRT-LLM can still show what would run); without
it both run here, which needs NVIDIA's TensorRT-LLM image (`trtllm.MISSING_TRTLLM` says where). The engine
lands in OUT/engine, the converted checkpoint in OUT/checkpoint; the log in OUT/engine.log.
"""

from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path

from cosyvoice_build.pipeline import StageError
from cosyvoice_build.settings import TrtllmOptions
from cosyvoice_build.spark_weights import verify_spark_dir
from cosyvoice_build.trtllm import build_command, check_tensor_parallel, convert_command, require_tensorrt_llm, run_command
from spark_tts import layout

#: Spark's sequence shapes: 2048 tokens per sequence (the render's `--spark-max-seq-len` default), of which the
#: prompt may take all but the 512 a segment generates at most (`SparkSampling.max_new_tokens`).
SPARK_MAX_SEQ_LEN = 2048
SPARK_MAX_NEW_TOKENS = 512
SPARK_TRTLLM = TrtllmOptions(max_seq_len=SPARK_MAX_SEQ_LEN, max_input_len=SPARK_MAX_SEQ_LEN - SPARK_MAX_NEW_TOKENS)


def commands(options: TrtllmOptions, spark_dir: Path, out: Path, python: str = sys.executable) -> list[list[str]]:
    """Checkpoint conversion of `spark_dir`'s LLM, then the engine build (into OUT/checkpoint, OUT/engine)."""
    checkpoint = out / "checkpoint"
    return [convert_command(options, spark_dir / layout.LLM_DIR, checkpoint, python=python),
            build_command(options, checkpoint, out / "engine")]  # fmt: skip


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--spark-dir", type=Path, required=True, help="the Spark-TTS-0.5B directory (released layout)")
    parser.add_argument("--out", type=Path, required=True, help="where checkpoint/ and engine/ go")
    parser.add_argument("--dtype", choices=("bfloat16", "float16"), default=SPARK_TRTLLM.dtype)
    parser.add_argument("--weight-only", choices=("none", "int8", "int4"), default=SPARK_TRTLLM.weight_only)
    parser.add_argument("--tp-size", type=int, default=SPARK_TRTLLM.tp_size)
    parser.add_argument("--max-batch-size", type=int, default=SPARK_TRTLLM.max_batch_size,
                        help="sequences decoded together (the render's --max-batch may not exceed it)")
    parser.add_argument("--max-num-tokens", type=int, default=SPARK_TRTLLM.max_num_tokens)
    parser.add_argument("--max-seq-len", type=int, default=SPARK_TRTLLM.max_seq_len,
                        help="prompt + generated tokens (the render's --spark-max-seq-len may not exceed it)")
    parser.add_argument("--max-input-len", type=int, default=SPARK_TRTLLM.max_input_len)
    parser.add_argument("--print", action="store_true", help="print the commands instead of running them")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        options = TrtllmOptions(dtype=args.dtype, weight_only=args.weight_only, tp_size=args.tp_size,
                                max_batch_size=args.max_batch_size, max_num_tokens=args.max_num_tokens,
                                max_seq_len=args.max_seq_len, max_input_len=args.max_input_len)  # fmt: skip
    except ValueError as exc:
        print(f"spark_trtllm: {exc}", file=sys.stderr)
        return 2
    try:
        verify_spark_dir(args.spark_dir)
        check_tensor_parallel(options, args.spark_dir / layout.LLM_DIR)
        steps = commands(options, args.spark_dir, args.out)
        if args.print:
            print("\n".join(shlex.join(cmd) for cmd in steps))
            return 0
        require_tensorrt_llm()
        for cmd in steps:
            run_command(cmd, args.out / "engine.log")
    except StageError as exc:
        print(f"spark_trtllm: {exc}", file=sys.stderr)
        return 1
    print(f"engine: {args.out / 'engine'} (render --spark-dir {args.spark_dir} --spark-engine-dir {args.out / 'engine'})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
