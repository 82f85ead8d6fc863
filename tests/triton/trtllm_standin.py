"""A python stand-in behind the rendered `tensorrt_llm` model config (same inputs, outputs, batching and
decoupled policy; only `backend` differs) for the conformance test: Triton validates every request the
orchestrators send against that config, and this model writes each request's tensors to `record_dir` so the
test can hold them against the backend's fact table.

Answers like the tensorrtllm backend with exclude_input_in_output: a generation request gets a few responses of
new ids (speech ids taken from the prompt's own speech part, then the request's `end_id`); a `stop` request
gets one empty final response.
"""

from __future__ import annotations

import secrets
from pathlib import Path
from typing import Any

import numpy as np
import triton_python_backend_utils as pb_utils

from triton_repo.adapters.common import FINAL, model_config, model_params

SPEECH_IDS = 12  # generated before the end id


class TritonPythonModel:
    def initialize(self, args: dict[str, str]) -> None:
        self.record_dir = Path(model_params(args)["record_dir"])
        self.inputs = [tensor["name"] for tensor in model_config(args)["input"]]

    def execute(self, requests: list[Any]) -> None:
        for request in requests:
            arrays = {}
            for name in self.inputs:
                tensor = pb_utils.get_input_tensor_by_name(request, name)
                if tensor is not None:
                    arrays[name] = tensor.as_numpy()
            # Written under a temporary name and renamed, so a reader never sees a half-written file (the
            # stop request can arrive while the test is already reading the directory).
            name = secrets.token_hex(8)
            partial = self.record_dir / f"{name}.partial"
            with partial.open("wb") as out:
                np.savez(out, **arrays)
            partial.rename(self.record_dir / f"{name}.npz")
            sender = request.get_response_sender()
            if "stop" in arrays and bool(arrays["stop"].reshape(-1)[0]):
                sender.send(flags=FINAL)
                continue
            prompt = arrays["input_ids"].reshape(-1)
            end_id = int(arrays["end_id"].reshape(-1)[0])
            ids = [int(i) for i in prompt[-SPEECH_IDS:]] + [end_id]
            for start in range(0, len(ids), 5):
                part = np.array(ids[start : start + 5], np.int32)
                sender.send(
                    pb_utils.InferenceResponse(
                        [
                            pb_utils.Tensor("output_ids", part.reshape(1, 1, -1)),
                            pb_utils.Tensor("sequence_length", np.array([[part.size]], np.int32)),
                        ]
                    )
                )
            sender.send(flags=FINAL)
