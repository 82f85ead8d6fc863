"""The LLM decoder's step CUDA graphs (`speech_lm.decode.BatchedDecoder`) replay what the eager step
computes: the same tokens and the same pending log-probs at every step, for requests with different sampling
settings in one batch. The small model checks the logic; the released-size body (marked slow) the real shapes.
tests/engine/test_perf_decode.py checks the eager step itself against row-by-row decoding on the CPU."""

from __future__ import annotations

import pytest
import torch

from cosyvoice2.llm import CosyVoice2LM, LLMConfig
from speech_lm.decode import BatchedDecoder, DecodeRequest
from tests.engine.test_perf_decode import REQUESTS, small_model


@torch.inference_mode()
def decode(model: CosyVoice2LM, requests: list[DecodeRequest], graphs: bool,
           max_seq_len: int = 256) -> tuple[dict[int, list[int]], list[torch.Tensor]]:
    """(tokens per slot, the pending log-probs before every step) of `requests` decoded together."""
    decoder = BatchedDecoder(model, num_slots=4, max_seq_len=max_seq_len, cuda_graphs=graphs)
    slots = [decoder.add(r) for r in requests]
    tokens: dict[int, list[int]] = {s: [] for s in slots}
    logps = []
    while decoder.active_slots:
        logps.append(decoder.logp.clone())
        for slot, out in decoder.step().items():
            if out.token is not None:
                tokens[slot].append(out.token)
    return tokens, logps


def assert_replays_equal_eager(model: CosyVoice2LM, requests: list[DecodeRequest]) -> None:
    eager_tokens, eager_logps = decode(model, requests, graphs=False)
    graph_tokens, graph_logps = decode(model, requests, graphs=True)
    assert graph_tokens == eager_tokens
    assert len(graph_logps) == len(eager_logps)
    assert all(torch.equal(a, b) for a, b in zip(eager_logps, graph_logps))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_step_graph_replays_match_eager_steps(gpus, dtype) -> None:
    assert_replays_equal_eager(small_model().to("cuda", dtype), REQUESTS)


@pytest.mark.slow
def test_released_size_step_graph_replays_match_eager_steps(gpus) -> None:
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = CosyVoice2LM(LLMConfig()).to(torch.bfloat16).eval()
    assert_replays_equal_eager(model, REQUESTS)
