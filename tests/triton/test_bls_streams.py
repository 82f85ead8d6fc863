"""`bls_stream` on a real tritonserver, with stand-in models (`bls_stream_models.py`): many concurrent decoupled
BLS streams, read to the end or left early. Triton 2.51's stub (the one `nvidia-pytriton` ships) used to die
in native code here after a few dozen requests (heap corruption: it freed finished streams off the GIL)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc.aio as aio

pytestmark = pytest.mark.triton

TICKER = """
name: "ticker"
backend: "python"
max_batch_size: 0
model_transaction_policy { decoupled: true }
input [ { name: "N" data_type: TYPE_INT32 dims: [1] } ]
output [ { name: "TICK" data_type: TYPE_FP32 dims: [64] } ]
instance_group [ { kind: KIND_CPU count: 1 } ]
"""

CALLER = """
name: "caller"
backend: "python"
max_batch_size: 0
input [
  { name: "STREAMS" data_type: TYPE_INT32 dims: [1] },
  { name: "TICKS" data_type: TYPE_INT32 dims: [1] },
  { name: "TAKE" data_type: TYPE_INT32 dims: [1] }
]
output [ { name: "TOTAL" data_type: TYPE_FP64 dims: [1] } ]
parameters { key: "ticker" value: { string_value: "ticker" } }
instance_group [ { kind: KIND_CPU count: 1 } ]
"""


def _write_repo(root: Path) -> Path:
    for name, config in (("ticker", TICKER), ("caller", CALLER)):
        (root / name / "1").mkdir(parents=True)
        (root / name / "config.pbtxt").write_text(config)
        cls = name.capitalize()
        (root / name / "1" / "model.py").write_text(
            f"from tests.triton.bls_stream_models import {cls} as TritonPythonModel  # noqa: F401\n"
        )
    return root


@pytest.fixture(scope="module")
def bls_server(tmp_path_factory, triton_server_factory):
    server = triton_server_factory(_write_repo(tmp_path_factory.mktemp("bls") / "repo"))
    yield server
    server.cleanup()


def _expected(streams: int, ticks: int, take: int) -> float:
    kept = min(take, ticks)
    return float(streams * 64 * sum(range(kept)))


async def _call(client: aio.InferenceServerClient, streams: int, ticks: int, take: int) -> float:
    inputs = []
    for name, value in (("STREAMS", streams), ("TICKS", ticks), ("TAKE", take)):
        tensor = aio.InferInput(name, [1], "INT32")
        tensor.set_data_from_numpy(np.array([value], np.int32))
        inputs.append(tensor)
    result = await client.infer("caller", inputs, client_timeout=60)
    return float(result.as_numpy("TOTAL")[0])


async def _hammer(server, concurrency: int, rounds: int, streams: int, ticks: int, take: int) -> list[float]:
    async with aio.InferenceServerClient(server.grpc_url) as client:
        totals: list[float] = []
        for _ in range(rounds):
            totals += await asyncio.gather(*(_call(client, streams, ticks, take) for _ in range(concurrency)))
        return totals


def _assert_stub_alive(server) -> None:
    log = server.log_tail(400)
    assert "Fatal Python error" not in log and "malloc()" not in log, log
    assert server.is_ready()


async def test_many_concurrent_streams_are_read_whole_and_in_order(bls_server):
    # 16 x 25 requests x 10 streams: before the fix the stub crashed within ~50 requests here.
    totals = await _hammer(bls_server, concurrency=16, rounds=25, streams=10, ticks=6, take=6)
    assert totals == [_expected(10, 6, 6)] * 400
    _assert_stub_alive(bls_server)


async def test_streams_left_early_do_not_break_later_ones(bls_server):
    # Each stream is left after 2 of its 40 responses; the reader drains the rest on its own.
    early = await _hammer(bls_server, concurrency=8, rounds=10, streams=5, ticks=40, take=2)
    assert early == [_expected(5, 40, 2)] * 80
    whole = await _hammer(bls_server, concurrency=8, rounds=2, streams=5, ticks=7, take=7)
    assert whole == [_expected(5, 7, 7)] * 16
    _assert_stub_alive(bls_server)
