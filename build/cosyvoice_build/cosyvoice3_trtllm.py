"""CosyVoice3's LLM as a TensorRT-LLM engine, for `render --cosyvoice3-dir ... --cosyvoice3-engine-dir ...
--cosyvoice3-llm-dir ...` (the `cosyvoice3_llm` model).

    python -m cosyvoice_build.cosyvoice3_trtllm --cosyvoice3-dir models/Fun-CosyVoice3-0.5B-2512 \\
        [--work-dir models] [--print]

Three steps: `hf_llm.convert_llm_to_hf` turns the release's `llm.pt` into a plain Hugging Face Qwen2 checkpoint
with the merged vocabulary (`cosyvoice3.vocab`) and its logits bias file (WORK_DIR/cosyvoice3_llm_hf; runs here, on
the CPU), then the same two commands as CosyVoice2's engine stage (`cosyvoice_build.trtllm`): our wrapper of
TensorRT-LLM's Qwen converter, and `trtllm-build` with the same plugins and float32 logits (the per-request
logits bias that masks the text rows is added in the logits' type).

`--print` converts, then writes the two TensorRT-LLM commands and exits (a machine without TensorRT-LLM can still
produce the checkpoint and show what would run); without it both run here, which needs NVIDIA's TensorRT-LLM image
(`trtllm.MISSING_TRTLLM` says where). Checkpoint and engine land under WORK_DIR/trtllm/, the log beside them.
"""

from __future__ import annotations

import argparse
import shutil
import sys
from dataclasses import replace
from pathlib import Path

from cosyvoice_build.cosyvoice3_weights import verify_cosyvoice3_dir
from cosyvoice_build.pipeline import StageError
from cosyvoice_build.settings import TrtllmOptions
from cosyvoice_build.trtllm import add_engine_arguments, build_command, convert_command, run_engine_tool

HF_DIRNAME = "cosyvoice3_llm_hf"


def build_parser() -> argparse.ArgumentParser:
    defaults = TrtllmOptions()
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cosyvoice3-dir", type=Path, required=True,
                        help="the Fun-CosyVoice3-0.5B-2512 directory (released layout)")
    add_engine_arguments(parser, defaults, "prompt tokens (sos + texts + task + prompt speech)")
    parser.add_argument("--max-seq-len", type=int, default=defaults.max_seq_len,
                        help="prompt + generated tokens (the render's --max-seq-len may not exceed it)")
    parser.add_argument("--hf-dtype", choices=("float32", "bfloat16", "float16"), default="float32",
                        help="dtype of the converted Hugging Face checkpoint (the engine's is --dtype)")
    return parser


def cosyvoice3_trtllm_commands(hf_dir: Path, work_dir: Path, options: TrtllmOptions) -> list[list[str]]:
    """The TensorRT-LLM convert and build commands of the CosyVoice3 engine."""
    checkpoint = work_dir / "trtllm" / f"cosyvoice3_checkpoint_{options.tag}"
    engine = work_dir / "trtllm" / f"cosyvoice3_engine_{options.tag}"
    return [convert_command(options, hf_dir, checkpoint), build_command(options, checkpoint, engine)]


def convert(model_dir: Path, hf_dir: Path, dtype: str) -> None:
    """The merged-vocabulary checkpoint, written beside `hf_dir` and renamed (complete or absent)."""
    import torch  # noqa: PLC0415 - heavy: only when converting

    from cosyvoice_build import hf_llm  # noqa: PLC0415 - imports torch and transformers

    partial = hf_dir.with_name(hf_dir.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    try:
        hf_llm.convert_llm_to_hf(model_dir, partial, getattr(torch, dtype))
    except hf_llm.ConversionError as exc:
        raise StageError(str(exc)) from exc
    shutil.rmtree(hf_dir, ignore_errors=True)
    partial.rename(hf_dir)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        options = replace(TrtllmOptions(), dtype=args.dtype, weight_only=args.weight_only, tp_size=args.tp_size,
                          max_batch_size=args.max_batch_size, max_input_len=args.max_input_len,
                          max_seq_len=args.max_seq_len, max_num_tokens=max(8192, args.max_input_len))  # fmt: skip
    except ValueError as exc:
        print(f"cosyvoice3_trtllm: {exc}", file=sys.stderr)
        return 2
    hf_dir = args.work_dir / HF_DIRNAME

    def prepare() -> Path:
        verify_cosyvoice3_dir(args.cosyvoice3_dir)
        convert(args.cosyvoice3_dir, hf_dir, args.hf_dtype)
        return hf_dir

    return run_engine_tool("cosyvoice3_trtllm", prepare, options,
                           cosyvoice3_trtllm_commands(hf_dir, args.work_dir, options), args.print,
                           f"--cosyvoice3-dir {args.cosyvoice3_dir} --cosyvoice3-engine-dir {{engine}} "
                           f"--cosyvoice3-llm-dir {hf_dir}")


if __name__ == "__main__":
    raise SystemExit(main())
