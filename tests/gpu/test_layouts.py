"""Every layout loads and serves on real GPUs: a tiny model rendered for the GPUs this machine has, a real
tritonserver, streaming and offline requests. The disaggregated layout puts the LLM on GPU 0 and token2wav
replicas (and the audio front-end) on the other GPUs, so every CUDA graph, stream and pool of those models must be
made on the GPU the instance owns; CPU rehearsals cannot show that."""

from __future__ import annotations

import asyncio

import pytest
import tritonclient.grpc.aio as aio

import pipeline_contract as contract
from tests.triton.conftest import SAMPLES_PER_TOKEN, settled_metrics, stream, synthesis_inputs, Pipeline
from triton_repo.render import RenderOptions, write_repository
from triton_repo.render_options import token2wav_replicas

FIRST_HOP = 5


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory):
    from cosyvoice2.testing import write_tiny_model

    return write_tiny_model(tmp_path_factory.mktemp("tiny_model"))


@pytest.fixture(scope="module")
def dit_dir(tmp_path_factory):
    from cosyvoice2.testing.dit import write_dit_model

    return write_dit_model(tmp_path_factory.mktemp("dit"), seed=5)


def layouts(gpus: int, dit_dir) -> dict[str, dict]:
    later = tuple(range(1, gpus)) or (0,)
    return {
        "colocated": dict(layout="colocated"),
        "disaggregated": dict(layout="disaggregated", token2wav_gpus=later, token2wav_instances_per_gpu=2),
        "disaggregated-dit": dict(layout="disaggregated", token2wav_gpus=later, token2wav="dit", dit_dir=dit_dir),
        "disaggregated-with-gpu0": dict(layout="disaggregated", token2wav_gpus=(0, *later[:1])),
    }


async def serve_some(server, texts: list[str]) -> list:
    async with aio.InferenceServerClient(server.grpc_url) as client:
        streams = await asyncio.gather(*(stream(client, synthesis_inputs(t, seed=i)) for i, t in enumerate(texts)))
        offline = await client.infer(contract.OFFLINE_MODEL, synthesis_inputs("An offline sentence.", seed=99))
    for chunks in streams:
        assert len(chunks) >= 2 and chunks[-1][3]
        assert sum(w.size for w, *_ in chunks) == chunks[-1][2] * SAMPLES_PER_TOKEN
    tokens = int(offline.as_numpy(contract.OUTPUT_TOKENS.name)[0])
    assert offline.as_numpy(contract.WAVEFORM.name).size == tokens * SAMPLES_PER_TOKEN
    return streams


@pytest.mark.parametrize("name", ["colocated", "disaggregated", "disaggregated-dit", "disaggregated-with-gpu0"])
async def test_the_layout_serves_on_this_machines_gpus(name, gpus, tiny_model_dir, dit_dir, tmp_path,
                                                       triton_server_factory) -> None:
    if name.startswith("disaggregated") and gpus < 2:
        pytest.skip("the disaggregated layout needs two or more GPUs")
    options = RenderOptions(model_dir=tiny_model_dir, out=tmp_path / "repo", device="cuda", max_batch=8,
                            max_seq_len=2048, first_hop=FIRST_HOP, **layouts(gpus, dit_dir)[name])
    repo = write_repository(options)
    server = triton_server_factory(repo, ready_timeout=300)
    try:
        replicas = [model for model, _ in token2wav_replicas(options)]
        texts = [f"Stream number {i} is spoken in several chunks, one after the other." for i in range(3 * len(replicas))]
        streams = await serve_some(server, texts)
        llm = "engine" if options.layout == "colocated" else "llm"
        metrics = await settled_metrics(Pipeline(server=server, repo=repo, llm_model=llm, token2wav_model=replicas[0]))
        label = (lambda r: "engine") if options.layout == "colocated" else (lambda r: r)
        served = {r: metrics.get(("token2wav_chunks_total", label(r)), 0) for r in replicas}
        assert all(count > 0 for count in served.values()), served  # every replica, on every GPU, served
        assert sum(served.values()) == sum(len(c) for c in streams) + 1
        assert all(metrics.get(("token2wav_failed_total", label(r)), 0) == 0 for r in replicas)
    finally:
        server.stop()
