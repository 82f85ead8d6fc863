"""CosyVoice3 beside CosyVoice2 in ONE tritonserver: `render --cosyvoice3-dir` with a tiny random CosyVoice3 model
next to the tiny CosyVoice2 model (CPU): the contract's models of both, the three voice modes, streaming over the
cached and the recompute flow paths, per-model voice caches, and the gateway in front (the real OpenAI SDK)."""

from __future__ import annotations

import asyncio
import re

import numpy as np
import pytest
import tritonclient.grpc.aio as aio
from tritonclient.utils import InferenceServerException

import pipeline_contract as contract
from cosyvoice3.testing import write_tiny_model
from tests.gateway.audio_checks import decode
from tests.gateway.voice_clips import make_clip, upload
from tests.triton.conftest import FIRST_HOP, SAMPLES_PER_TOKEN, synthesis_inputs
from triton_repo.render import CosyVoice3RenderOptions, RenderError, RenderOptions, write_repository

pytestmark = pytest.mark.triton

TEXT = "Hello world, the tiny CosyVoice3 model speaks."
#: small chunks so that a short utterance streams several
COSYVOICE3 = dict(first_hop=5, second_hop=6)


@pytest.fixture(scope="session")
def cosyvoice3_dir(tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp("cosyvoice3_model"), seed=3)


def _render(model_dir, cv3_dir, out, **cv3):
    return write_repository(RenderOptions(
        model_dir=model_dir, out=out, max_batch=8, max_seq_len=2048, first_hop=FIRST_HOP,
        cosyvoice3=CosyVoice3RenderOptions(cv3_dir, **{**COSYVOICE3, **cv3}),
    ))  # fmt: skip


@pytest.fixture(scope="module")
def both_server(tiny_model_dir, cosyvoice3_dir, tmp_path_factory, triton_server_factory):
    """CosyVoice2 and CosyVoice3 (cached streaming flow, the default) in one tritonserver."""
    server = triton_server_factory(_render(tiny_model_dir, cosyvoice3_dir, tmp_path_factory.mktemp("cv3") / "repo"),
                                   ready_timeout=240)
    yield server
    server.cleanup()


async def _offline(url, model, inputs):
    async with aio.InferenceServerClient(url) as client:
        result = await client.infer(model, inputs)
    return (result.as_numpy(contract.WAVEFORM.name), int(result.as_numpy(contract.INPUT_TOKENS.name)[0]),
            int(result.as_numpy(contract.OUTPUT_TOKENS.name)[0]), int(result.as_numpy(contract.SAMPLE_RATE.name)[0]))


async def _stream(url, inputs, model=contract.COSYVOICE3_STREAMING_MODEL):
    async def requests():
        yield {"model_name": model, "inputs": inputs}

    out = []
    async with aio.InferenceServerClient(url) as client:
        async for result, error in client.stream_infer(requests()):
            if error is not None:
                raise error
            final = result.get_response().parameters["triton_final_response"].bool_param
            out.append((result.as_numpy(contract.WAVEFORM.name), int(result.as_numpy(contract.OUTPUT_TOKENS.name)[0]),
                        int(result.as_numpy(contract.SAMPLE_RATE.name)[0]), final))
            if final:
                break
    return out


async def test_offline_is_24k_with_960_samples_per_token(both_server):
    waveform, _, tokens, rate = await _offline(both_server.grpc_url, contract.COSYVOICE3_OFFLINE_MODEL,
                                               synthesis_inputs(TEXT, seed=3))
    assert rate == 24_000 and tokens > 0 and waveform.size == tokens * SAMPLES_PER_TOKEN
    assert np.isfinite(waveform).all() and np.abs(waveform).max() > 0
    again, *_ = await _offline(both_server.grpc_url, contract.COSYVOICE3_OFFLINE_MODEL, synthesis_inputs(TEXT, seed=3))
    np.testing.assert_array_equal(again, waveform)  # the seed reproduces a request (its voice now cached)
