"""The disaggregated layout on N GPUs: the LLM on GPU 0, token2wav replicas on GPUs 1..N.

Without GPUs here, the placement is checked three ways: every rendered config's instance groups, expanded into
the instances Triton would create, each resolved to its device exactly as the adapters resolve it; the adapters'
`initialize` given the arguments the python backend passes a GPU instance; and a real tritonserver serving the
layout's CPU rehearsal (`gpu_emulation`), where two token2wav replicas run as separate processes, both serve,
and every chunk of a stream reaches the replica that holds its caches.
"""

from __future__ import annotations

import asyncio
import json
import os
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest
import tritonclient.grpc.aio as aio
from google.protobuf import json_format
from tritonclient.grpc import model_config_pb2

from tests.triton.conftest import (
    FIRST_HOP,
    SAMPLES_PER_TOKEN,
    Pipeline,
    settled_metrics,
    stream,
    synthesis_inputs,
    wait_metrics,
)
from tests.triton.test_render import parameters as params
from tests.triton.test_render import parsed_configs as configs
from tests.triton.trtllm_fakes import fake_trtllm_inputs
import pipeline_contract as contract
from triton_repo.devices import instance_device
from triton_repo.model_params import InternalModels, OrchestratorParams, Token2WavParams
from triton_repo.render import RenderError, RenderOptions, main, render_repository, write_repository

GPUS = (1, 2, 3)
PER_GPU = 2
REPLICAS = {f"token2wav_gpu{g}_{k}": g for g in GPUS for k in range(PER_GPU)}


def backend_args(config: model_config_pb2.ModelConfig) -> list[dict[str, str]]:
    """The `args` of each instance Triton creates for `config` (python backend): a KIND_GPU group makes `count`
    instances on each listed GPU, each told its GPU; a KIND_CPU group `count` instances of kind CPU."""
    model_config = json.dumps(json_format.MessageToDict(config, preserving_proto_field_name=True, always_print_fields_with_no_presence=True))
    out = []
    for group in config.instance_group:
        gpu = group.kind == model_config_pb2.ModelInstanceGroup.KIND_GPU
        for device_id in group.gpus if gpu else [0]:
            out += [
                {"model_config": model_config, "model_name": config.name, "model_instance_kind": "GPU" if gpu else "CPU",
                 "model_instance_device_id": str(device_id)}
            ] * group.count  # fmt: skip
    return out


def devices(config: model_config_pb2.ModelConfig) -> list[str]:
    return [instance_device(args, params(config)["device"]) for args in backend_args(config)]


def render_four_gpus(model_dir: Path, out: Path, **options: object) -> Path:
    return write_repository(
        RenderOptions(model_dir=model_dir, out=out, layout="disaggregated", device="cuda", token2wav_gpus=GPUS,
                      token2wav_instances_per_gpu=PER_GPU, **options)  # type: ignore[arg-type]
    )  # fmt: skip


def test_four_gpus_the_llm_on_gpu0_and_two_token2wav_replicas_on_each_other_gpu(tiny_model_dir, tmp_path):
    repo = render_four_gpus(tiny_model_dir, tmp_path / "repo", instances={"audio_tokenizer": 2})
    found = configs(repo)
    assert {name for name in found if name.startswith("token2wav")} == set(REPLICAS)
    assert devices(found["llm"]) == ["cuda:0"]
    for name, gpu in REPLICAS.items():
        assert devices(found[name]) == [f"cuda:{gpu}"]  # one instance each, on its GPU
    # the audio front-end on the first token2wav GPU, keeping GPU 0 to the LLM
    assert devices(found["audio_tokenizer"]) == ["cuda:1", "cuda:1"]
    assert devices(found["speaker_embedding"]) == ["cuda:1"]
    for name in (contract.OFFLINE_MODEL, contract.STREAMING_MODEL, "voice_prompt"):
        assert [g.kind for g in found[name].instance_group] == [model_config_pb2.ModelInstanceGroup.KIND_CPU]
        if name != "voice_prompt":  # the orchestrators address every replica, nothing else
            models = OrchestratorParams.from_parameters(params(found[name])).models
            assert sorted(models.token2wav_model) == sorted(REPLICAS)
    # every GPU but the LLM's carries the same token2wav work
    per_gpu = {g: sum(1 for n, d in REPLICAS.items() if d == g) for g in GPUS}
    assert per_gpu == dict.fromkeys(GPUS, PER_GPU)
    # the per-GPU flow-cache budget, and each replica's share of it
    replica = Token2WavParams.from_parameters(params(found["token2wav_gpu2_1"]))
    assert (replica.flow_cache_gb, replica.replicas_per_gpu) == (RenderOptions.flow_cache_gb, PER_GPU)
    assert replica.flow_cache_budget_gb == RenderOptions.flow_cache_gb / PER_GPU


def test_tensorrt_llm_keeps_its_own_gpu_placement_and_the_whole_kv_budget_of_gpu0(tiny_model_dir, tmp_path):
    engine_dir, llm_dir = fake_trtllm_inputs(tmp_path, max_batch_size=4, max_seq_len=1024)
    common = dict(llm_backend="trtllm", llm_dir=llm_dir, engine_dir=engine_dir, layout="disaggregated",
                  max_batch=4, max_seq_len=1024, token2wav_instances_per_gpu=PER_GPU)  # fmt: skip
    found = configs(render_repository(tmp_path / "a", tiny_model_dir, token2wav_gpus=list(GPUS), **common))
    llm = params(found["llm"])
    assert found["llm"].backend == "tensorrtllm" and llm["gpu_device_ids"] == "0"
    assert [g.kind for g in found["llm"].instance_group] == [model_config_pb2.ModelInstanceGroup.KIND_CPU]
    assert llm["kv_cache_free_gpu_mem_fraction"] == "0.9"  # GPU 0 holds nothing else
    assert {name: devices(found[name]) for name in REPLICAS} == {n: [f"cuda:{g}"] for n, g in REPLICAS.items()}
    # token2wav sharing the LLM's GPU: TensorRT-LLM leaves it half of the free memory
    shared = configs(render_repository(tmp_path / "b", tiny_model_dir, token2wav_gpus=[0, 1], **common))
    assert params(shared["llm"])["kv_cache_free_gpu_mem_fraction"] == "0.5"
    assert devices(shared["token2wav_gpu0_1"]) == ["cuda:0"]


@pytest.mark.parametrize(
    "change, message",
    [
        ({"token2wav_gpus": ()}, "names no GPU"),
        ({"token2wav_gpus": (1, 1)}, "names a GPU twice"),
        ({"token2wav_gpus": (-1,)}, "GPU ids are >= 0"),
        ({"token2wav_instances_per_gpu": 0}, "--token2wav-instances-per-gpu must be >= 1"),
        ({"layout": "single"}, "need --layout disaggregated"),
        ({"gpu_emulation": True}, "--gpu-emulation rehearses --layout disaggregated on --device cpu only"),
        ({"device": "cpu"}, "--layout disaggregated needs --device cuda"),
    ],
)
def test_bad_placements_are_refused(tiny_model_dir, tmp_path, change, message):
    options = RenderOptions(model_dir=tiny_model_dir, out=tmp_path / "repo", layout="disaggregated", device="cuda",
                            token2wav_gpus=(1, 2))  # fmt: skip
    with pytest.raises(RenderError, match=message):
        write_repository(replace(options, **change))


def test_cli_options(tiny_model_dir, tmp_path, capsys):
    base = ["--model-dir", str(tiny_model_dir), "--layout", "disaggregated"]
    assert main([*base, "--out", str(tmp_path / "a"), "--token2wav-gpus", "2,3", "--token2wav-instances-per-gpu", "3"]) == 0
    assert sorted(p.name for p in (tmp_path / "a").glob("token2wav*")) == [
        f"token2wav_gpu{g}_{k}" for g in (2, 3) for k in range(3)
    ]
    assert main([*base, "--out", str(tmp_path / "b"), "--token2wav-gpus", "one,two"]) == 2
    assert "comma-separated GPU ids" in capsys.readouterr().err


def test_a_kind_gpu_instance_and_the_rendered_device_must_agree():
    gpu = {"model_instance_kind": "GPU", "model_instance_device_id": "3"}
    assert instance_device(gpu, "cuda") == "cuda:3"
    assert instance_device({"model_instance_kind": "CPU", "model_instance_device_id": "0"}, "cuda:0") == "cuda:0"
    with pytest.raises(ValueError):
        instance_device(gpu, "cpu")
    with pytest.raises(ValueError):
        instance_device({"model_instance_kind": "CPU", "model_instance_device_id": "0"}, "cuda")


# -- the adapters take the GPU Triton gives each instance ---------------------------------------------------------
class Recorder:
    """Stands in for what an adapter builds from its parameters and records them."""

    seen: list = []

    def __init__(self, *args: object, **kwargs: object) -> None:
        Recorder.seen.append(args)
        self.stats = None


def test_every_adapter_puts_each_instance_on_the_gpu_triton_gives_it(adapters, tiny_model_dir, tmp_path, monkeypatch):
    found = configs(render_four_gpus(tiny_model_dir, tmp_path / "repo"))
    token2wav, llm, audio = adapters("token2wav"), adapters("llm"), adapters("audio_features")
    monkeypatch.setattr(adapters("common"), "MetricsExporter", lambda *args: None)
    for module in (token2wav, llm):  # the handler each model builds from its parameters
        monkeypatch.setattr(module.TritonPythonModel, "build", staticmethod(Recorder))
    monkeypatch.setattr(audio, "SpeechTokenizer", Recorder)
    monkeypatch.setattr(audio, "default_providers", lambda: ["CUDAExecutionProvider", "CPUExecutionProvider"])

    def initialized(module, name: str, cls: str = "TritonPythonModel") -> list:
        Recorder.seen = []
        for args in backend_args(found[name]):
            getattr(module, cls)().initialize(args)
        return Recorder.seen

    for name, gpu in REPLICAS.items():
        assert [p[0].device for p in initialized(token2wav, name)] == [f"cuda:{gpu}"]
    assert [p[0].device for p in initialized(llm, "llm")] == ["cuda:0"]
    providers = [p[1] for p in initialized(audio, "audio_tokenizer", "AudioTokenizerModel")]
    assert providers == [[("CUDAExecutionProvider", {"device_id": 1}), "CPUExecutionProvider"]]


async def test_the_orchestrators_clients_keep_each_stream_and_its_close_on_one_replica(adapters, monkeypatch):
    import numpy as np

    from cosyvoice2.streaming import Chunk
    from speech_serving.errors import RemoteError
    from triton_repo import internal_io as io

    orchestrator = adapters("orchestrator")
    calls: list[tuple[str, str, str]] = []  # (replica, stream id, what)
    failing: set[str] = set()

    async def bls_one(model, inputs, outputs, decoupled, request_id=""):
        stream_id = inputs[io.STREAM_ID.name][0].decode()
        what = "close" if io.CLOSE.name in inputs else "prompt" if io.PROMPT_SPEECH_TOKENS.name in inputs else "chunk"
        calls.append((model, stream_id, what))
        if stream_id in failing and what == "chunk":
            raise RemoteError("token2wav failed")
        return {io.WAVEFORM.name: np.zeros(4, np.float32)}

    monkeypatch.setattr(orchestrator, "bls_one", bls_one)
    replicas = ("token2wav_gpu1_0", "token2wav_gpu1_1", "token2wav_gpu2_0")
    models = InternalModels(llm_model="llm", token2wav_model=replicas, token2wav_decoupled=False)
    clients = orchestrator.TritonClients(None, None, models)  # type: ignore[arg-type]
    prompt = io.prompt_from_tensors(
        {io.PROMPT_SPEECH_TOKENS.name: np.zeros(4, np.int32), io.PROMPT_MEL.name: np.zeros((8, 80), np.float32),
         io.PROMPT_XVECTOR.name: np.zeros(192, np.float32)}
    )  # fmt: skip
    tokens = np.zeros(3, np.int32)
    ids = [str(i) for i in range(5)]
    for rid in ids:  # five streams open, interleaved
        await clients.token2wav(rid, tokens, prompt, Chunk(0, 3, 6, False), 1)
    for rid in ids:
        await clients.token2wav(rid, tokens, None, Chunk(3, 6, 9, False), 1)
    await clients.token2wav_close("0")  # a cancelled stream
    failing.add("1")
    with pytest.raises(RemoteError):
        await clients.token2wav("1", tokens, None, Chunk(6, 9, 12, False), 1)
    await clients.token2wav_close("1")  # the orchestrator closes a stream whose chunk failed
    for rid in ids[2:]:
        await clients.token2wav(rid, tokens, None, Chunk(6, 9, 9, True), 1)
    await clients.token2wav("offline", tokens, prompt, None, 1)
    by_stream: dict[str, set[str]] = {}
    for replica, rid, _ in calls:
        by_stream.setdefault(rid, set()).add(replica)
    assert all(len(used) == 1 for used in by_stream.values()), by_stream  # every call of a stream on one replica
    assert {next(iter(by_stream[rid])) for rid in ids} == set(replicas)  # and the streams spread over all
    assert [what for _, rid, what in calls if rid == "0"] == ["prompt", "chunk", "close"]
    assert clients.token2wav_router.load() == dict.fromkeys(replicas, 0)  # nothing left held after every end


# -- a real tritonserver: the CPU rehearsal of the layout ----------------------------------------------------------
REHEARSED = ("token2wav_gpu1_0", "token2wav_gpu1_1")


@pytest.fixture(scope="module")
def rehearsal(tiny_model_dir, tmp_path_factory, triton_server_factory) -> Iterator[Pipeline]:
    repo = write_repository(
        RenderOptions(
            model_dir=tiny_model_dir, out=tmp_path_factory.mktemp("disaggregated") / "repo", layout="disaggregated",
            device="cpu", gpu_emulation=True, token2wav_gpus=(1,), token2wav_instances_per_gpu=2,
            max_batch=4, max_seq_len=1024, first_hop=FIRST_HOP,
        )
    )  # fmt: skip
    server = triton_server_factory(repo, ready_timeout=240)
    yield Pipeline(server=server, repo=repo, llm_model="llm", token2wav_model=REHEARSED[0])
    server.cleanup()


def stub_processes(server_pid: int) -> dict[str, set[int]]:
    """Model name -> pids of the python stub processes tritonserver started for it (its children)."""
    out: dict[str, set[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
            cmdline = Path(f"/proc/{entry}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if int(stat.rsplit(")", 1)[1].split()[1]) != server_pid:
            continue
        for arg in cmdline:
            parts = Path(arg.decode(errors="replace")).parts
            for name in REHEARSED:
                if name in parts:
                    out.setdefault(name, set()).add(int(entry))
    return out


@pytest.mark.triton
async def test_two_replicas_in_two_processes_share_the_streams_and_each_stream_stays_on_one(rehearsal):
    processes = stub_processes(rehearsal.server.pid)
    assert set(processes) == set(REHEARSED) and not processes[REHEARSED[0]] & processes[REHEARSED[1]]
    texts = [f"Stream number {i} is spoken in several chunks, one after the other." for i in range(6)]
    async with aio.InferenceServerClient(rehearsal.server.grpc_url) as client:
        streams = await asyncio.gather(*(stream(client, synthesis_inputs(t, seed=i)) for i, t in enumerate(texts)))
        offline = await asyncio.gather(
            *(client.infer(contract.OFFLINE_MODEL, synthesis_inputs(f"Offline {i}.", seed=20 + i)) for i in range(2))
        )
    # a chunk reaching a replica without its stream fails the request ("not open"): every stream completed whole
    for chunks in streams:
        assert len(chunks) >= 3 and chunks[-1][3]
        assert sum(w.size for w, *_ in chunks) == chunks[-1][2] * SAMPLES_PER_TOKEN
    for result in offline:
        tokens = int(result.as_numpy(contract.OUTPUT_TOKENS.name)[0])
        assert result.as_numpy(contract.WAVEFORM.name).size == tokens * SAMPLES_PER_TOKEN
    metrics = await settled_metrics(rehearsal)
    chunks_by_replica = {name: metrics.get(("token2wav_chunks_total", name), 0) for name in REHEARSED}
    assert all(count > 0 for count in chunks_by_replica.values()), chunks_by_replica  # both served work
    assert sum(chunks_by_replica.values()) == sum(len(c) for c in streams) + len(offline)
    for name in REHEARSED:
        assert metrics[("token2wav_failed_total", name)] == 0 and metrics[("token2wav_active_streams", name)] == 0
    # every stream's first chunk counted once in each layer (the replicas' counts add up), the offline ones in none
    first_chunks = sum(metrics.get(("token2wav_first_chunks_total", name), 0) for name in REHEARSED)
    assert first_chunks == metrics[("llm_first_chunks_total", "llm")] == len(streams)
    assert metrics[("orchestrator_first_chunks_total", contract.STREAMING_MODEL)] == len(streams)
    # cancelled streams: the close reaches the replica holding the stream (else it would stay open there)
    async with aio.InferenceServerClient(rehearsal.server.grpc_url) as client:
        await asyncio.gather(*(stream(client, synthesis_inputs(t, seed=40 + i), cancel_after=1)
                               for i, t in enumerate(texts[:2])))  # fmt: skip
    closed = await wait_metrics(
        rehearsal, lambda m: sum(m.get(("token2wav_closed_total", n), 0) for n in REHEARSED) == 2, timeout=60
    )
    for name in REHEARSED:
        assert closed[("token2wav_active_streams", name)] == 0 and closed[("token2wav_failed_total", name)] == 0
    # each replica's chunk count is a sum of whole streams (plus offline calls): no stream was split across them
    lengths = [len(c) for c in streams]
    sums = {0}
    for n in lengths:
        sums |= {s + n for s in sums}
    first = chunks_by_replica[REHEARSED[0]]
    assert any(first - k in sums and sum(lengths) - (first - k) + (len(offline) - k) == chunks_by_replica[REHEARSED[1]]
               for k in range(len(offline) + 1))  # fmt: skip
