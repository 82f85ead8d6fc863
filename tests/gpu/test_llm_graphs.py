"""The LLM decoder's CUDA graphs (`speech_lm.decode.BatchedDecoder`: the step and the padded prefill, one request or
a group at a time) replay what the eager passes compute: the same tokens and the same pending log-probs at every step, for requests
with different sampling settings in one batch, also with the model on a GPU that is not the current one; each step's span
on the GPU is timed there. The small
model checks the logic; the released-size body (marked slow) the real shapes. tests/engine/test_perf_decode.py
checks the eager passes themselves against row-by-row decoding on the CPU."""

from __future__ import annotations

import pytest
import torch

from cosyvoice2.llm import CosyVoice2LM, LLMConfig
from speech_lm.decode import BatchedDecoder, DecodeRequest
from tests.engine.test_perf_decode import REQUESTS, small_model


@torch.inference_mode()
def decode(model: CosyVoice2LM, requests: list[DecodeRequest], graphs: bool, together: bool = False,
           max_seq_len: int = 256) -> tuple[dict[int, list[int]], list[torch.Tensor]]:
    """(tokens per slot, the pending log-probs before every step) of `requests` decoded together; prefilled one at
    a time, or `together` (one padded group)."""
    # both prefill padded to their buckets: the eager decoder runs what the graphs capture
    decoder = BatchedDecoder(model, num_slots=4, max_seq_len=max_seq_len, cuda_graphs=graphs, padded_prefill=True)
    slots = decoder.add_many(requests) if together else [decoder.add(r) for r in requests]
    tokens: dict[int, list[int]] = {s: [] for s in slots}
    logps = []
    spans = []
    while decoder.active_slots:
        logps.append(decoder.logp.clone())
        for slot, out in decoder.step().items():
            if out.token is not None:
                tokens[slot].append(out.token)
        spans.append(decoder.last_step_device_seconds)
    # every step's span on the GPU was timed by events on the model's GPU (a step's tokens are read after its end)
    assert all(0 < span < 1 for span in spans[:-1]), spans
    return tokens, logps


def assert_replays_equal_eager(model: CosyVoice2LM, requests: list[DecodeRequest], together: bool = False) -> None:
    eager_tokens, eager_logps = decode(model, requests, graphs=False, together=together)
    graph_tokens, graph_logps = decode(model, requests, graphs=True, together=together)
    assert graph_tokens == eager_tokens
    assert len(graph_logps) == len(eager_logps)
    assert all(torch.equal(a, b) for a, b in zip(eager_logps, graph_logps))


@pytest.mark.parametrize("together", [False, True], ids=["one-by-one", "grouped-prefill"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_step_graph_replays_match_eager_steps(gpus, dtype, together) -> None:
    assert_replays_equal_eager(small_model().to("cuda", dtype), REQUESTS, together)


def test_graph_replays_match_eager_passes_on_the_last_gpu(gpus) -> None:
    """Captured and replayed while GPU 0 is the current device: every graph must be made on the model's GPU."""
    with torch.cuda.device(0):
        assert_replays_equal_eager(small_model().to(f"cuda:{gpus - 1}", torch.bfloat16), REQUESTS, together=True)
    assert torch.cuda.current_device() == 0


@pytest.mark.slow
def test_released_size_step_graph_replays_match_eager_steps(gpus) -> None:
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = CosyVoice2LM(LLMConfig()).to(torch.bfloat16).eval()
    assert_replays_equal_eager(model, REQUESTS)
