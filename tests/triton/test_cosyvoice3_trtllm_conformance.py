"""Conformance of CosyVoice3's TensorRT-LLM path (`render --cosyvoice3-engine-dir --cosyvoice3-llm-dir`, model
`cosyvoice3_llm`) with the pinned tensorrtllm backend (`triton_repo.trtllm_backend_facts`), as CosyVoice2's `llm`
is held to it (test_trtllm_conformance.py): the rendered config against the fact table, then the CosyVoice3
orchestrators of that render driving a real tritonserver in which `cosyvoice3_llm` is the recording stand-in with
exactly the rendered config (only the backend swapped; `trtllm_standin.py`). Every recorded request is checked
against what the backend reads and against the merged vocabulary of the converted checkpoint: sos's id as the end
id, the other 199 special ids as stop words, the checkpoint's logits bias."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc.aio as aio
from safetensors.numpy import load_file

import pipeline_contract as contract
from cosyvoice2.testing import write_tiny_model as write_tiny_cosyvoice2
from cosyvoice2.vocab import LOGITS_BIAS_FILE, LOGITS_BIAS_KEY
from cosyvoice3.testing import write_tiny_model
from cosyvoice3.vocab import CosyVoice3VocabLayout
from tests.triton.conftest import streamed_chunks, synthesis_inputs
from tests.triton.test_render import parameters
from tests.triton.test_trtllm_conformance import ROLES, parse, recorded
from tests.triton.trtllm_fakes import fake_trtllm_inputs
from triton_repo import trtllm_backend_facts as facts
from triton_repo.cosyvoice3_render import ENGINE, LLM
from triton_repo.model_params import CosyVoice3EngineEntryParams, CosyVoice3EngineParams, CosyVoice3OrchestratorParams
from triton_repo.render import CosyVoice3RenderOptions, RenderError, RenderOptions, check_trtllm_config, write_repository

MAX_SEQ_LEN = 1024
VOCAB = CosyVoice3VocabLayout()  # the tiny model keeps the released vocabulary sizes
CV3 = dict(first_hop=5, second_hop=6)


@pytest.fixture(scope="module")
def cosyvoice3_dir(tmp_path_factory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("cosyvoice3_trt_model"), seed=3)


@pytest.fixture(scope="module")
def llm_dir(cosyvoice3_dir, tmp_path_factory) -> Path:
    """The checkpoint the build tool converts the tiny model into (merged vocabulary, logits bias)."""
    from cosyvoice_build.hf_llm import convert_llm_to_hf

    out = tmp_path_factory.mktemp("cosyvoice3_trt_hf")
    convert_llm_to_hf(cosyvoice3_dir, out)
    return out


def render_cv3_trtllm(tiny_model_dir: Path, cosyvoice3_dir: Path, llm_dir: Path, root: Path, device: str = "cuda",
                      **engine: object) -> Path:
    engine = {"vocab_size": VOCAB.padded_vocab_size, "bias_length": VOCAB.padded_vocab_size, **engine}
    engine_dir, _ = fake_trtllm_inputs(root / "cv3_engine", max_batch_size=4, max_seq_len=MAX_SEQ_LEN, **engine)
    cv3 = CosyVoice3RenderOptions(cosyvoice3_dir, engine_dir=engine_dir, llm_dir=llm_dir, **CV3)
    return write_repository(RenderOptions(model_dir=tiny_model_dir, out=root / "repo", device=device, max_batch=4,
                                          max_seq_len=MAX_SEQ_LEN, cosyvoice3=cv3))  # fmt: skip


def test_rendered_cosyvoice3_llm_config_meets_the_pinned_backend(tiny_model_dir, cosyvoice3_dir, llm_dir, tmp_path):
    repo = render_cv3_trtllm(tiny_model_dir, cosyvoice3_dir, llm_dir, tmp_path)
    config = parse(repo / LLM / "config.pbtxt")
    assert config.backend == "tensorrtllm" and config.model_transaction_policy.decoupled
    assert check_trtllm_config(config, facts.PINNED) == []
    params = {key: value.string_value for key, value in config.parameters.items()}
    assert params["max_tokens_in_paged_kv_cache"] == str(4 * MAX_SEQ_LEN)
    # the orchestrators decode on it with the checkpoint's bias, the repetition penalty and the loop guard
    for name in (contract.COSYVOICE3_OFFLINE_MODEL, contract.COSYVOICE3_STREAMING_MODEL):
        read = CosyVoice3OrchestratorParams.from_parameters(parameters(parse(repo / name / "config.pbtxt")), name)
        assert read.models.llm_model == LLM and not read.models.llm_deliver_at
        assert read.llm_logits_bias == (llm_dir / LOGITS_BIAS_FILE).resolve()
        assert read.llm_repetition_penalty == pytest.approx(1.1) and read.loop_guard is not None
    # cosyvoice3_engine only runs token2wav (no second copy of the LLM on the GPU)
    assert not CosyVoice3EngineParams.from_parameters(parameters(parse(repo / ENGINE / "config.pbtxt")), ENGINE).llm


def test_without_an_engine_cosyvoice3_keeps_its_pytorch_llm(tiny_model_dir, cosyvoice3_dir, tmp_path):
    repo = write_repository(RenderOptions(model_dir=tiny_model_dir, out=tmp_path / "repo",
                                          cosyvoice3=CosyVoice3RenderOptions(cosyvoice3_dir)))
    assert not (repo / LLM).exists() and not (repo / ENGINE).exists()
    # the streaming entry model is the engine's process, and the offline one calls the engine there
    stream = contract.COSYVOICE3_STREAMING_MODEL
    hosted = CosyVoice3EngineEntryParams.from_parameters(parameters(parse(repo / stream / "config.pbtxt")), stream)
    assert hosted.engine.llm and hosted.orchestrator.models.llm_model == stream
    read = CosyVoice3OrchestratorParams.from_parameters(
        parameters(parse(repo / contract.COSYVOICE3_OFFLINE_MODEL / "config.pbtxt")), contract.COSYVOICE3_OFFLINE_MODEL)
    assert read.llm_logits_bias is None and read.loop_guard is None
    assert read.models.llm_model == read.models.token2wav_model == stream


@pytest.mark.parametrize(
    "options, message",
    [
        ({"device": "cpu"}, r"--cosyvoice3-engine-dir needs --device cuda"),
        ({"logits_dtype": "float16"}, r"the CosyVoice3 engine's logits are float16, not float32"),
        ({"version": "1.0.0"}, r"--cosyvoice3-engine-dir: .*TensorRT-LLM 1\.0\.0"),
        ({"vocab_size": 158336}, r"holds 158720 values but the engine's vocab_size is 158336"),
    ],
)
def test_render_refuses_a_cosyvoice3_engine_the_requests_do_not_fit(tiny_model_dir, cosyvoice3_dir, llm_dir, tmp_path,
                                                                     options, message):
    with pytest.raises(RenderError, match=message):
        render_cv3_trtllm(tiny_model_dir, cosyvoice3_dir, llm_dir, tmp_path, **options)


def test_render_refuses_a_checkpoint_converted_from_cosyvoice2(tiny_model_dir, cosyvoice3_dir, tmp_path):
    """A CosyVoice2 conversion puts sos elsewhere: the orchestrators' ids would mean other rows."""
    from cosyvoice_build.hf_llm import convert_llm_to_hf

    cv2_hf = tmp_path / "cv2_hf"
    layout = convert_llm_to_hf(write_tiny_cosyvoice2(tmp_path / "cv2"), cv2_hf)
    with pytest.raises(RenderError, match=rf"was not converted from this CosyVoice3 model .*sos at {layout.sos_id}"):
        render_cv3_trtllm(tiny_model_dir, cosyvoice3_dir, cv2_hf, tmp_path / "r", bias_length=layout.padded_vocab_size,
                          vocab_size=layout.padded_vocab_size)


@pytest.fixture(scope="module")
def recording_stack(tiny_model_dir, cosyvoice3_dir, llm_dir, tmp_path_factory, triton_server_factory):
    """A CPU repository serving the TensorRT-LLM render's CosyVoice3 orchestrators and `cosyvoice3_llm` config
    (stand-in behind it)."""
    root = tmp_path_factory.mktemp("cv3_conformance")
    trt_repo = render_cv3_trtllm(tiny_model_dir, cosyvoice3_dir, llm_dir, root / "trt")
    repo = write_repository(RenderOptions(model_dir=tiny_model_dir, out=root / "repo", max_batch=4,
                                          max_seq_len=MAX_SEQ_LEN, cosyvoice3=CosyVoice3RenderOptions(cosyvoice3_dir, **CV3)))
    # the entry models and the token2wav-only engine as the TRT render has them (the engine on the CPU here)
    for name in (contract.COSYVOICE3_OFFLINE_MODEL, contract.COSYVOICE3_STREAMING_MODEL, ENGINE):
        shutil.rmtree(repo / name, ignore_errors=True)
        shutil.copytree(trt_repo / name, repo / name)
    engine_config = repo / ENGINE / "config.pbtxt"
    engine_config.write_text(engine_config.read_text().replace('string_value: "cuda:0"', 'string_value: "cpu"'))
    record_dir = root / "requests"
    record_dir.mkdir()
    config = (trt_repo / LLM / "config.pbtxt").read_text().replace('backend: "tensorrtllm"', 'backend: "python"', 1)
    config += f'\nparameters: {{ key: "record_dir" value: {{ string_value: "{record_dir}" }} }}\n'
    (repo / LLM / "1").mkdir(parents=True)
    (repo / LLM / "config.pbtxt").write_text(config)
    (repo / LLM / "1" / "model.py").write_text("from tests.triton.trtllm_standin import TritonPythonModel  # noqa: F401\n")
    server = triton_server_factory(repo, ready_timeout=240)
    yield server, record_dir
    server.cleanup()


async def test_every_cosyvoice3_request_to_the_engine_is_one_the_pinned_backend_reads(recording_stack, llm_dir):
    server, record_dir = recording_stack
    async with aio.InferenceServerClient(server.grpc_url) as client:
        result = await client.infer(contract.COSYVOICE3_OFFLINE_MODEL, synthesis_inputs("One offline request.", seed=3))
        chunks = await streamed_chunks(client, contract.COSYVOICE3_STREAMING_MODEL,
                                       synthesis_inputs("One streaming request.", seed=4))
    # the stand-in answers the prompt's last speech ids then the end id: audio from those tokens, the end id none
    assert 0 < int(result.as_numpy(contract.OUTPUT_TOKENS.name)[0]) <= 12 and chunks[-1].final
    requests = recorded(record_dir, stops=2)
    generation = [r for r in requests if "stop" not in r]
    assert len(generation) >= 2 and any("stop" in r for r in requests)
    assert {bool(r["streaming"].reshape(-1)[0]) for r in generation} == {False, True}
    bias = load_file(str(llm_dir / LOGITS_BIAS_FILE))[LOGITS_BIAS_KEY]
    for tensors in requests:
        assert facts.check_request(tensors, facts.PINNED, () if "stop" in tensors else ROLES) == []
    for tensors in generation:
        ids = tensors["input_ids"].reshape(-1)
        assert ids[0] == VOCAB.sos_id == 158497 and np.count_nonzero(ids == VOCAB.task_id_id) == 1
        task = int(np.flatnonzero(ids == VOCAB.task_id_id)[0])
        assert (ids[1:task] < VOCAB.speech_offset).all()  # text ids before task, speech ids after it
        assert ((ids[task + 1 :] >= VOCAB.speech_offset) & (ids[task + 1 :] < VOCAB.sos_id)).all()
        assert int(tensors["end_id"].reshape(-1)[0]) == int(tensors["pad_id"].reshape(-1)[0]) == 158497
        words, offsets = tensors["stop_words_list"].reshape(2, -1)
        assert words.tolist() == list(range(158498, 158697)) and offsets.tolist() == list(range(1, 200))
        np.testing.assert_array_equal(tensors["embedding_bias"].reshape(-1), bias)
        assert tensors["repetition_penalty"].reshape(-1)[0] == pytest.approx(1.1)
        assert int(tensors["min_length"].reshape(-1)[0]) >= 2  # the end id is masked below 2x the text ids
