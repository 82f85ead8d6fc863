"""Stand-in Triton python models for `test_bls_streams.py`: a decoupled `ticker` and a `caller` that reads
ticker streams through `triton_repo.adapters.common.bls_stream`, the way the orchestrator reads the LLM."""

from __future__ import annotations

from typing import Any

import numpy as np
import triton_python_backend_utils as pb_utils

from triton_repo.adapters.common import FINAL, bls_stream, model_params, read_inputs, release_bls_streams, response, serve
from pipeline_contract import TensorSpec

STREAMS = TensorSpec("STREAMS", "INT32", (1,))
TICKS = TensorSpec("TICKS", "INT32", (1,))
TAKE = TensorSpec("TAKE", "INT32", (1,))


class Ticker:
    """Answers N with N responses, response i holding 64 copies of i, then a flag-only final one."""

    def execute(self, requests: list[Any]) -> None:
        for request in requests:
            n = int(pb_utils.get_input_tensor_by_name(request, "N").as_numpy()[0])
            sender = request.get_response_sender()
            for i in range(n):
                sender.send(pb_utils.InferenceResponse([pb_utils.Tensor("TICK", np.full(64, i, np.float32))]))
            sender.send(flags=FINAL)


class Caller:
    """Reads STREAMS ticker streams of TICKS one after the other, keeping the first TAKE responses of each
    (TAKE < TICKS leaves each stream early); answers the sum of every value it kept."""

    def initialize(self, args: dict[str, str]) -> None:
        self.ticker = model_params(args)["ticker"]

    def execute(self, requests: list[Any]) -> None:
        serve(requests, self._handle, cancellable=False)

    async def _handle(self, request: Any, sender: Any) -> None:
        inputs = read_inputs(request, (STREAMS, TICKS, TAKE))
        streams, ticks, take = (int(inputs[spec.name][0]) for spec in (STREAMS, TICKS, TAKE))
        total = 0.0
        for _ in range(streams):
            kept = 0
            async for out in bls_stream(self.ticker, {"N": np.array([ticks], np.int32)}, ["TICK"]):
                total += float(out["TICK"].sum())
                kept += 1
                if kept == take:
                    break
        sender.send(response({"TOTAL": np.array([total], np.float64)}), flags=FINAL)

    def finalize(self) -> None:
        release_bls_streams()
