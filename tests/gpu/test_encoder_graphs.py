"""The cached flow's encoder pass replayed from its CUDA graphs (`cosyvoice2.flow.cached_encoder.EncoderGraphs`)
equals the eager, unpadded pass, with the flow on the last GPU while GPU 0 is the current device (the graphs must
be captured and replayed on the tensors' own GPU)."""

from __future__ import annotations

import torch

from cosyvoice2.flow.cached import CachedFlowRunner
from cosyvoice2.testing.models import tiny_config
from tests.engine.test_encoder_graphs import assert_close, assert_rows_equal_alone, mixed_rows
from tests.gpu.test_flow_cache import random_flow


@torch.inference_mode()
def test_encoder_replays_equal_the_eager_pass_on_the_last_gpu(gpus, no_tf32) -> None:
    device = torch.device("cuda", gpus - 1)
    with torch.cuda.device(0):
        flow = random_flow(tiny_config().flow, device)
        eager = CachedFlowRunner(flow, graphs=False)
        graphed = CachedFlowRunner(flow)
        graphs = graphed.encoder.graphs
        graphs.history_tokens = (64, 128, 256)  # fewer captures; the mixed rows' history is at most 150
        every = len(graphs.rows) * len(graphs.new_tokens) * len(graphs.history_tokens)
        assert graphs.capture_all(device, torch.float32) == len(graphs.buckets()) == every
        replays = []
        run = graphs.run
        graphs.run = lambda shape, *args: replays.append(shape) or run(shape, *args)
        rows = mixed_rows(eager)
        assert_rows_equal_alone(graphed, eager, rows, 128)
        assert_rows_equal_alone(graphed, eager, rows[::-1], 128)
        assert_rows_equal_alone(graphed, eager, rows[2:3], 128)
        assert_rows_equal_alone(graphed, eager, rows[:2], 64)
        rows_bucket = lambda n: min(r for r in graphs.rows if r >= n)  # noqa: E731 - the smallest that holds n
        assert replays == [(rows_bucket(6), 128, 256), (rows_bucket(6), 128, 256), (rows_bucket(1), 128, 256),
                           (rows_bucket(2), 64, 64)]
        # the whole call - encoder replay, then the packed Euler solve - equals the eager flow (over 10 Euler steps,
        # as tests/gpu/test_flow_cache.py). In float32 the solve runs eagerly (its graphs need flash attention, so
        # half precision: tests/gpu/test_flow_packed.py replays them), which this checks too.
        mels = [runner.run_pending(rows)[0] for runner in (graphed, eager)]
        for got, ref in zip(*mels):
            assert_close(got, ref, "mel", tolerance=5e-5)
        assert graphed.solve_graphs is not None and not graphed.solve_graphs._captured
    torch.cuda.synchronize(device)
