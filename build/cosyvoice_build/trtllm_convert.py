"""HF Qwen2 checkpoint -> TensorRT-LLM checkpoint (runs inside the TensorRT-LLM image).

The same flags as TensorRT-LLM's Qwen ``convert_checkpoint.py`` example (the subset we use), through TRT-LLM's
public model API, so the build does not depend on where an image keeps its examples. One rank file per
tensor-parallel rank; the config is written once.
"""

from __future__ import annotations

import argparse


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model_dir", required=True)
    parser.add_argument("--output_dir", required=True)
    parser.add_argument("--dtype", choices=["bfloat16", "float16"], required=True)
    parser.add_argument("--tp_size", type=int, default=1)
    parser.add_argument("--use_weight_only", action="store_true")
    parser.add_argument("--weight_only_precision", choices=["int8", "int4"], default="int8")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from tensorrt_llm import Mapping  # noqa: PLC0415 - only present in the TensorRT-LLM image
    from tensorrt_llm.models import QWenForCausalLM  # noqa: PLC0415
    from tensorrt_llm.models.modeling_utils import QuantConfig  # noqa: PLC0415
    from tensorrt_llm.quantization import QuantAlgo  # noqa: PLC0415

    quant = QuantConfig()
    if args.use_weight_only:
        quant = QuantConfig(quant_algo=QuantAlgo.W8A16 if args.weight_only_precision == "int8" else QuantAlgo.W4A16)
    for rank in range(args.tp_size):
        mapping = Mapping(world_size=args.tp_size, rank=rank, tp_size=args.tp_size, pp_size=1)
        model = QWenForCausalLM.from_hugging_face(args.model_dir, args.dtype, mapping=mapping, quant_config=quant)
        model.save_checkpoint(args.output_dir, save_config=rank == 0)
        del model
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
