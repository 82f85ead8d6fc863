"""Every fused Triton kernel (`speech_lm.kernels.triton_kernels`) equals its PyTorch reference, alone (eager calls
and CUDA-graph replays, at the LLM's decode and prefill shapes), inside a small LLM body and inside a tiny UNet flow
call.

Tolerances: the residual sums must be bit-exact; normalised and SiLU outputs may differ by about one rounding
step of the dtype (fp32 sums and exp are evaluated in a different order). The comparison helpers here also serve the
CPU run through Triton's interpreter (`interpreted_results`, driven by tests/engine/test_llm_kernels.py), which checks
fp32 and fp16 only: it converts fp32 to bf16 by truncation where the GPU rounds to nearest even, so its bf16 results
are not the GPU's."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import pytest
import torch

import speech_lm.kernels
from speech_lm.kernels import reference
from cosyvoice2.llm import CosyVoice2LM, LLMConfig
from speech_lm.config import Qwen2Config

RELATIVE_TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2 * 2.0**-8, torch.float16: 2 * 2.0**-11}
# (rows, hidden, intermediate): decode batches 1/8/64, a 16 x 202-token prefill, and odd sizes for the masks
CUDA_SHAPES = [(1, 896, 4864), (8, 896, 4864), (64, 896, 4864), (16 * 202, 896, 4864), (5, 1000, 1500)]
INTERPRETER_SHAPES = [(1, 64, 96), (3, 100, 1030)]
INTERPRETER_DTYPES = (torch.float32, torch.float16)


@dataclass(frozen=True)
class Comparison:
    name: str
    max_abs_diff: float
    matches: bool


def compare(name: str, ours: torch.Tensor, expected: torch.Tensor, exact: bool = False) -> Comparison:
    """Shape, dtype and values of `ours` against `expected` (within one rounding step of the dtype, or exactly)."""
    diff = (ours.float() - expected.float()).abs()
    allowed = 0.0 if exact else RELATIVE_TOLERANCE[expected.dtype] * (1.0 + expected.float().abs())
    bad = ours.shape != expected.shape or ours.dtype != expected.dtype or bool((diff > allowed).any())
    return Comparison(name, float(diff.max()), not bad)


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


def kernel_comparisons(device: torch.device, dtype: torch.dtype, shape: tuple[int, int, int]) -> list[Comparison]:
    """add_rms_norm (normalised output and residual sum) and silu_mul against the reference: eager, and on CUDA
    also one CUDA-graph replay."""
    from speech_lm.kernels import triton_kernels  # noqa: PLC0415 - after TRITON_INTERPRET is read

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
    names = (f"add_rms_norm norm {label} x {hidden}", f"add_rms_norm sum {label} x {hidden}",
             f"silu_mul {label} x {intermediate}")
    exact = {1}  # the residual sum
    runs = {"eager": fused()}
    if device.type == "cuda":
        runs["graph"] = graph_replay(fused)
    return [compare(f"{name} {run}", ours, reference_out, exact=index in exact)
            for run, outputs in runs.items()
            for index, (name, ours, reference_out) in enumerate(zip(names, outputs, expected))]


@torch.inference_mode()
def model_comparison(device: torch.device, dtype: torch.dtype) -> Comparison:
    """A small 2-layer LLM body through the Triton kernels (forced, so that the interpreter runs them on the CPU)
    against the same body through the reference."""
    from speech_lm.kernels import triton_kernels  # noqa: PLC0415

    torch.manual_seed(0)
    qwen = Qwen2Config(hidden_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                       intermediate_size=320, vocab_size=64)
    lm = CosyVoice2LM(LLMConfig(qwen=qwen, speech_token_size=40)).to(device=device, dtype=dtype).eval()
    embeds = torch.randn(2, 9, qwen.hidden_size, device=device).to(dtype)
    dispatch = speech_lm.kernels._implementation
    try:
        speech_lm.kernels._implementation = lambda tensor: triton_kernels
        fused = lm.hidden(embeds)
        speech_lm.kernels._implementation = lambda tensor: reference
        expected = lm.hidden(embeds)
    finally:
        speech_lm.kernels._implementation = dispatch
    # rounding differences of single kernels propagate through the layers: allow a few steps
    diff = float((fused.float() - expected.float()).abs().max())
    allowed = 8 * RELATIVE_TOLERANCE[dtype] * (1.0 + float(expected.float().abs().max()))
    return Comparison(f"LLM body (2 layers) {str(dtype).removeprefix('torch.')}", diff, diff <= allowed)


def copy_comparisons(device: torch.device, dtype: torch.dtype, graph: bool = False) -> list[Comparison]:
    """`copy_runs` against PyTorch's copy on the flow's key/value layouts (blocks, k/v, rows, heads, frames, d),
    scaled down: a voice prefix broadcast to consecutive rows, one row's own history at an offset, a row's kept new
    frames into a fresh tensor, and layouts the kernel hands to PyTorch (short runs, contiguous). The whole
    destination must equal PyTorch's result (nothing written outside the view). `graph`: one CUDA-graph replay."""
    from speech_lm.kernels import triton_kernels  # noqa: PLC0415 - after TRITON_INTERPRET is read

    generator = torch.Generator(device).manual_seed(5)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, device=device, generator=generator).to(dtype)

    blocks, rows, heads, frames, d = 3, 6, 4, 48, 16
    buffer, piece, kv = rand(blocks, 2, rows, heads, frames, d), rand(blocks, 2, 2, heads, 20, d), rand(blocks, 2, rows, heads, 30, d)
    frames_major = rand(blocks, 2, rows, frames, heads, d)
    cases = {
        "prefix broadcast": (buffer, lambda t: t[:, :, 1:4, :, :20], piece[:, :, 0:1]),
        "own history at an offset": (buffer, lambda t: t[:, :, 5, :, 20:40], piece[:, :, 1]),
        "kept frames": (torch.zeros(blocks, 2, 2, heads, 25, d, device=device, dtype=dtype),
                        lambda t: t[:, :, 1], kv[:, :, 3, :, :25]),
        # the cached flow's layout: (blocks, k/v, rows, frames, heads, d), a voice prefix into rows 1-3, and one
        # block's new keys (rows, N, heads, d) behind a history of 20 frames
        "frames-major prefix broadcast": (frames_major, lambda t: t[:, :, 1:4, :20],
                                          rand(blocks, 2, 2, 20, heads, d)[:, :, 0:1]),
        "frames-major new keys": (frames_major, lambda t: t[2, 0, :, 20:48], rand(rows, 28, heads, d)),
        "short runs (PyTorch)": (buffer, lambda t: t[:, :, 2, :, :3], piece[:, :, 0, :, :3]),
        "contiguous (PyTorch)": (rand(4, 300), lambda t: t, rand(4, 300)),
    }
    results = []
    for name, (target, view, source) in cases.items():
        by_kernel = triton_kernels._runs(view(target), source.expand_as(view(target))) is not None
        assert by_kernel == ("PyTorch" not in name), name  # the cases test what they say they test
        expected, ours = target.clone(), target.clone()
        view(expected).copy_(source)
        if graph:
            graph_replay(lambda: (triton_kernels.copy_runs(view(ours), source), ours)[1:])
        else:
            triton_kernels.copy_runs(view(ours), source)
        results.append(compare(f"copy_runs {name} {str(dtype).removeprefix('torch.')}{' graph' if graph else ''}",
                               ours, expected, exact=True))
    return results


def row_comparisons(device: torch.device, dtype: torch.dtype, graph: bool = False) -> list[Comparison]:
    """`gather_rows` / `scatter_rows` against `index_select` / `index_copy_` along dim 1 on the packed flow's
    layouts, scaled down: a causal conv's windows (3 per frame, rows repeated, a width that is no power of two), the
    rows' tails, every block's new keys out of the key buffer, the new keys/values written from the qkv projection
    (a view whose rows are 3 x wider apart than they are long), and a layout the kernel hands to PyTorch (columns
    not contiguous). The whole destination must equal PyTorch's result. `graph`: one CUDA-graph replay."""
    from speech_lm.kernels import triton_kernels  # noqa: PLC0415 - after TRITON_INTERPRET is read

    generator = torch.Generator(device).manual_seed(7)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, device=device, generator=generator).to(dtype)

    def positions(count: int, size: int, unique: bool = False) -> torch.Tensor:
        picks = torch.randperm(size, generator=generator, device=device)[:count] if unique else \
            torch.randint(0, size, (count,), generator=generator, device=device)
        return picks.to(torch.long)

    seq, keys, qkv = rand(2, 4 + 50, 40), rand(3 * 2 * 2, 90, 64), rand(2, 50, 3, 4, 16)
    gathers = {
        "conv windows": (seq, positions(3 * 50, 54)),
        "conv tails": (seq, positions(4, 54)),
        "new keys of every block": (keys, positions(50, 90, unique=True)),
        "columns not contiguous (PyTorch)": (seq.transpose(1, 2).contiguous().transpose(1, 2), positions(20, 54)),
    }
    results = []
    kind = f"{str(dtype).removeprefix('torch.')}{' graph' if graph else ''}"
    for name, (source, index) in gathers.items():
        expected = source.index_select(1, index)
        if graph:
            (ours,) = graph_replay(lambda: (triton_kernels.gather_rows(source, index),))
        else:
            ours = triton_kernels.gather_rows(source, index)
        results.append(compare(f"gather_rows {name} {kind}", ours, expected, exact=True))
    for j in (1, 2):  # keys, then values: rows of 64 that lie 192 apart
        source, index = qkv[:, :, j].flatten(2), positions(50, 90, unique=True)
        target = rand(2, 90, 64)
        expected, ours = target.clone(), target.clone()
        expected.index_copy_(1, index, source)
        if graph:
            graph_replay(lambda: (triton_kernels.scatter_rows(ours, index, source), ours)[1:])
        else:
            triton_kernels.scatter_rows(ours, index, source)
        results.append(compare(f"scatter_rows new {'keys' if j == 1 else 'values'} {kind}", ours, expected,
                               exact=True))
    return results


def interpreted_results() -> list[Comparison]:
    """Every comparison at the interpreter's shapes and dtypes on the CPU (run with TRITON_INTERPRET=1)."""
    device = torch.device("cpu")
    return [result for dtype in INTERPRETER_DTYPES
            for result in [*(c for shape in INTERPRETER_SHAPES for c in kernel_comparisons(device, dtype, shape)),
                           model_comparison(device, dtype), *copy_comparisons(device, dtype),
                           *row_comparisons(device, dtype)]
            ] + [flow_comparison(device, torch.float32)]


def assert_all_match(results: list[Comparison]) -> None:
    bad = [f"{r.name}: max abs diff {r.max_abs_diff:.3e}" for r in results if not r.matches]
    assert not bad, bad


DTYPES = pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["fp32", "bf16", "fp16"])


@DTYPES
@pytest.mark.parametrize("shape", CUDA_SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_fused_kernels_match_the_reference_eager_and_replayed(gpus, dtype, shape) -> None:
    pytest.importorskip("triton")
    assert_all_match(kernel_comparisons(torch.device("cuda"), dtype, shape))


@DTYPES
def test_an_llm_body_through_the_fused_kernels_matches_the_reference(gpus, dtype) -> None:
    pytest.importorskip("triton")
    assert_all_match([model_comparison(torch.device("cuda"), dtype)])


@pytest.mark.parametrize("comparisons", [copy_comparisons, row_comparisons], ids=["copy_runs", "rows"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_copy_kernels_match_pytorch_eager_and_replayed_on_every_gpu(gpus, dtype, comparisons) -> None:
    """`copy_runs`, `gather_rows` and `scatter_rows` on each GPU of the machine with GPU 0 current: a kernel must
    launch on its tensors' device."""
    pytest.importorskip("triton")
    for index in range(gpus):
        device = torch.device("cuda", index)
        assert_all_match(comparisons(device, dtype))
        with torch.cuda.device(device):
            assert_all_match(comparisons(device, dtype, graph=True))


@torch.inference_mode()
def flow_comparison(device: torch.device, dtype: torch.dtype) -> Comparison:
    """A tiny UNet flow's cached call of two rows at different points through the Triton kernels (its packed rows'
    gathers and scatters; forced, so that the interpreter runs them on the CPU) against the same call through the
    reference."""
    from speech_lm.kernels import triton_kernels  # noqa: PLC0415
    from cosyvoice2.flow.cached import CachedFlowRunner, CachedRow, CachedSegment
    from cosyvoice2.testing.models import tiny_config
    from tests.gpu.test_flow_cache import random_flow, stream_inputs

    flow = random_flow(tiny_config().flow, device).to(dtype)
    flow.decoder.rand_noise = flow.decoder.rand_noise.float()
    runner = CachedFlowRunner(flow, graphs=False)
    prompt, prompt_mel, xvector, speech = stream_inputs(flow, 60, 80, 2)
    spks = runner.project_speaker(xvector.to(dtype))[0]
    prefix = runner.prefix(prompt, prompt_mel.to(dtype), spks)
    own = CachedSegment()
    runner.run([CachedRow(torch.cat([prompt, speech[0]]), prompt_mel.to(dtype), spks, prefix, own, stop=110,
                          final=False, keep=True)])

    def rows() -> list[CachedRow]:
        return [CachedRow(torch.cat([prompt, speech[0]]), prompt_mel.to(dtype), spks, prefix, own, stop=135,
                          final=False, keep=False),
                CachedRow(torch.cat([prompt, speech[1]]), prompt_mel.to(dtype), spks, prefix, CachedSegment(),
                          stop=80, final=True, keep=False)]

    dispatch = speech_lm.kernels._implementation
    try:
        speech_lm.kernels._implementation = lambda tensor: triton_kernels
        fused = runner.run_pending(rows())[0]
        speech_lm.kernels._implementation = lambda tensor: reference
        expected = runner.run_pending(rows())[0]
    finally:
        speech_lm.kernels._implementation = dispatch
    diff = max(float((a - b).abs().max()) for a, b in zip(fused, expected))
    scale = max(float(b.abs().max()) for b in expected)
    # the kernels move values unchanged; the margin is for the network's own kernels, which need not sum in the same
    # order on two runs (cuBLAS on a GPU), through 10 Euler steps
    allowed = 16 * RELATIVE_TOLERANCE[dtype] * (1.0 + scale)
    return Comparison(f"UNet flow call {str(dtype).removeprefix('torch.')}", diff, diff <= allowed)


@DTYPES
def test_a_flow_call_through_the_fused_kernels_matches_the_reference(gpus, dtype) -> None:
    pytest.importorskip("triton")
    assert_all_match([flow_comparison(torch.device("cuda"), dtype)])
