"""Typed model parameters: what render writes into each config.pbtxt is what the model's adapter reads back."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch

import pipeline_contract as contract
from cosyvoice2.flow.memory import FlowMemoryPlan
from cosyvoice2.flow.packed import PACKED_ROWS
from speech_serving.repetition import LoopGuardConfig
from speech_serving.schedule import StreamScheduleParams
from triton_repo import render_models
from triton_repo.model_params import (
    EngineEntryParams,
    AudioModelParams,
    BenchmarkMode,
    CosyVoice3EngineEntryParams,
    EngineParams,
    LLMParams,
    OrchestratorParams,
    ParameterError,
    SparkEngineParams,
    SparkOrchestratorParams,
    Token2WavParams,
    VoicePromptParams,
)
from cosyvoice3.loading import load_config as load_cosyvoice3_config
from cosyvoice3.testing import write_tiny_model as write_tiny_cosyvoice3
from spark_tts.streaming import ChunkSchedule
from spark_tts.testing import write_tiny_model
from triton_repo import cosyvoice3_render, spark_render
from triton_repo.render import (MARKER, CosyVoice3RenderOptions, RenderError, RenderOptions, main, render_repository,
                                write_repository)
from triton_repo.spark_render import SparkRenderOptions
from tests.triton.test_render import parameters, parsed_configs
from tests.triton.trtllm_fakes import fake_trtllm_inputs

#: The class each rendered model's adapter reads its parameters with.
ADAPTER_PARAMS = {
    contract.OFFLINE_MODEL: OrchestratorParams,
    contract.STREAMING_MODEL: OrchestratorParams,
    "voice_prompt": VoicePromptParams,
    "audio_tokenizer": AudioModelParams,
    "speaker_embedding": AudioModelParams,
    "llm": LLMParams,
    "token2wav": Token2WavParams,
    contract.SPARK_OFFLINE_MODEL: SparkOrchestratorParams,
    contract.SPARK_STREAMING_MODEL: SparkOrchestratorParams,
    spark_render.VOICE_PROMPT: VoicePromptParams,
    spark_render.AUDIO_TOKENIZER: AudioModelParams,
    spark_render.ENGINE: SparkEngineParams,
}


def _hosts_engine(opts: RenderOptions, model: str) -> bool:
    """Whether `model` is the colocated layout's streaming entry model, the engine's process."""
    return model == contract.STREAMING_MODEL and opts.layout in (None, "colocated")


def _params_class(opts: RenderOptions, model: str) -> type:
    return EngineEntryParams if _hosts_engine(opts, model) else ADAPTER_PARAMS[model]


def _expected(opts: RenderOptions, model: str) -> object:
    """What render meant to give `model`, as the typed object."""
    if _hosts_engine(opts, model):
        return EngineEntryParams(render_models.orchestrator_params(opts), render_models.engine_params(opts))
    if model in (contract.OFFLINE_MODEL, contract.STREAMING_MODEL):
        return render_models.orchestrator_params(opts)
    if model == "llm":
        return render_models.llm_params(opts)
    if model == "token2wav":
        return render_models.token2wav_params(opts)
    if model == "voice_prompt":
        return VoicePromptParams(opts.voice_cache)
    return AudioModelParams(opts.model_dir.resolve(), opts.model_device)


@pytest.mark.parametrize(
    "options",
    [
        {},
        {"layout": "single", "first_hop": 10, "chunk_growth": 3, "flow_cache": "exact", "flow_cache_gb": 0.0,
         "align_first_hop": "never", "busy_streams": 8},
        {"benchmark_speech_ratio": 3.5, "voice_cache": 7, "max_seq_len": 2048, "llm_yield": "off"},
        {"layout": "single", "device": "cuda", "dtype": "fp16"},
        {"device": "cuda", "dtype": "bf16", "llm_yield": "lone", "flow_cache_gb": 4.5, "token2wav_rows": 32},
    ],
    ids=["colocated", "single", "benchmark", "single-cuda", "colocated-cuda"],
)
def test_every_rendered_model_reads_back_what_render_wrote(tiny_model_dir, tmp_path, options):
    opts = RenderOptions(model_dir=tiny_model_dir, out=tmp_path / "repo", **options)
    configs = parsed_configs(write_repository(opts))
    for name, config in configs.items():
        read = _params_class(opts, name).from_parameters(parameters(config), name)
        assert read == _expected(opts, name), name
    token2wav = configs.get("token2wav") or configs[contract.STREAMING_MODEL]
    read_token2wav = _params_class(opts, token2wav.name).from_parameters(parameters(token2wav))
    read_token2wav = read_token2wav.engine.token2wav if isinstance(read_token2wav, EngineEntryParams) else read_token2wav
    # the options reach token2wav, through the engine's entry model where it is colocated
    assert (read_token2wav.flow_cache, read_token2wav.flow_cache_gb, read_token2wav.token2wav_rows) == (
        opts.flow_cache, opts.flow_cache_gb, opts.token2wav_rows)
    engine_or_llm = configs.get("llm") or configs[contract.STREAMING_MODEL]
    benchmark = _params_class(opts, engine_or_llm.name).from_parameters(parameters(engine_or_llm))
    llm = benchmark.engine.llm if isinstance(benchmark, EngineEntryParams) else benchmark
    ratio = options.get("benchmark_speech_ratio")
    assert llm.benchmark == (BenchmarkMode(ratio) if ratio else None)  # one option, in the LLM and the orchestrators
    orchestrator = OrchestratorParams.from_parameters(parameters(configs[contract.OFFLINE_MODEL]))
    assert orchestrator.benchmark == llm.benchmark
    assert orchestrator.schedule == StreamScheduleParams(opts.first_hop, opts.chunk_growth, opts.align_first_hop,
                                                         min(opts.lone_first_hop, opts.first_hop), opts.busy_streams)
    # the orchestrators address the token2wav model rendered, the colocated engine's (the streaming entry model's)
    # when there is none
    assert orchestrator.models.token2wav_model == ("token2wav" if "token2wav" in configs else contract.STREAMING_MODEL)
    # every torch and ONNX model runs on the rendered device: cuda:0, the first GPU its tritonserver sees
    devices = {read.device for read in (AudioModelParams.from_parameters(parameters(configs[name]))
                                        for name in ("audio_tokenizer", "speaker_embedding"))}  # fmt: skip
    assert devices == {"cpu" if opts.device == "cpu" else "cuda:0"}


@pytest.mark.parametrize("given", [10.0, 0.0, None], ids=["set", "no-limit", "sized-to-the-gpu"])
def test_the_flow_cache_budget_reaches_token2wav(tiny_model_dir, tmp_path, given):
    opts = RenderOptions(model_dir=tiny_model_dir, out=tmp_path / "repo", layout="single", flow_cache_gb=given)
    read = Token2WavParams.from_parameters(parameters(parsed_configs(write_repository(opts))["token2wav"]))
    assert read.flow_cache_gb == given  # None: left out of the parameters, sized at start (cosyvoice2.flow.memory)


@pytest.mark.parametrize(("given", "budget"), [({}, 16 * 2**30), ({"flow_cache_gb": 0.5}, 2**29),
                                              ({"flow_cache_gb": 0.0}, None)], ids=["default", "set", "no-limit"])
def test_the_cosyvoice3_flow_cache_budget_reaches_its_engine(tiny_model_dir, tmp_path, given, budget, adapters):
    """CosyVoice3's own `flow_cache_gb`, not CosyVoice2's option of that name (set apart here), reaches the
    engine's parameters (in `cosyvoice3_stream`, the engine's process) and its token2wav's budget; 0 means no
    limit, left open it is sized to the GPU (off a GPU: 16 GiB, the 80 GB-class default)."""
    cv3_dir = write_tiny_cosyvoice3(tmp_path / "cv3", seed=3)
    opts = RenderOptions(model_dir=tiny_model_dir, out=tmp_path / "repo", flow_cache_gb=7.0,
                         cosyvoice3=CosyVoice3RenderOptions(cv3_dir, **given))
    configs = parsed_configs(write_repository(opts))
    hosted = CosyVoice3EngineEntryParams.from_parameters(parameters(configs[cosyvoice3_render.STREAM]))
    assert hosted.orchestrator == cosyvoice3_render.orchestrator_params(opts)
    read = hosted.engine
    assert read == cosyvoice3_render.engine_params(opts)
    assert read.flow_cache_gb == given.get("flow_cache_gb")
    handler = adapters("cosyvoice3_engine")._token2wav(replace(read, device="cpu", dtype="fp32"),
                                                      load_cosyvoice3_config(cv3_dir), torch.device("cpu"),
                                                      torch.float32)
    try:
        assert handler.service.engine.engine.budget.budget_bytes == budget
    finally:
        handler.close()


def test_the_tensorrt_llm_orchestrator_reads_back_its_logits_bias_penalty_and_loop_guard(tiny_model_dir, tmp_path):
    engine, llm_dir = fake_trtllm_inputs(tmp_path)
    repo = render_repository(tmp_path / "repo", tiny_model_dir, llm_backend="trtllm", llm_dir=llm_dir, engine_dir=engine)
    read = OrchestratorParams.from_parameters(parameters(parsed_configs(repo)[contract.OFFLINE_MODEL]))
    assert read.llm_logits_bias == (llm_dir / "logits_bias.safetensors").resolve()
    assert (read.llm_repetition_penalty, read.loop_guard, read.benchmark) == (1.1, LoopGuardConfig(), None)


def _llm(**changes) -> LLMParams:
    base = LLMParams(Path("/m"), "cpu", "fp32", max_batch=4, max_seq_len=512, max_waiting=8)
    return replace(base, **changes)


def test_the_string_form_is_flat_and_leaves_unset_options_out():
    assert _llm().to_parameters() == {
        "model_dir": "/m", "device": "cpu", "dtype": "fp32", "max_batch": "4", "max_seq_len": "512", "max_waiting": "8",
        "llm_yield": "off",
    }  # fmt: skip
    assert _llm(benchmark=BenchmarkMode(2.5)).to_parameters()["benchmark_speech_ratio"] == "2.5"


@pytest.mark.parametrize(
    "change, message",
    [
        ({"max_batch": "four"}, r"max_batch='four' is not a valid int"),
        ({"benchmark_speech_ratio": "fast"}, r"benchmark_speech_ratio='fast' is not a valid float"),
        ({"max_waiting": None}, "max_waiting is missing"),
        ({"never_stop": "true"}, "unknown parameters never_stop"),
    ],
)
def test_bad_values_are_refused_naming_the_model_the_key_and_the_value(change, message):
    params = _llm().to_parameters()
    for key, value in change.items():
        if value is None:
            del params[key]
        else:
            params[key] = value
    with pytest.raises(ParameterError, match=rf"^llm: .*{message}"):
        LLMParams.from_parameters(params, "llm")


def _orchestrator() -> OrchestratorParams:
    models = render_models.internal_models(RenderOptions(model_dir=Path("/m"), out=Path("/o")))
    return OrchestratorParams(Path("/m"), "pytorch", 4096, 300, StreamScheduleParams(), models, voice_cache=64)


def test_booleans_nested_checks_and_shared_keys_are_strict():
    params = _orchestrator().to_parameters()
    assert params["token2wav_decoupled"] == "true" and "loop_max_run" not in params
    with pytest.raises(ParameterError, match="token2wav_decoupled='yes' is not a valid bool"):
        OrchestratorParams.from_parameters({**params, "token2wav_decoupled": "yes"})
    guard = {"loop_max_run": "1", "loop_max_period": "4", "loop_max_cycle_tokens": "50"}
    with pytest.raises(ParameterError, match="loop guard limits"):  # the class's own check, reported as a parameter error
        OrchestratorParams.from_parameters({**params, **guard})
    token2wav = Token2WavParams(Path("/m"), "cuda:1", "fp32", StreamScheduleParams(), "chunked", 32.0)
    with pytest.raises(ParameterError, match="device has two values"):
        EngineParams(_llm(device="cuda:0"), token2wav).to_parameters()


def test_the_command_line_the_library_call_and_the_options_default_to_the_same_device(tiny_model_dir, tmp_path):
    assert RenderOptions(model_dir=tiny_model_dir, out=tmp_path, llm_backend="trtllm").device == "cuda"
    assert RenderOptions(model_dir=tiny_model_dir, out=tmp_path, layout="single").device == "cpu"
    assert main(["--model-dir", str(tiny_model_dir), "--out", str(tmp_path / "cli"), "--layout", "single"]) == 0
    render_repository(tmp_path / "lib", tiny_model_dir, layout="single")
    cli, lib = (json.loads((tmp_path / name / MARKER).read_text()) for name in ("cli", "lib"))
    assert cli == lib and cli["device"] == "cpu"


@pytest.mark.parametrize(
    "layout, rendered, device", [("colocated", None, "cpu"), ("single", "cuda", "cuda:0")], ids=["cpu", "cuda"]
)
def test_the_spark_models_read_back_what_render_wrote(tiny_model_dir, tmp_path, layout, rendered, device):
    spark_dir = write_tiny_model(tmp_path / "spark", seed=1)
    spark = SparkRenderOptions(spark_dir, max_new_tokens=99, first_chunk_tokens=7, chunk_scale=1.5, max_seq_len=999)
    opts = RenderOptions(
        model_dir=tiny_model_dir, out=tmp_path / "repo", voice_cache=5, max_batch=3, spark=spark, layout=layout,
        device=rendered,
    )
    configs = parsed_configs(write_repository(opts))
    read = {name: ADAPTER_PARAMS[name].from_parameters(parameters(configs[name]), name) for name in spark_render.MODELS}
    for name in (contract.SPARK_OFFLINE_MODEL, contract.SPARK_STREAMING_MODEL):
        assert read[name] == SparkOrchestratorParams(
            spark_dir.resolve(), sample_rate=16_000, max_new_tokens=99, max_seq_len=999,
            max_target_text_tokens=opts.max_target_text_tokens, schedule=ChunkSchedule(7, 1.5, spark.max_chunk_tokens),
            voice_cache=5,
        )  # fmt: skip
    assert read[spark_render.VOICE_PROMPT] == VoicePromptParams(5)
    # the Spark models run on the rendered device in every layout
    assert read[spark_render.AUDIO_TOKENIZER] == AudioModelParams(spark_dir.resolve(), device)
    assert read[spark_render.ENGINE] == SparkEngineParams(
        spark_dir.resolve(), device, "fp32", max_batch=3, max_seq_len=999, max_waiting=opts.max_waiting
    )
    # the stream's schedule is checked by its own class when read back
    bad = {**parameters(configs[contract.SPARK_STREAMING_MODEL]), "scale": "0.5"}
    with pytest.raises(ParameterError, match=f"^{contract.SPARK_STREAMING_MODEL}: .*scale >= 1"):
        SparkOrchestratorParams.from_parameters(bad, contract.SPARK_STREAMING_MODEL)


def test_spark_benchmark_mode_reaches_its_orchestrators_and_engine_only_when_asked(tiny_model_dir, tmp_path):
    spark_dir = write_tiny_model(tmp_path / "spark", seed=1)
    for ratio, expected in ((None, None), (3.3, BenchmarkMode(3.3))):
        opts = RenderOptions(model_dir=tiny_model_dir, out=tmp_path / f"repo-{ratio}",
                             spark=SparkRenderOptions(spark_dir, benchmark_ratio=ratio))
        configs = parsed_configs(write_repository(opts))
        for name in (contract.SPARK_OFFLINE_MODEL, contract.SPARK_STREAMING_MODEL, spark_render.ENGINE):
            assert ADAPTER_PARAMS[name].from_parameters(parameters(configs[name]), name).benchmark == expected
        # Spark's ratio is its own: CosyVoice2's models stay as rendered without benchmark mode
        assert OrchestratorParams.from_parameters(parameters(configs[contract.OFFLINE_MODEL])).benchmark is None
    with pytest.raises(RenderError, match="--spark-benchmark-ratio must be > 0"):
        write_repository(RenderOptions(model_dir=tiny_model_dir, out=tmp_path / "bad",
                                       spark=SparkRenderOptions(spark_dir, benchmark_ratio=0.0)))


def test_the_llm_yields_by_default_only_where_it_shares_a_process_with_token2wav(tiny_model_dir):
    """Left open, `llm_yield` is lone in the colocated layout on a GPU (measured to win there) and off elsewhere
    (the single layout refuses an explicit lone)."""
    def rendered(**options) -> str:
        opts = RenderOptions(model_dir=tiny_model_dir, out=Path("unused"), **options)
        return render_models.llm_params(opts).llm_yield

    assert rendered(device="cuda") == rendered(device="cuda", layout="colocated") == "lone"
    assert rendered(device="cuda", layout="single") == rendered() == rendered(device="cpu", layout="colocated") == "off"
    assert rendered(device="cuda", llm_yield="off") == "off"


@pytest.mark.parametrize("llm_yield", ["off", "lone"])
def test_the_colocated_engine_shares_token2wavs_calls_with_its_llm(tiny_model_dir, adapters, llm_yield):
    """The engine's LLM scheduler counts its steps beside the very calls its token2wav service marks
    (`speech_serving.gpu_yield`), and with `llm_yield` lone it waits on them as that mode says;
    `off`: it never waits."""
    EngineHandler = adapters("engine").EngineHandler  # noqa: N806 - a class
    opts = RenderOptions(model_dir=tiny_model_dir, out=Path("unused"), llm_yield=llm_yield)
    params = EngineParams(render_models.llm_params(opts), render_models.token2wav_params(opts))
    handler = EngineHandler.from_params(params)
    try:
        calls = handler.token2wav.service.calls
        assert calls is not None and handler.llm.scheduler.observed_token2wav is calls
        assert handler.llm.scheduler.yield_to is (calls if llm_yield != "off" else None)
        assert handler.llm.scheduler.yield_mode == llm_yield
    finally:
        handler.close()


@pytest.mark.parametrize("rows", [None, 32, 5])
def test_token2wav_rows_cap_the_service_and_size_every_graph_bucket(tiny_model_dir, adapters, rows):
    """`token2wav_rows` reaches the UNet engine: the service forms calls of at most that many jobs, and the packed
    solve's, the encoder's and HiFT's graphs have it as their largest row bucket (a call the service forms is never
    one that runs eagerly for its rows)."""
    Token2WavHandler = adapters("token2wav").Token2WavHandler  # noqa: N806 - a class
    opts = RenderOptions(model_dir=tiny_model_dir, out=Path("unused"), layout="single", token2wav_rows=rows)
    handler = Token2WavHandler.from_params(render_models.token2wav_params(opts))
    try:
        engine = handler.service.engine.engine  # the stream wrapper's BatchedToken2Wav's Token2Wav
        runner = engine.cached
        expected = PACKED_ROWS if rows is None else rows  # left open: the engine's own
        assert handler.service.policy.max_rows == expected
        assert runner.solve_graphs.row_count == max(runner.encoder.graphs.rows) == expected
        assert max(engine.hift.cuda_graphs.buckets.rows) == expected
    finally:
        handler.close()


def test_token2wav_sizes_what_the_render_left_open_to_its_gpu(tiny_model_dir, adapters, monkeypatch):
    """Rows and the flow caches' budget left open are sized to the model's device at start (`plan_flow_memory`,
    given the flow's key bytes per row) and both reach the engine: the service's calls, every graph's largest row
    bucket and the flow caches' book."""
    module = adapters("token2wav")
    asked = []

    def plan(device, row_bytes, rows, flow_cache_gib):
        asked.append((device, row_bytes, rows, flow_cache_gib))
        return FlowMemoryPlan(rows=4, flow_cache_gib=1.5, key_buffer_gib=0.0, device_gib=22.0)

    monkeypatch.setattr(module, "plan_flow_memory", plan)
    opts = RenderOptions(model_dir=tiny_model_dir, out=Path("unused"), layout="single")
    handler = module.Token2WavHandler.from_params(render_models.token2wav_params(opts))
    try:
        engine = handler.service.engine.engine
        (device, row_bytes, rows, flow_cache_gib), = asked
        assert (device, rows, flow_cache_gib) == (torch.device("cpu"), None, None) and row_bytes > 0
        assert handler.service.policy.max_rows == engine.cached.solve_graphs.row_count == 4
        assert engine.book.budget_bytes == int(1.5 * 2**30)
    finally:
        handler.close()


def test_token2wav_graphs_that_do_not_fit_the_gpu_stop_the_start_naming_the_settings(adapters):
    """Out of GPU memory while capturing token2wav's graphs at start is a setting too large for the GPU: the model
    fails to load with a message naming the render options that shrink it, not a bare allocator error."""
    Token2WavHandler = adapters("token2wav").Token2WavHandler  # noqa: N806 - a class

    class EngineTooLarge:
        def capture_graphs(self):
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 15.75 GiB")

    with pytest.raises(ParameterError, match="--token2wav-rows.*--flow-cache-gb") as raised:
        Token2WavHandler(EngineTooLarge(), torch.device("cpu"))
    assert isinstance(raised.value.__cause__, torch.OutOfMemoryError)
