"""Render tool: option errors, idempotence, safe re-render, the TensorRT-LLM config's structure."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
from google.protobuf import text_format
from tritonclient.grpc import model_config_pb2

from cosyvoice2.vocab import SpeechVocabLayout
from speech_serving.errors import InvalidInput
from speech_serving.io_struct import LLMRequest
import pipeline_contract as contract
from triton_repo import internal_io as io
from triton_repo.render import (
    MARKER,
    RenderError,
    RenderOptions,
    check_trtllm_config,
    main,
    render_repository,
    write_repository,
)
from tests.triton.trtllm_fakes import fake_trtllm_inputs


def tree(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}




def test_render_is_idempotent_and_rerender_replaces_the_old_repository(tiny_model_dir, tmp_path):
    options = RenderOptions(model_dir=tiny_model_dir, out=tmp_path / "repo", first_hop=10)
    first = tree(write_repository(options))
    assert tree(write_repository(options)) == first  # same options, byte-identical
    assert {name.split("/")[0] for name in first} >= {contract.OFFLINE_MODEL, contract.STREAMING_MODEL}
    write_repository(replace(options, first_hop=20, instances={contract.OFFLINE_MODEL: 3}))
    changed = tree(tmp_path / "repo")
    assert changed != first and b'string_value: "20"' in changed[f"{contract.STREAMING_MODEL}/config.pbtxt"]
    assert b"count: 3" in changed[f"{contract.OFFLINE_MODEL}/config.pbtxt"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["repo"]  # no staging or backup left behind


def test_every_rendered_config_parses_and_both_pipeline_models_are_present(tiny_model_dir, tmp_path):
    repo = write_repository(RenderOptions(model_dir=tiny_model_dir, out=tmp_path / "repo"))
    configs = {}
    for path in repo.glob("*/config.pbtxt"):
        config = model_config_pb2.ModelConfig()
        text_format.Parse(path.read_text(), config)
        configs[config.name] = config
    assert configs[contract.OFFLINE_MODEL].model_transaction_policy.decoupled is False
    assert configs[contract.STREAMING_MODEL].model_transaction_policy.decoupled is True
    assert [t.name for t in configs[contract.OFFLINE_MODEL].input] == [s.name for s in contract.INPUTS]
    assert configs["audio_tokenizer"].dynamic_batching is not None and configs["audio_tokenizer"].max_batch_size > 0


@pytest.mark.parametrize(
    "change, message",
    [
        ({"llm_backend": "vllm"}, "--llm-backend"),
        ({"dtype": "bf16"}, "needs --device cuda"),
        ({"first_hop": 2}, "--first-hop must be >= 4"),
        ({"max_batch": 0}, "--max-batch must be >= 1"),
        ({"instances": {"token2wav": 2}}, "per-request state"),
        ({"instances": {"nope": 1}}, "only cosyvoice2"),
        ({"benchmark_speech_ratio": 0.0}, "--benchmark-speech-ratio must be > 0"),
        ({"llm_backend": "tensorrt_llm", "device": "cuda"}, "needs --engine-dir"),
        ({"llm_backend": "tensorrt_llm", "device": "cuda", "layout": "colocated"}, "colocated needs --llm-backend pytorch"),
        ({"layout": "shared"}, "--layout must be one of colocated, single, got 'shared'"),
        ({"instances": {"engine": 2}}, "per-request state"),
        ({"llm_delivery": "bytes"}, "--llm-delivery must be one of chunk, token"),
        ({"llm_backend": "tensorrt_llm", "device": "cuda", "llm_delivery": "chunk"}, "chunk needs --llm-backend pytorch"),
        ({"token2wav": "bigvgan"}, "--token2wav must be one of unet, dit"),
        ({"token2wav": "dit"}, "--token2wav dit needs --dit-dir"),
        ({"token2wav": "dit", "dit_dir": Path("/nonexistent/token2wav")}, "--dit-dir: .* does not exist"),
        ({"dit_dir": Path("/nonexistent/token2wav")}, "--dit-dir is only used with --token2wav dit"),
        ({"layout": "single", "llm_yield": "lone"}, "--llm-yield lone needs --layout colocated"),
        ({"llm_yield": "first_chunks"}, "--llm-yield must be one of off, lone, got .first_chunks."),
    ],
)
def test_bad_options_are_refused_with_a_clear_message(tiny_model_dir, tmp_path, change, message):
    with pytest.raises(RenderError, match=message):
        write_repository(replace(RenderOptions(model_dir=tiny_model_dir, out=tmp_path / "repo"), **change))
    assert not (tmp_path / "repo").exists()


def test_missing_model_files_and_foreign_output_dirs_are_refused(tiny_model_dir, tmp_path):
    with pytest.raises(RenderError, match="lacks flow.pt"):
        empty = tmp_path / "empty_model"
        empty.mkdir()
        for name in ("llm.pt", "hift.pt", "campplus.onnx", "speech_tokenizer_v2.onnx", "CosyVoice-BlankEN"):
            (empty / name).touch()
        write_repository(RenderOptions(model_dir=empty, out=tmp_path / "repo"))
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "precious.txt").write_text("keep me")
    with pytest.raises(RenderError, match="not rendered by this tool"):
        write_repository(RenderOptions(model_dir=tiny_model_dir, out=foreign))
    assert (foreign / "precious.txt").read_text() == "keep me"


def test_cli_reports_errors_and_renders(tiny_model_dir, tmp_path, capsys):
    assert main(["--model-dir", str(tmp_path / "nowhere"), "--out", str(tmp_path / "r")]) == 2
    assert "is not a directory" in capsys.readouterr().err
    assert main(["--model-dir", str(tiny_model_dir), "--out", str(tmp_path / "r"), "--instances", "cosyvoice2=2"]) == 0
    assert (tmp_path / "r" / MARKER).is_file()


def test_tensorrt_llm_config_is_complete_and_consistent(tiny_model_dir, tmp_path):
    engine, llm_dir = fake_trtllm_inputs(tmp_path)
    repo = render_repository(
        tmp_path / "repo", tiny_model_dir, llm_backend="trtllm", llm_dir=llm_dir, engine_dir=engine,
        max_batch=16, max_seq_len=2048,
    )  # fmt: skip
    config = model_config_pb2.ModelConfig()
    text_format.Parse((repo / "llm" / "config.pbtxt").read_text(), config)
    assert config.backend == "tensorrtllm" and config.model_transaction_policy.decoupled
    assert check_trtllm_config(config) == []
    params = {k: v.string_value for k, v in config.parameters.items()}
    assert params["max_tokens_in_paged_kv_cache"] == str(16 * 2048) and params["gpt_model_path"] == str(engine.resolve())
    assert {"embedding_bias", "stop_words_list", "min_length", "random_seed", "stop"} <= {t.name for t in config.input}
    orchestrator = (repo / contract.OFFLINE_MODEL / "config.pbtxt").read_text()
    assert str((llm_dir / "logits_bias.safetensors").resolve()) in orchestrator
    # the checker catches the upstream mistakes
    config.parameters["max_tokens_in_paged_kv_cache"].string_value = "2560"
    config.model_transaction_policy.decoupled = False
    errors = " ".join(check_trtllm_config(config))
    assert "KV pool 2560" in errors and "decoupled" in errors


def test_tensorrt_llm_limits_are_checked_against_the_engine(tiny_model_dir, tmp_path):
    engine, llm_dir = fake_trtllm_inputs(tmp_path, max_batch_size=8)
    with pytest.raises(RenderError, match="exceeds the engine's max_batch_size 8"):
        render_repository(tmp_path / "repo", tiny_model_dir, llm_backend="trtllm", llm_dir=llm_dir, engine_dir=engine)


def parsed_configs(repo: Path) -> dict[str, model_config_pb2.ModelConfig]:
    configs = {}
    for path in repo.glob("*/config.pbtxt"):
        config = model_config_pb2.ModelConfig()
        text_format.Parse(path.read_text(), config)
        configs[config.name] = config
    return configs


def parameters(config: model_config_pb2.ModelConfig) -> dict[str, str]:
    return {key: value.string_value for key, value in config.parameters.items()}


def test_the_default_layout_hosts_llm_and_token2wav_in_the_streaming_entry_model(tiny_model_dir, tmp_path):
    repo = write_repository(RenderOptions(model_dir=tiny_model_dir, out=tmp_path / "repo", max_batch=4))
    configs = parsed_configs(repo)
    assert not {"engine", "llm", "token2wav"} & configs.keys()
    engine = configs[contract.STREAMING_MODEL]
    assert "engine_entry" in (repo / contract.STREAMING_MODEL / "1" / "model.py").read_text()  # the adapter hosting it
    assert engine.backend == "python" and engine.model_transaction_policy.decoupled
    assert engine.max_batch_size == 0 and [g.count for g in engine.instance_group] == [1]
    inputs = {t.name: t for t in engine.input}
    contract_inputs = [s.name for s in contract.INPUTS]
    engine_inputs = [s.name for s in (*io.PYTORCH_LLM_INPUTS, *io.TOKEN2WAV_INPUTS) if s.name not in contract_inputs]
    assert list(inputs) == contract_inputs + engine_inputs and all(t.optional for t in inputs.values())
    assert list(inputs["input_ids"].dims) == [-1, -1]  # the LLM's batch dimension is explicit
    assert {t.name for t in engine.output} >= {"output_ids", "sequence_length", "waveform"}
    params = parameters(engine)
    assert params["max_batch"] == "4" and params["first_hop"] == "25" and params["device"] == "cpu"
    for pipeline_model in (contract.OFFLINE_MODEL, contract.STREAMING_MODEL):
        orchestrator = parameters(configs[pipeline_model])
        assert (orchestrator["llm_model"], orchestrator["token2wav_model"]) == ((contract.STREAMING_MODEL,) * 2)
        assert orchestrator["token2wav_decoupled"] == "true"
    assert json.loads((repo / MARKER).read_text())["layout"] == "colocated"


def test_the_single_layout_renders_separate_llm_and_token2wav_models(tiny_model_dir, tmp_path):
    assert main(["--model-dir", str(tiny_model_dir), "--out", str(tmp_path / "repo"), "--layout", "single"]) == 0
    configs = parsed_configs(tmp_path / "repo")
    assert {"llm", "token2wav"} <= configs.keys() and "engine" not in configs
    assert configs["llm"].model_transaction_policy.decoupled and configs["llm"].max_batch_size == 16
    assert not configs["token2wav"].model_transaction_policy.decoupled
    orchestrator = parameters(configs[contract.STREAMING_MODEL])
    assert (orchestrator["llm_model"], orchestrator["token2wav_model"]) == ("llm", "token2wav")
    assert orchestrator["token2wav_decoupled"] == "false"


def test_tensorrt_llm_defaults_to_the_single_layout(tiny_model_dir, tmp_path):
    engine, llm_dir = fake_trtllm_inputs(tmp_path)
    repo = render_repository(
        tmp_path / "repo", tiny_model_dir, llm_backend="trtllm", llm_dir=llm_dir, engine_dir=engine
    )
    configs = parsed_configs(repo)
    assert {"llm", "token2wav"} <= configs.keys()
    assert json.loads((repo / MARKER).read_text())["layout"] == "single"
    # TensorRT-LLM streams per token: no delivery schedule declared, none sent
    assert "deliver_at" not in {t.name for t in configs["llm"].input}
    assert parameters(configs[contract.STREAMING_MODEL])["llm_deliver_at"] == "false"


@pytest.mark.parametrize(("layout", "llm_model"), [("colocated", contract.STREAMING_MODEL), ("single", "llm")])
@pytest.mark.parametrize(("delivery", "sent"), [(None, "true"), ("chunk", "true"), ("token", "false")])
def test_the_pytorch_llm_takes_a_delivery_schedule_and_the_orchestrator_sends_it_unless_told_not_to(
    tiny_model_dir, tmp_path, layout, llm_model, delivery, sent
):
    repo = write_repository(
        RenderOptions(model_dir=tiny_model_dir, out=tmp_path / "repo", layout=layout, llm_delivery=delivery)
    )
    configs = parsed_configs(repo)
    assert "deliver_at" in {t.name for t in configs[llm_model].input}  # declared either way: old callers still fit
    for pipeline_model in (contract.OFFLINE_MODEL, contract.STREAMING_MODEL):
        assert parameters(configs[pipeline_model])["llm_deliver_at"] == sent


def test_engine_requests_are_told_apart_by_their_inputs():
    llm = io.llm_stop_tensors().keys()
    token2wav = io.token2wav_close_tensors("r1").keys()
    assert io.engine_request_kind(llm) == io.LLM_KIND
    assert io.engine_request_kind(token2wav) == io.TOKEN2WAV_KIND
    assert not {s.name for s in io.LLM_INPUTS} & {s.name for s in io.TOKEN2WAV_INPUTS}  # no ambiguous name
    for names in ([], ["seed"], [*llm, "stream_id"], ["input_ids", "input_lengths"], [*token2wav, "stop"]):
        with pytest.raises(InvalidInput, match=r"^\[invalid_input\] engine: inputs"):
            io.engine_request_kind(names)


def test_a_delivery_schedule_round_trips_through_the_llm_tensors_and_bad_ones_are_refused():
    vocab = SpeechVocabLayout(text_vocab_size=1000, speech_token_size=50)
    request = LLMRequest(np.arange(5, dtype=np.int32), 2, 90, 7, 25, 0.8, 1.0, True, deliver_at=(8, 18, 38, 68))
    arrays = io.llm_request_tensors(request, vocab, None, deliver_at=True)
    assert io.parse_llm_request(arrays)[0].deliver_at == (8, 18, 38, 68)
    assert io.DELIVER_AT.name not in io.llm_request_tensors(request, vocab, None)  # TensorRT-LLM: never sent
    assert io.parse_llm_request(io.llm_request_tensors(request, vocab, None))[0].deliver_at is None
    for bad in ([8, 8], [18, 8], [0, 8]):
        arrays[io.DELIVER_AT.name] = np.array([bad], np.int32)
        with pytest.raises(InvalidInput, match=r"deliver_at must be ascending positive"):
            io.parse_llm_request(arrays)


def test_the_dit_token2wav_is_selected_by_option_and_needs_its_files(tiny_model_dir, tmp_path, capsys):
    from cosyvoice2.testing.dit import write_dit_model

    dit_dir = write_dit_model(tmp_path / "dit")
    repo = write_repository(RenderOptions(model_dir=tiny_model_dir, out=tmp_path / "repo", token2wav="dit",
                                          dit_dir=dit_dir))
    params = parameters(parsed_configs(repo)[contract.STREAMING_MODEL])
    assert (params["token2wav"], params["dit_dir"]) == ("dit", str(dit_dir.resolve()))
    unet = parameters(parsed_configs(write_repository(RenderOptions(model_dir=tiny_model_dir,
                                                                    out=tmp_path / "unet")))[contract.STREAMING_MODEL])
    assert (unet["token2wav"], unet.get("dit_dir")) == ("unet", None)  # an unset optional parameter is left out
    (dit_dir / "hift.pt").unlink()
    assert main(["--model-dir", str(tiny_model_dir), "--out", str(tmp_path / "r"), "--token2wav", "dit",
                 "--dit-dir", str(dit_dir)]) == 2
    assert "lacks hift.pt" in capsys.readouterr().err
    assert not (tmp_path / "r").exists()


def test_a_dit_flow_that_cannot_take_the_llms_tokens_or_chunks_is_refused(tiny_model_dir, tmp_path):
    from cosyvoice2.testing.dit import micro_dit_config, write_dit_model

    micro = micro_dit_config()
    small_vocab = write_dit_model(tmp_path / "vocab", replace(micro, vocab_size=4096))
    with pytest.raises(RenderError, match="knows 4096 speech tokens, the LLM emits 6561"):
        write_repository(RenderOptions(model_dir=tiny_model_dir, out=tmp_path / "a", token2wav="dit",
                                       dit_dir=small_vocab))
    lookahead = write_dit_model(tmp_path / "lookahead",
                                replace(micro, encoder=replace(micro.encoder, pre_lookahead_len=5)))
    with pytest.raises(RenderError, match="lookahead is 5 tokens, the chunk schedule sends 3"):
        write_repository(RenderOptions(model_dir=tiny_model_dir, out=tmp_path / "b", token2wav="dit",
                                       dit_dir=lookahead))
    (lookahead / "flow.yaml").write_text("flow: [not, a, mapping]\n")
    with pytest.raises(RenderError, match="is not a DiT flow config"):
        write_repository(RenderOptions(model_dir=tiny_model_dir, out=tmp_path / "c", token2wav="dit",
                                       dit_dir=lookahead))
