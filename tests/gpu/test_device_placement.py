"""Engines placed on a GPU other than the process's current one (as a Triton model instance on GPU 1 of a stub
process that CUDA starts on GPU 0): their CUDA graphs capture and replay there, and nothing lands on GPU 0."""

from __future__ import annotations

import pytest
import torch

from cosyvoice2.config import EngineConfig
from cosyvoice2.loading import FLOW_FILE, HIFT_FILE, LLM_FILE, load_flow, load_hift, load_llm
from speech_lm.decode import BatchedDecoder
from cosyvoice2.testing import write_tiny_model
from speech_serving.engines import BatchedToken2Wav
from speech_serving.schedule import StreamScheduleParams


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    model_dir = write_tiny_model(tmp_path_factory.mktemp("tiny"))
    return model_dir, EngineConfig.for_model_dir(model_dir)


@pytest.fixture
def last_gpu(several_gpus: int) -> torch.device:
    torch.cuda.set_device(0)  # what CUDA gives a new process
    return torch.device("cuda", several_gpus - 1)


def test_the_llm_decoder_captures_its_step_graphs_on_its_own_gpu(tiny, last_gpu) -> None:
    from cosyvoice2.llm.request import CosyVoice2Sampling, cosyvoice2_request

    model_dir, config = tiny
    llm = load_llm(model_dir / LLM_FILE, config, last_gpu, torch.float32)
    before = torch.cuda.memory_allocated(0)
    tokens = {}
    for graphs in (False, True):
        decoder = BatchedDecoder(llm, num_slots=4, max_seq_len=256, cuda_graphs=graphs)
        sampling = CosyVoice2Sampling(seed=3, min_tokens=20, max_tokens=20)
        slot = decoder.add(cosyvoice2_request(text=[1, 2, 3, 4, 5], sampling=sampling))
        out = []
        for _ in range(20):
            out.append(decoder.step()[slot].token)
        tokens[graphs] = out
    torch.cuda.synchronize(last_gpu)
    assert tokens[True] == tokens[False]
    assert torch.cuda.memory_allocated(0) == before  # nothing of the decoder on GPU 0


def test_the_token2wav_engine_captures_its_graphs_on_its_own_gpu(tiny, last_gpu) -> None:
    model_dir, config = tiny
    flow = load_flow(model_dir / FLOW_FILE, config, last_gpu, torch.float32)
    hift = load_hift(model_dir / HIFT_FILE, config, last_gpu)
    schedule = StreamScheduleParams(first_hop=5, chunk_growth=2).schedule(config)
    engine = BatchedToken2Wav(flow, hift, config, schedule)
    before = torch.cuda.memory_allocated(0)
    count, _ = engine.capture_graphs()
    assert count > 0
    encoder_graphs = engine.engine.cached.encoder.graphs  # dropped (None) had their capture failed
    assert encoder_graphs is not None and len(encoder_graphs) == len(encoder_graphs.buckets())
    assert torch.cuda.memory_allocated(0) == before
