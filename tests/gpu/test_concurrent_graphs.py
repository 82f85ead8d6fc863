"""Graphs of the two workers of one process (the LLM's and token2wav's), replayed at the same time on their two
streams, give what each gives alone.

Both are captured in one thread (a model's `initialize`), so they use one cuBLAS handle; cuBLAS and cuBLASLt bind
their workspace to (handle, stream), and a graph keeps the workspace of its capture. Captured on one stream, the
two workers' GEMMs shared one workspace while replaying concurrently (`speech_lm.graph_buckets.capture_stream`).
The GEMMs here have the shapes of the LLM's decode step (few rows, long reduction: split-K kernels that use the
workspace) and of a token2wav estimator call, on the machine's last GPU."""

from __future__ import annotations

import threading

import torch

from speech_lm.graph_buckets import LLM_GRAPHS, TOKEN2WAV_GRAPHS, capture

REPLAYS = 300


def gemm_chain(rows: int, inner: int, outer: int, device: torch.device, seed: int):
    """A pass of two bf16 GEMMs with static inputs, and where its output lands."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    x = torch.randn(rows, inner, generator=gen).to(device, torch.bfloat16)
    w1 = (torch.randn(inner, outer, generator=gen) / inner**0.5).to(device, torch.bfloat16)
    w2 = (torch.randn(outer, inner, generator=gen) / outer**0.5).to(device, torch.bfloat16)
    return lambda: (x @ w1).relu() @ w2


def replay_many(graph: torch.cuda.CUDAGraph, output: torch.Tensor, stream: torch.cuda.Stream,
                kept: list[torch.Tensor], start: threading.Barrier) -> None:
    with torch.cuda.stream(stream):
        start.wait()
        for _ in range(REPLAYS):
            graph.replay()
            kept.append(output.clone())  # queued on the stream: this replay's result, without a host wait
    stream.synchronize()


def test_the_two_workers_graphs_replayed_together_equal_each_alone(gpus) -> None:
    device = torch.device("cuda", gpus - 1)
    with torch.cuda.device(device):
        llm_pass = gemm_chain(16, 4864, 896, device, seed=1)  # the decode step's MLP: 16 rows, K = 4864
        t2w_pass = gemm_chain(4096, 1024, 256, device, seed=2)  # an estimator call: 2 x 8 rows x 256 frames
        llm_graph, llm_out = capture(llm_pass, device, torch.cuda.graph_pool_handle(), LLM_GRAPHS)
        t2w_graph, t2w_out = capture(t2w_pass, device, torch.cuda.graph_pool_handle(), TOKEN2WAV_GRAPHS)
        llm_graph.replay()
        t2w_graph.replay()
        torch.cuda.synchronize(device)
        alone = llm_out.clone(), t2w_out.clone()
        kept: tuple[list[torch.Tensor], list[torch.Tensor]] = ([], [])
        start = threading.Barrier(2)
        workers = [threading.Thread(target=replay_many, args=(graph, out, torch.cuda.Stream(device, priority=p),
                                                              kept[i], start))
                   for i, (graph, out, p) in enumerate(((llm_graph, llm_out, -1), (t2w_graph, t2w_out, -2)))]
        for worker in workers:
            worker.start()
        for worker in workers:
            worker.join(120)
        torch.cuda.synchronize(device)
    for reference, results in zip(alone, kept, strict=True):
        assert len(results) == REPLAYS
        # a reduction split over blocks may add in another order from one replay to the next (last bf16 bits); a
        # workspace shared with the other worker's GEMM mixes in its partial sums (errors of the values' own size)
        worst = max(float((result.float() - reference.float()).abs().max()) for result in results)
        assert worst <= 1e-2 * float(reference.float().abs().max()), worst
