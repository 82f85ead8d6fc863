"""Several GPUs are served by one whole tritonserver per GPU, each pinned to its GPU by CUDA_VISIBLE_DEVICES (compose's
replica profiles, one Kubernetes pod per GPU, `stack-bench --replicas`), all behind one round-robin gRPC target.

Here on real GPUs: a tiny model rendered for CUDA in each layout, one tritonserver on every GPU of the machine,
streaming and offline requests through one `ipv4:a,b,...` target. Every server must serve, and its work must land on
its own GPU: the models render `cuda:0`, which is the pinned GPU only because CUDA numbers a process's visible
devices from 0; a CPU run cannot show that."""

from __future__ import annotations

import asyncio
import os

import pytest
import tritonclient.grpc.aio as aio

import pipeline_contract as contract
from stackbench.cli import GpuMemory, replica_devices
from tests.triton.conftest import SAMPLES_PER_TOKEN, Pipeline, settled_metrics, stream, synthesis_inputs
from triton_repo.render import RenderOptions, write_repository

FIRST_HOP = 5
#: What a server's CUDA work must add to its GPU's memory in use: a CUDA context alone takes several hundred MiB.
MIN_GROWTH_BYTES = 64 * 2**20
#: Rounds of requests through the target until every server has taken some (gRPC's round robin only spreads over
#: the connections already up, so the first calls may all go to the servers that started listening first).
ROUNDS = 5


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory):
    from cosyvoice2.testing import write_tiny_model

    return write_tiny_model(tmp_path_factory.mktemp("tiny_model"))


@pytest.fixture(scope="module")
def dit_dir(tmp_path_factory):
    from cosyvoice2.testing.dit import write_dit_model

    return write_dit_model(tmp_path_factory.mktemp("dit"), seed=5)


def layouts(dit_dir) -> dict[str, dict]:
    return {
        "colocated": dict(layout="colocated"),
        "single": dict(layout="single"),
        "colocated-dit": dict(layout="colocated", token2wav="dit", dit_dir=dit_dir),
    }


async def serve_round(target: str, servers: int) -> None:
    """Two streams per server and one offline request per server through `target`, each checked whole."""
    async with aio.InferenceServerClient(target, channel_args=list(contract.GRPC_CHANNEL_ARGS)) as client:
        texts = [f"Stream number {i} is spoken in several chunks, one after the other." for i in range(2 * servers)]
        streams = await asyncio.gather(*(stream(client, synthesis_inputs(t, seed=i)) for i, t in enumerate(texts)))
        offline = await asyncio.gather(*(client.infer(contract.OFFLINE_MODEL, synthesis_inputs(f"Offline {i}.", seed=i))
                                         for i in range(servers)))  # fmt: skip
    for chunks in streams:
        assert len(chunks) >= 2 and chunks[-1][3]
        assert sum(w.size for w, *_ in chunks) == chunks[-1][2] * SAMPLES_PER_TOKEN
    for result in offline:
        tokens = int(result.as_numpy(contract.OUTPUT_TOKENS.name)[0])
        assert result.as_numpy(contract.WAVEFORM.name).size == tokens * SAMPLES_PER_TOKEN


@pytest.mark.parametrize("name", ["colocated", "single", "colocated-dit"])
async def test_one_tritonserver_per_gpu_serves_on_its_own_gpu(name, gpus, tiny_model_dir, dit_dir, tmp_path,
                                                             triton_server_factory) -> None:
    options = RenderOptions(model_dir=tiny_model_dir, out=tmp_path / "repo", device="cuda", max_batch=8,
                            max_seq_len=2048, first_hop=FIRST_HOP, **layouts(dit_dir)[name])
    repo = write_repository(options)
    # stack-bench's pinning: server i sees only the i-th GPU this process sees (one GPU: what this process sees);
    # numbered in PCI bus order, as NVML numbers the GPUs whose memory is read below
    pins = replica_devices(gpus, "cuda", dict(os.environ)) or [None]
    memory = GpuMemory()
    idle = memory.used()
    servers = [
        triton_server_factory(repo, ready_timeout=300, extra_env={} if pin is None else
                              {"CUDA_VISIBLE_DEVICES": pin, "CUDA_DEVICE_ORDER": "PCI_BUS_ID"})
        for pin in pins
    ]  # fmt: skip
    model = contract.STREAMING_MODEL if options.layout == "colocated" else None  # the engine's process
    pipelines = [Pipeline(server=s, repo=repo, llm_model=model or "llm", token2wav_model=model or "token2wav")
                 for s in servers]  # fmt: skip
    try:
        target = contract.grpc_target([s.grpc_url for s in servers])
        for _ in range(ROUNDS):
            await serve_round(target, len(servers))
            metrics = [await settled_metrics(p) for p in pipelines]
            served = [m.get(("token2wav_chunks_total", p.token2wav_model), 0) for m, p in zip(metrics, pipelines)]
            if all(served):
                break
        assert all(served), f"a server behind the target took no request: {served}"
        for m, p in zip(metrics, pipelines):
            assert m.get(("token2wav_failed_total", p.token2wav_model), 0) == 0
        used = memory.used()
        if idle is not None and used is not None:  # NVML or nvidia-smi read the memory of every GPU in use
            growth = [after - before for before, after in zip(idle, used)]
            assert all(g >= MIN_GROWTH_BYTES for g in growth[: len(servers)]), f"memory added per GPU: {growth}"
    except BaseException:
        # a stub that died says why only in its server's log (shown with the failure as captured output)
        for i, server in enumerate(servers):
            print(f"--- tritonserver {i} (GPU {pins[i]}), last lines of its log:\n{server.log_tail(80)}")
        raise
    finally:
        for server in servers:
            server.stop()
