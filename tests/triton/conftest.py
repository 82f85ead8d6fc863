"""The real pipeline (tiny random model, PyTorch LLM, CPU, default = colocated layout) in one tritonserver
shared by the session's tests."""

from __future__ import annotations

import asyncio
import importlib
import re
import sys
import time
import types
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

import pipeline_contract as contract
from triton_repo.render import RenderOptions, write_repository
from triton_repo.server import TritonServer

FIRST_HOP = 5
SAMPLES_PER_TOKEN = 960  # 2 mel frames x 480 samples at 24 kHz


@dataclass
class Pipeline:
    server: TritonServer
    repo: Path
    llm_model: str  # the model label of the llm_* metrics
    token2wav_model: str  # ... and of the token2wav_* metrics

    def metrics(self) -> dict[tuple[str, str], float]:
        """(stat, model) -> value of every `cosyvoice2_*` metric."""
        text = urllib.request.urlopen(self.server.metrics_url).read().decode()
        out = {}
        for name, model, value in re.findall(r'^cosyvoice2_(\w+)\{model="(\w+)"\} (\S+)$', text, re.M):
            out[(name, model)] = float(value)
        return out


def synthesis_inputs(
    text: str,
    voice: str = "voice-a",
    seed: int | None = 1,
    seconds: float = 1.0,
    reference_text: str = "a reference",
    instruction: str | None = None,
    by_id: bool = False,
) -> list:
    """One request's inputs; `by_id`: naming the voice by id alone (no reference audio)."""
    wav = (np.random.default_rng(len(voice)).standard_normal(int(16000 * seconds)) * 0.1).astype(np.float32)
    request = contract.SpeechRequest(wav, reference_text, text, voice, seed, instruction or "")
    return contract.grpc_inputs(contract.id_only(request) if by_id else request)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    from cosyvoice2.testing import write_tiny_model

    return write_tiny_model(tmp_path_factory.mktemp("tiny_model"))


def colocated_pipeline(model_dir: Path, out: Path, server_factory, **options) -> Pipeline:
    """The tiny model's colocated pipeline (the test default: 8 LLM slots, first hop FIRST_HOP) with `options`
    (other `RenderOptions` fields) rendered into `out`, on a started tritonserver."""
    repo = write_repository(
        RenderOptions(model_dir=model_dir, out=out, max_batch=8, max_seq_len=2048, first_hop=FIRST_HOP, **options)
    )
    server = server_factory(repo, ready_timeout=240)
    return Pipeline(server=server, repo=repo, llm_model=contract.STREAMING_MODEL, token2wav_model=contract.STREAMING_MODEL)


@pytest.fixture(scope="session")
def pipeline(tiny_model_dir, tmp_path_factory, triton_server_factory) -> Pipeline:
    return colocated_pipeline(tiny_model_dir, tmp_path_factory.mktemp("pipeline") / "repo", triton_server_factory)


@pytest.fixture(scope="module")
def both_gateway(both_server, gateway_factory):
    """A gateway in front of the module's `both_server` (CosyVoice2 and another model in one tritonserver)."""
    return gateway_factory(both_server.grpc_url)


async def offline_chunk(url: str, model: str, inputs) -> contract.SpeechChunk:
    """The one response of an offline request to `model`, through the contract's codec."""
    import tritonclient.grpc.aio as aio  # noqa: PLC0415 - the tests' own client

    async with aio.InferenceServerClient(url) as client:
        result = await client.infer(model, inputs)
    return contract.decode_response(result.as_numpy, final=True)


async def streamed_chunks(client, model: str, inputs) -> list[contract.SpeechChunk]:
    """Every response of a streaming request to the decoupled `model`, through the contract's codec."""

    async def requests():
        yield {"model_name": model, "inputs": inputs}

    out = []
    async for result, error in client.stream_infer(requests()):
        if error is not None:
            raise error
        out.append(contract.decode_response(result.as_numpy,
                                            result.get_response().parameters["triton_final_response"].bool_param))
        if out[-1].final:
            return out
    return out


async def stream(client, inputs, cancel_after: int | None = None):
    """(waveform, input_tokens, output_tokens, final) per response of one streaming request."""

    async def requests():
        yield {"model_name": contract.STREAMING_MODEL, "inputs": inputs}

    out = []
    responses = client.stream_infer(requests())
    async for result, error in responses:
        if error is not None:
            raise error
        final = result.get_response().parameters["triton_final_response"].bool_param
        out.append(
            (
                result.as_numpy(contract.WAVEFORM.name),
                int(result.as_numpy(contract.INPUT_TOKENS.name)[0]),
                int(result.as_numpy(contract.OUTPUT_TOKENS.name)[0]),
                final,
            )
        )
        if final:
            break
        if cancel_after is not None and len(out) >= cancel_after:
            responses.cancel()
            break
    return out


async def wait_metrics(pipeline, predicate, timeout=30.0):
    for _ in range(int(timeout / 0.1)):
        metrics = pipeline.metrics()
        if predicate(metrics):
            return metrics
        await asyncio.sleep(0.1)
    return pipeline.metrics()


#: How long the metrics must stay unchanged to count as settled. Components push a change at once and then at
#: most every 100 ms, but on a loaded CI machine a publisher thread can wait for the CPU well beyond that.
SETTLE_S = 1.2


async def settled_metrics(pipeline):
    """Metrics once every component has published its latest values (unchanged for `SETTLE_S`)."""
    previous, since = pipeline.metrics(), time.monotonic()
    while True:
        await asyncio.sleep(0.3)
        current = pipeline.metrics()
        if current != previous:
            previous, since = current, time.monotonic()
        elif time.monotonic() - since >= SETTLE_S:
            return current


@pytest.fixture
def adapters(monkeypatch):
    """The adapter modules imported outside tritonserver, over a stand-in for `triton_python_backend_utils`
    (only what they read at import and `initialize`); removed again afterwards."""
    stub = types.ModuleType("triton_python_backend_utils")
    stub.TRITONSERVER_RESPONSE_COMPLETE_FINAL = 1  # type: ignore[attr-defined]
    # what the real one reads: the model configuration's transaction policy
    stub.using_decoupled_model_transaction_policy = (  # type: ignore[attr-defined]
        lambda config: bool(config.get("model_transaction_policy", {}).get("decoupled", False)))
    monkeypatch.setitem(sys.modules, "triton_python_backend_utils", stub)
    for name in [n for n in sys.modules if n.startswith("triton_repo.adapters")]:
        monkeypatch.delitem(sys.modules, name)
    yield lambda name: importlib.import_module(f"triton_repo.adapters.{name}")
    for name in [n for n in sys.modules if n.startswith("triton_repo.adapters")]:
        del sys.modules[name]
