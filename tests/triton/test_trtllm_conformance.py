"""Conformance of the TensorRT-LLM path with the pinned tensorrtllm backend (`triton_repo.trtllm_backend_facts`).

The rendered `llm` config (TensorRT-LLM renders the single layout) is checked against the fact table, and then
the orchestrators of that render drive a real tritonserver in which the `llm` model is a recording stand-in with
exactly the rendered config (only the backend swapped; `trtllm_standin.py`): Triton validates every request
against the config, and each recorded request is checked against what the backend reads. The last tests feed
the configs and requests of earlier releases to the same checks and expect the specific failures.
"""

from __future__ import annotations

import re
import shutil
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc.aio as aio
from google.protobuf import text_format
from tritonclient.grpc import model_config_pb2

from cosyvoice2.vocab import SpeechVocabLayout
from speech_serving.io_struct import LLMRequest
from tests.triton.conftest import stream, synthesis_inputs
from tests.triton.trtllm_fakes import fake_trtllm_inputs
import pipeline_contract as contract
from triton_repo import internal_io as io
from triton_repo import trtllm_backend_facts as facts
from triton_repo.render import RenderError, RenderOptions, check_trtllm_config, render_repository, write_repository

#: The sampling controls every generation request must carry, by role (the backend's name for each differs).
ROLES = ("min_tokens", "seed", "repetition_penalty", "end_id", "stop_words_list", "embedding_bias")


def parse(path: Path) -> model_config_pb2.ModelConfig:
    config = model_config_pb2.ModelConfig()
    text_format.Parse(path.read_text(), config)
    return config


def render_trtllm(tiny_model_dir: Path, root: Path, **engine: object) -> Path:
    engine_dir, llm_dir = fake_trtllm_inputs(root, max_batch_size=4, max_seq_len=1024, **engine)
    return render_repository(
        root / "repo", tiny_model_dir, llm_backend="trtllm", llm_dir=llm_dir, engine_dir=engine_dir, layout="single",
        max_batch=4, max_seq_len=1024, first_hop=5,
    )  # fmt: skip


def test_rendered_tensorrt_llm_config_meets_the_pinned_backend(tiny_model_dir, tmp_path):
    config = parse(render_trtllm(tiny_model_dir, tmp_path) / "llm" / "config.pbtxt")
    assert config.backend == "tensorrtllm"
    assert check_trtllm_config(config, facts.PINNED) == []
    params = {key: value.string_value for key, value in config.parameters.items()}
    assert facts.PINNED.required_parameters <= set(params)
    assert params["guided_decoding_backend"] == params["xgrammar_tokenizer_info_path"] == ""  # guided decoding off
    declared = {tensor.name for tensor in config.input}
    assert {facts.PINNED.roles["min_tokens"], facts.PINNED.roles["seed"], "repetition_penalty"} <= declared


@pytest.fixture(scope="module")
def recording_stack(tiny_model_dir, tmp_path_factory, triton_server_factory):
    """A CPU repository serving the TensorRT-LLM render's orchestrators and `llm` config (stand-in behind it)."""
    root = tmp_path_factory.mktemp("conformance")
    trt_repo = render_trtllm(tiny_model_dir, root / "trt")
    # the same internal models as the TensorRT-LLM render
    repo = write_repository(
        RenderOptions(model_dir=tiny_model_dir, out=root / "repo", max_batch=4, max_seq_len=1024, first_hop=5,
                      layout="single")
    )
    for name in (contract.OFFLINE_MODEL, contract.STREAMING_MODEL):  # the TensorRT-LLM orchestrators as rendered
        shutil.copy(trt_repo / name / "config.pbtxt", repo / name / "config.pbtxt")
    record_dir = root / "requests"
    record_dir.mkdir()
    llm_config = (trt_repo / "llm" / "config.pbtxt").read_text()
    llm_config = llm_config.replace('backend: "tensorrtllm"', 'backend: "python"', 1)
    llm_config += f'\nparameters: {{ key: "record_dir" value: {{ string_value: "{record_dir}" }} }}\n'
    (repo / "llm" / "config.pbtxt").write_text(llm_config)
    (repo / "llm" / "1" / "model.py").write_text("from tests.triton.trtllm_standin import TritonPythonModel  # noqa: F401\n")
    server = triton_server_factory(repo, ready_timeout=240)
    yield server, record_dir
    server.cleanup()


def recorded(record_dir: Path, stops: int = 0, timeout: float = 30.0) -> list[dict[str, np.ndarray]]:
    """The recorded requests, once at least `stops` stop requests are among them (a stop is sent after the
    client already has its final response, so it may land a moment later)."""
    deadline = time.monotonic() + timeout
    while True:
        out = read_recorded(record_dir)
        if sum("stop" in r for r in out) >= stops or time.monotonic() > deadline:
            return out
        time.sleep(0.1)


def read_recorded(record_dir: Path) -> list[dict[str, np.ndarray]]:
    out = []
    for path in sorted(record_dir.glob("*.npz")):
        with np.load(path) as data:
            out.append({name: data[name] for name in data.files})
    return out


async def test_every_request_to_the_llm_is_one_the_pinned_backend_reads(recording_stack):
    server, record_dir = recording_stack
    async with aio.InferenceServerClient(server.grpc_url) as client:
        result = await client.infer(contract.OFFLINE_MODEL, synthesis_inputs("One offline request.", seed=3))
        chunks = await stream(client, synthesis_inputs("One streaming request.", seed=4))
    assert int(result.as_numpy(contract.OUTPUT_TOKENS.name)[0]) > 0 and chunks[-1][3]
    requests = recorded(record_dir, stops=2)
    generation = [r for r in requests if "stop" not in r]
    stops = [r for r in requests if "stop" in r]
    assert len(generation) >= 2 and stops  # both pipelines, and the stop sent after each end id
    assert {bool(r["streaming"].reshape(-1)[0]) for r in generation} == {False, True}
    for tensors in generation:
        assert facts.check_request(tensors, facts.PINNED, ROLES) == []
        assert tensors["repetition_penalty"].reshape(-1)[0] == pytest.approx(RenderOptions.repetition_penalty)
    for tensors in stops:
        assert facts.check_request(tensors, facts.PINNED) == []


# -- what the checks would have caught ------------------------------------------------------------
def test_the_checker_refuses_a_config_without_the_guided_decoding_parameters(tiny_model_dir, tmp_path):
    """Before: `tokenizer_dir`, `xgrammar_tokenizer_info_path`, `guided_decoding_backend` were not rendered, and
    the backend, which reads all three without a default, did not load the model."""
    config = parse(render_trtllm(tiny_model_dir, tmp_path) / "llm" / "config.pbtxt")
    for key in ("tokenizer_dir", "xgrammar_tokenizer_info_path", "guided_decoding_backend"):
        del config.parameters[key]
    errors = "\n".join(check_trtllm_config(config))
    for key in ("tokenizer_dir", "xgrammar_tokenizer_info_path", "guided_decoding_backend"):
        assert f"parameter {key} missing" in errors and f"Cannot find parameter with name: {key}" in errors


def generation_request() -> dict[str, np.ndarray]:
    vocab = SpeechVocabLayout(text_vocab_size=151663, speech_token_size=6561)
    request = LLMRequest(
        input_ids=np.array([vocab.sos_id, 5, 6, vocab.task_id_id, vocab.speech_offset + 7], np.int32),
        min_tokens=4, max_tokens=40, seed=11, top_k=25, top_p=0.8, temperature=1.0, streaming=True,
    )  # fmt: skip
    return io.llm_request_tensors(request, vocab, np.zeros(vocab.padded_vocab_size, np.float32), 1.1)


def test_our_requests_fail_against_a_backend_that_renamed_the_sampling_inputs():
    """The renamed backend ignores `min_length` and `random_seed`: EOS before the minimum, one seed for all."""
    tensors = generation_request()
    assert facts.check_request(tensors, facts.PINNED, ROLES) == []
    errors = "\n".join(facts.check_request(tensors, facts.RENAMED, ROLES))
    assert "request input min_length is not read" in errors and "request input random_seed is not read" in errors
    assert "does not carry min_tokens as 'min_tokens'" in errors and "does not carry seed as 'seed'" in errors
    new_names = {facts.PINNED.roles[role]: facts.RENAMED.roles[role] for role in facts.PINNED.roles}
    renamed = {new_names.get(name, name): value for name, value in tensors.items()}
    assert facts.check_request(renamed, facts.RENAMED, ROLES) == []


def test_the_checker_names_wrong_dtypes_shapes_and_missing_inputs():
    tensors = generation_request()
    tensors["random_seed"] = tensors["random_seed"].astype(np.int64)
    tensors["runtime_top_k"] = np.array([[25, 25]], np.int32)
    tensors["stop_words_list"] = np.array([[1, 2, 3]], np.int32)
    del tensors["request_output_len"]
    errors = "\n".join(facts.check_request(tensors, facts.PINNED, ROLES))
    assert "random_seed is int64, the backend reads uint64" in errors
    assert "runtime_top_k holds 2 values per request" in errors
    assert "stop_words_list must hold [words..., offsets...]" in errors
    assert "lacks required input request_output_len" in errors


def test_a_config_declaring_the_old_names_fails_against_the_renamed_backend(tiny_model_dir, tmp_path):
    config = parse(render_trtllm(tiny_model_dir, tmp_path) / "llm" / "config.pbtxt")
    errors = "\n".join(check_trtllm_config(config, facts.RENAMED))
    assert "input min_length is declared but" in errors and "input random_seed is declared but" in errors


@pytest.mark.parametrize(
    "engine, message",
    [
        ({"version": "1.0.0"}, r"TensorRT-LLM 1\.0\.0.*min_length -> min_tokens, random_seed -> seed"),
        ({"version": "0.21.0"}, r"verified only for TensorRT-LLM 0\.19, 0\.20"),
        ({"version": None}, "names no TensorRT-LLM version"),
        ({"logits_dtype": "float16"}, r"logits are float16, not float32.*Embedding bias data type"),
        ({"logits_dtype": None}, "logits are of unknown type"),
        ({"bias_length": 151936}, "holds 151936 values but the engine's vocab_size is 158336"),
        ({"tp_size": 3}, "not a multiple of the tensor-parallel size 3"),
    ],
)
def test_render_refuses_an_engine_the_requests_do_not_fit(tiny_model_dir, tmp_path, engine, message):
    with pytest.raises(RenderError, match=message):
        render_trtllm(tiny_model_dir, tmp_path, **engine)


def test_a_tensor_parallel_engine_spans_its_gpus(tiny_model_dir, tmp_path):
    repo = render_trtllm(tiny_model_dir, tmp_path / "a", tp_size=2)
    assert re.search(r'key: "gpu_device_ids" value: \{ string_value: "0,1" \}', (repo / "llm" / "config.pbtxt").read_text())


def test_repetition_penalty_is_checked_and_only_sent_on_the_tensorrt_llm_path(tiny_model_dir, tmp_path):
    with pytest.raises(RenderError, match="--repetition-penalty must be > 0"):
        write_repository(replace(RenderOptions(model_dir=tiny_model_dir, out=tmp_path / "r"), repetition_penalty=0.0))
    pytorch = write_repository(RenderOptions(model_dir=tiny_model_dir, out=tmp_path / "p"))
    assert "llm_repetition_penalty" not in (pytorch / contract.OFFLINE_MODEL / "config.pbtxt").read_text()
    trt = render_trtllm(tiny_model_dir, tmp_path / "t")
    text = (trt / contract.OFFLINE_MODEL / "config.pbtxt").read_text()
    assert 'key: "llm_repetition_penalty" value: { string_value: "1.1" }' in text
    assert 'key: "loop_max_run" value: { string_value: "25" }' in text
