"""Compare every fused Triton kernel (`cosyvoice2.kernels.triton_kernels`) with its PyTorch reference, alone
and inside a small LLM body (fused kernels against the reference path).

    python -m scripts.gpu_kernel_check                                  # on CUDA: eager calls and CUDA-graph replays
    TRITON_INTERPRET=1 python -m scripts.gpu_kernel_check --device cpu  # Triton's interpreter, small shapes

Prints the max abs difference per kernel, dtype and shape; exits non-zero on any mismatch. Tolerances: the residual
sums must be bit-exact; normalised, SiLU and Mish outputs may differ by about one rounding step of the dtype (fp32
sums and exp are evaluated in a different order). The interpreter checks fp32 and fp16 only: it converts fp32 to bf16 by
truncation where the GPU rounds to nearest even, so its bf16 results are not the GPU's.
"""

from __future__ import annotations

import argparse
import sys
from typing import Callable

import torch

import cosyvoice2.kernels
from cosyvoice2.kernels import reference
from cosyvoice2.llm import CosyVoice2LM, LLMConfig, Qwen2Config

RELATIVE_TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2 * 2.0**-8, torch.float16: 2 * 2.0**-11}
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
# (rows, hidden, intermediate): decode batches 1/8/64, a 16 x 202-token prefill, and odd sizes for the masks
CUDA_SHAPES = [(1, 896, 4864), (8, 896, 4864), (64, 896, 4864), (16 * 202, 896, 4864), (5, 1000, 1500)]
INTERPRETER_SHAPES = [(1, 64, 96), (3, 100, 1030)]


def mismatch(name: str, ours: torch.Tensor, expected: torch.Tensor, exact: bool = False) -> bool:
    """Print the comparison; True when it fails."""
    diff = (ours.float() - expected.float()).abs()
    allowed = 0.0 if exact else RELATIVE_TOLERANCE[expected.dtype] * (1.0 + expected.float().abs())
    bad = ours.shape != expected.shape or ours.dtype != expected.dtype or bool((diff > allowed).any())
    print(f"  {name:<44} max abs diff {float(diff.max()):.3e}  {'MISMATCH' if bad else 'ok'}", flush=True)
    return bad


def graph_replay(fn: Callable[[], tuple[torch.Tensor, ...]]) -> tuple[torch.Tensor, ...]:
    """Capture `fn` in a CUDA graph (fails on a host sync) and return the outputs of one replay."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()  # warm-up outside capture: compiles the kernels
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outputs = fn()
    graph.replay()
    torch.cuda.synchronize()
    return outputs


def check(device: torch.device, dtype: torch.dtype, shape: tuple[int, int, int]) -> bool:
    from cosyvoice2.kernels import triton_kernels  # noqa: PLC0415 - after TRITON_INTERPRET is read

    rows, hidden, intermediate = shape
    generator = torch.Generator(device).manual_seed(rows * 7 + hidden)
    x = torch.randn(rows, hidden, device=device, generator=generator).to(dtype)
    residual = (3 * torch.randn(rows, hidden, device=device, generator=generator)).to(dtype)
    weight = (1 + 0.1 * torch.randn(hidden, device=device, generator=generator)).to(dtype)
    gate_up = (4 * torch.randn(rows, 2 * intermediate, device=device, generator=generator)).to(dtype)
    eps = 1e-6
    label = f"{str(dtype).removeprefix('torch.')} rows {rows}"

    def fused() -> tuple[torch.Tensor, ...]:
        return (*triton_kernels.add_rms_norm(x, residual, weight, eps), triton_kernels.silu_mul(gate_up))

    expected = (*reference.add_rms_norm(x, residual, weight, eps), reference.silu_mul(gate_up))
    names = (f"add_rms_norm norm {label} x {hidden}", f"add_rms_norm sum  {label} x {hidden}",
             f"silu_mul {label} x {intermediate}")
    exact = {1}  # the residual sum
    runs = {"eager": fused()}
    if device.type == "cuda":
        runs["graph"] = graph_replay(fused)
    failed = False
    for run, outputs in runs.items():
        for index, (name, ours, reference_out) in enumerate(zip(names, outputs, expected)):
            failed |= mismatch(f"{name} {run}", ours, reference_out, exact=index in exact)
    return failed


@torch.inference_mode()
def check_model(device: torch.device, dtype: torch.dtype) -> bool:
    """A small 2-layer LLM body through the Triton kernels (forced, so that the interpreter runs them on the CPU)
    against the same body through the reference."""
    from cosyvoice2.kernels import triton_kernels  # noqa: PLC0415

    torch.manual_seed(0)
    qwen = Qwen2Config(hidden_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                       intermediate_size=320, vocab_size=64)
    lm = CosyVoice2LM(LLMConfig(qwen=qwen, speech_token_size=40)).to(device=device, dtype=dtype).eval()
    embeds = torch.randn(2, 9, qwen.hidden_size, device=device).to(dtype)
    dispatch = cosyvoice2.kernels._implementation
    try:
        cosyvoice2.kernels._implementation = lambda tensor: triton_kernels
        fused = lm.hidden(embeds)
        cosyvoice2.kernels._implementation = lambda tensor: reference
        expected = lm.hidden(embeds)
    finally:
        cosyvoice2.kernels._implementation = dispatch
    # rounding differences of single kernels propagate through the layers: allow a few steps
    diff = float((fused.float() - expected.float()).abs().max())
    allowed = 8 * RELATIVE_TOLERANCE[dtype] * (1.0 + float(expected.float().abs().max()))
    bad = diff > allowed
    print(f"  LLM body (2 layers) {str(dtype).removeprefix('torch.'):<24} max abs diff {diff:.3e}  "
          f"{'MISMATCH' if bad else 'ok'}", flush=True)
    return bad


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtypes", help="comma-separated from fp32, bf16, fp16 (default: all on CUDA, "
                        "fp32,fp16 in the interpreter)")
    args = parser.parse_args()
    device = torch.device(args.device)
    dtypes = args.dtypes or ("fp32,bf16,fp16" if device.type == "cuda" else "fp32,fp16")
    shapes = CUDA_SHAPES if device.type == "cuda" else INTERPRETER_SHAPES
    failed = False
    for dtype in (DTYPES[name] for name in dtypes.split(",")):
        for shape in shapes:
            failed |= check(device, dtype, shape)
        failed |= check_model(device, dtype)
    print("FAILED" if failed else "all fused kernels match the reference", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
