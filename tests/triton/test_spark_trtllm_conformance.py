"""Conformance of the Spark LLM's TensorRT-LLM path (`render --spark-engine-dir`, model `spark_llm`) with the
pinned tensorrtllm backend (`triton_repo.trtllm_backend_facts`), as CosyVoice2's `llm` is held to it
(test_trtllm_conformance.py): the rendered config against the fact table, then the Spark orchestrators of that
render driving a real tritonserver in which `spark_llm` is the recording stand-in with exactly the rendered config
(only the backend swapped), every recorded request checked against what the backend reads."""

from __future__ import annotations

import shutil
import time
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc.aio as aio

import pipeline_contract as contract
from speech_serving.io_struct import SparkLLMRequest
from spark_tts.loading import read_llm_config
from spark_tts.prompt import SparkTokenizer
from spark_tts.testing import write_tiny_model
from tests.triton.conftest import synthesis_inputs
from tests.triton.test_trtllm_conformance import parse, read_recorded
from tests.triton.trtllm_fakes import fake_trtllm_inputs
from triton_repo import internal_io, spark_io
from triton_repo import trtllm_backend_facts as facts
from triton_repo.model_params import SparkEngineParams, SparkOrchestratorParams
from triton_repo.render import RenderError, RenderOptions, check_trtllm_config, write_repository
from triton_repo.spark_render import ENGINE, LLM, SparkRenderOptions
from tests.triton.test_render import parameters

MAX_SEQ_LEN = 1024


@pytest.fixture(scope="module")
def spark_dir(tmp_path_factory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("spark_trt_model"), seed=2)


def render_spark_trtllm(tiny_model_dir: Path, spark_dir: Path, root: Path, device: str = "cuda",
                        benchmark_ratio: float | None = None, **engine: object) -> Path:
    vocab = read_llm_config(spark_dir).qwen.vocab_size
    engine = {"vocab_size": vocab, "bias_length": vocab, **engine}
    engine_dir, _ = fake_trtllm_inputs(root / "spark_engine", max_batch_size=4, max_seq_len=MAX_SEQ_LEN, **engine)
    spark = SparkRenderOptions(spark_dir, max_new_tokens=64, first_chunk_tokens=10, max_seq_len=MAX_SEQ_LEN,
                               engine_dir=engine_dir, benchmark_ratio=benchmark_ratio)
    return write_repository(RenderOptions(model_dir=tiny_model_dir, out=root / "repo", device=device, max_batch=4,
                                          max_seq_len=MAX_SEQ_LEN, spark=spark))  # fmt: skip


def test_rendered_spark_llm_config_meets_the_pinned_backend(tiny_model_dir, spark_dir, tmp_path):
    repo = render_spark_trtllm(tiny_model_dir, spark_dir, tmp_path)
    config = parse(repo / LLM / "config.pbtxt")
    assert config.backend == "tensorrtllm" and config.model_transaction_policy.decoupled
    assert check_trtllm_config(config, facts.PINNED, spark_io.TRTLLM_INPUTS, spark_io.TRTLLM_OUTPUTS) == []
    params = {key: value.string_value for key, value in config.parameters.items()}
    assert facts.PINNED.required_parameters <= set(params)
    assert params["max_tokens_in_paged_kv_cache"] == str(4 * MAX_SEQ_LEN)  # every slot holds a whole sequence
    assert params["max_attention_window_size"] == str(MAX_SEQ_LEN)
    declared = {tensor.name for tensor in config.input}
    assert declared == {spec.name for spec in spark_io.TRTLLM_INPUTS} and facts.PINNED.roles["seed"] in declared
    # the orchestrators decode on it; spark_engine only vocodes (no second copy of the LLM on the GPU)
    for name in (contract.SPARK_OFFLINE_MODEL, contract.SPARK_STREAMING_MODEL):
        read = SparkOrchestratorParams.from_parameters(parameters(parse(repo / name / "config.pbtxt")), name)
        assert read.trtllm_model == LLM
    assert not SparkEngineParams.from_parameters(parameters(parse(repo / ENGINE / "config.pbtxt")), ENGINE).llm
    # a backend that renamed the seed would ignore it: the same config fails against that table
    errors = "\n".join(check_trtllm_config(config, facts.RENAMED, spark_io.TRTLLM_INPUTS, spark_io.TRTLLM_OUTPUTS))
    assert "input random_seed is declared but" in errors


def test_without_an_engine_the_spark_llm_is_not_rendered(tiny_model_dir, spark_dir, tmp_path):
    repo = write_repository(RenderOptions(model_dir=tiny_model_dir, out=tmp_path / "repo",
                                          spark=SparkRenderOptions(spark_dir)))
    assert not (repo / LLM).exists()
    assert SparkEngineParams.from_parameters(parameters(parse(repo / ENGINE / "config.pbtxt")), ENGINE).llm


def spark_request(tokenizer: SparkTokenizer, streaming: bool) -> SparkLLMRequest:
    prompt = np.asarray(tokenizer.prompt_ids("Hi.", [1] * 32, None, ()), np.int32)
    return SparkLLMRequest(prompt, 64, 7, (20, 40) if streaming else (), streaming)


@pytest.mark.parametrize("streaming", [False, True])
def test_spark_requests_are_ones_the_pinned_backend_reads(spark_dir, streaming):
    tokenizer = SparkTokenizer.from_model_dir(spark_dir)
    vocab = read_llm_config(spark_dir).qwen.vocab_size
    eos = tokenizer.vocab.eos_id
    for bias in (None, spark_io.benchmark_stop_bias(vocab, eos)):
        tensors = spark_io.trtllm_request_tensors(spark_request(tokenizer, streaming), eos, 50, 0.95, 0.8, bias)
        assert facts.check_request(tensors, facts.PINNED, spark_io.TRTLLM_ROLES) == []
        assert bool(tensors["streaming"].reshape(-1)[0]) == streaming
        if bias is not None:  # one value per logits row; only the stop id is pushed out
            assert tensors["embedding_bias"].shape == (1, vocab)
            assert np.flatnonzero(tensors["embedding_bias"][0]).tolist() == [eos]
    errors = "\n".join(facts.check_request(tensors, facts.RENAMED, spark_io.TRTLLM_ROLES))
    assert "random_seed is not read" in errors and "does not carry seed as 'seed'" in errors
    assert facts.check_request(internal_io.llm_stop_tensors(), facts.PINNED) == []  # how the orchestrators stop it


@pytest.mark.parametrize(
    "options, message",
    [
        ({"version": "1.0.0"}, r"--spark-engine-dir: .*TensorRT-LLM 1\.0\.0"),
        ({"logits_dtype": "float16"}, r"Spark engine's logits are float16, not float32"),
        ({"vocab_size": 151936}, r"vocab_size 151936 is not the Spark LLM's"),
        ({"device": "cpu"}, r"--spark-engine-dir needs --device cuda"),
    ],
)
def test_render_refuses_a_spark_engine_the_requests_do_not_fit(tiny_model_dir, spark_dir, tmp_path, options, message):
    with pytest.raises(RenderError, match=message):
        render_spark_trtllm(tiny_model_dir, spark_dir, tmp_path, **options)


@pytest.fixture(scope="module", params=[None, 2.0], ids=["sampling", "benchmark"])
def recording_stack(request, tiny_model_dir, spark_dir, tmp_path_factory, triton_server_factory):
    """A CPU repository serving the TensorRT-LLM render's Spark orchestrators and `spark_llm` config (stand-in),
    without and with benchmark mode."""
    root = tmp_path_factory.mktemp("spark_conformance")
    trt_repo = render_spark_trtllm(tiny_model_dir, spark_dir, root / "trt", benchmark_ratio=request.param)
    repo = write_repository(RenderOptions(
        model_dir=tiny_model_dir, out=root / "repo", max_batch=4, max_seq_len=MAX_SEQ_LEN,
        spark=SparkRenderOptions(spark_dir, max_new_tokens=64, first_chunk_tokens=10, max_seq_len=MAX_SEQ_LEN),
    ))  # fmt: skip
    for name in (contract.SPARK_OFFLINE_MODEL, contract.SPARK_STREAMING_MODEL):  # as the TensorRT-LLM render has them
        shutil.copy(trt_repo / name / "config.pbtxt", repo / name / "config.pbtxt")
    record_dir = root / "requests"
    record_dir.mkdir()
    config = (trt_repo / LLM / "config.pbtxt").read_text().replace('backend: "tensorrtllm"', 'backend: "python"', 1)
    config += f'\nparameters: {{ key: "record_dir" value: {{ string_value: "{record_dir}" }} }}\n'
    (repo / LLM / "1").mkdir(parents=True)
    (repo / LLM / "config.pbtxt").write_text(config)
    (repo / LLM / "1" / "model.py").write_text("from tests.triton.trtllm_standin import TritonPythonModel  # noqa: F401\n")
    server = triton_server_factory(repo, ready_timeout=240)
    yield server, record_dir, request.param
    server.cleanup()


async def _stream(client, inputs) -> list[bool]:
    async def requests():
        yield {"model_name": contract.SPARK_STREAMING_MODEL, "inputs": inputs}

    finals = []
    async for result, error in client.stream_infer(requests()):
        if error is not None:
            raise error
        finals.append(result.get_response().parameters["triton_final_response"].bool_param)
        if finals[-1]:
            break
    return finals


async def test_every_spark_request_to_the_engine_is_one_the_pinned_backend_reads(recording_stack):
    server, record_dir, benchmark = recording_stack
    async with aio.InferenceServerClient(server.grpc_url) as client:
        await client.infer(contract.SPARK_OFFLINE_MODEL, synthesis_inputs("One offline request.", seed=3))
        assert (await _stream(client, synthesis_inputs("One streaming request.", seed=4)))[-1]
    deadline = time.monotonic() + 30
    while len(requests := read_recorded(record_dir)) < 2 and time.monotonic() < deadline:
        time.sleep(0.1)
    generation = [r for r in requests if "stop" not in r]
    assert {bool(r["streaming"].reshape(-1)[0]) for r in generation} == {False, True}
    for tensors in requests:
        roles = () if "stop" in tensors else spark_io.TRTLLM_ROLES
        assert facts.check_request(tensors, facts.PINNED, roles) == []
        if "stop" in tensors:
            continue
        if benchmark is None:
            assert "embedding_bias" not in tensors  # only benchmark mode sends one
        else:  # the stop id pushed out of reach, nothing else touched
            eos = int(tensors["end_id"].reshape(-1)[0])
            assert np.flatnonzero(tensors["embedding_bias"].reshape(-1)).tolist() == [eos]
