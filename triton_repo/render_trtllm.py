"""The TensorRT-LLM engines as the render tool sees them: the engine's `config.json`, the tensorrtllm backend
parameters rendered for it, and the checks of both (CosyVoice2's `llm` and Spark's `spark_llm` alike)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from cosyvoice2.vocab import LOGITS_BIAS_FILE, LOGITS_BIAS_KEY
from pipeline_contract import TensorSpec
from triton_repo import internal_io as io
from triton_repo import trtllm_backend_facts as facts
from triton_repo.render_options import RenderError, RenderOptions

#: The engine's logits type the per-request embedding bias (float32) needs: trtllm-build --logits_dtype float32.
LOGITS_DTYPE = "float32"


def read_engine_config(engine_dir: Path) -> dict:
    """The `config.json` trtllm-build writes beside the engine: `version` (TensorRT-LLM), `pretrained_config`
    (vocab_size, logits_dtype, mapping), `build_config` (max_batch_size, max_seq_len, ...)."""
    try:
        return json.loads((engine_dir / "config.json").read_text())
    except json.JSONDecodeError as exc:
        raise RenderError(f"--engine-dir {engine_dir}: config.json is not valid JSON ({exc})") from exc


def holds_engine(engine_dir: Path) -> bool:
    return (engine_dir / "config.json").is_file() and any(engine_dir.glob("*.engine"))


def engine_tp_size(engine: dict) -> int:
    mapping = engine.get("pretrained_config", {}).get("mapping", {})
    return int(mapping.get("tp_size", 1)) * int(mapping.get("pp_size", 1))


def limit_errors(engine: dict, limits: Sequence[tuple[str, int, str]], which: str) -> list[str]:
    """(flag, our value, build_config key): a value above what the engine was built for; `which` names the engine."""
    build = engine.get("build_config", {})
    return [f"{flag} {ours} exceeds {which}'s {key} {build[key]}"
            for flag, ours, key in limits if key in build and ours > int(build[key])]


#: A TensorRT-LLM engine's share of the free GPU memory for its KV cache: the rest is for the models sharing its
#: GPU (token2wav, the audio front-end, the other pipelines' models).
KV_CACHE_FREE_GPU_MEM_FRACTION = 0.5


def trtllm_parameters(opts: RenderOptions, engine_dir: Path | None, max_seq_len: int) -> dict[str, object]:
    """The tensorrtllm backend parameters of an engine (CosyVoice2's `llm`, Spark's `spark_llm`); every one is
    set (no `${...}` left for the backend to guess)."""
    assert engine_dir is not None
    return {
        "gpt_model_type": "inflight_fused_batching",
        "gpt_model_path": engine_dir.resolve(),
        "max_beam_width": 1,
        "batch_scheduler_policy": "guaranteed_no_evict",
        "max_tokens_in_paged_kv_cache": opts.max_batch * max_seq_len,
        "max_attention_window_size": max_seq_len,
        "kv_cache_free_gpu_mem_fraction": KV_CACHE_FREE_GPU_MEM_FRACTION,
        "enable_kv_cache_reuse": "false",
        "exclude_input_in_output": "true",
        "enable_chunked_context": "false",
        "normalize_log_probs": "false",
        "cancellation_check_period_ms": 50,
        "decoding_mode": "top_k_top_p",
        # a tensor-parallel engine spans GPUs 0..tp-1 (compose also sets TRTLLM_ORCHESTRATOR=1 for it)
        "gpu_device_ids": ",".join(str(i) for i in range(engine_tp_size(read_engine_config(engine_dir)))),
        "FORCE_CPU_ONLY_INPUT_TENSORS": "no",
        "executor_worker_path": "/opt/tritonserver/backends/tensorrtllm/trtllmExecutorWorker",
        # read without a default on every load (trtllm_backend_facts): empty keeps guided decoding off
        "tokenizer_dir": "",
        "xgrammar_tokenizer_info_path": "",
        "guided_decoding_backend": "",
    }


@dataclass(frozen=True)
class TrtllmFlags:
    """The flags that name an LLM engine and its checkpoint in the error messages (CosyVoice2's by default)."""

    backend: str = "--llm-backend tensorrt_llm"  # what asks for the engine
    engine_dir: str = "--engine-dir"
    llm_dir: str = "--llm-dir"
    which: str = "the engine"


def trtllm_input_errors(opts: RenderOptions, engine_dir: Path | None, llm_dir: Path | None,
                        flags: TrtllmFlags) -> list[str]:
    """An LLM engine and its converted checkpoint (CosyVoice2's or CosyVoice3's) against what the orchestrators
    send it: the engine's limits, TensorRT-LLM version and logits type; the logits bias one value per row."""
    errors = []
    if opts.device != "cuda":
        errors.append(f"{flags.backend} needs --device cuda")
    if engine_dir is None:
        errors.append(f"{flags.backend} needs {flags.engine_dir} (the trtllm-build output)")
    elif not holds_engine(engine_dir):
        errors.append(f"{flags.engine_dir} {engine_dir} holds no TensorRT-LLM engine (config.json + rank*.engine)")
    else:
        engine = read_engine_config(engine_dir)
        errors += limit_errors(engine, (("--max-batch", opts.max_batch, "max_batch_size"),
                                        ("--max-seq-len", opts.max_seq_len, "max_seq_len")), flags.which)
        errors += facts.engine_version_problems(engine, flags.engine_dir, engine_dir)
        logits_dtype = engine.get("pretrained_config", {}).get("logits_dtype")
        if logits_dtype != LOGITS_DTYPE:
            errors.append(
                f"{flags.which}'s logits are {logits_dtype or 'of unknown type'}, not {LOGITS_DTYPE}: every request "
                'would fail ("Embedding bias data type must be same as model logits type"); rebuild it with '
                f"trtllm-build --logits_dtype {LOGITS_DTYPE} (cosyvoice-build --from engine --to engine --force)"
            )
    if llm_dir is None:
        errors.append(f"{flags.backend} needs {flags.llm_dir} (the HF checkpoint dir with {LOGITS_BIAS_FILE})")
    elif not (llm_dir / LOGITS_BIAS_FILE).is_file():
        errors.append(f"{flags.llm_dir} {llm_dir} lacks {LOGITS_BIAS_FILE} (written by the build's convert stage)")
    elif engine_dir is not None and (engine_dir / "config.json").is_file():
        errors += _logits_bias_errors(llm_dir / LOGITS_BIAS_FILE, read_engine_config(engine_dir))
    return errors


def _logits_bias_errors(path: Path, engine: dict) -> list[str]:
    """The per-request embedding bias must have one value per row of the engine's logits."""
    vocab = engine.get("pretrained_config", {}).get("vocab_size")
    try:
        length = safetensors_length(path, LOGITS_BIAS_KEY)
    except (OSError, ValueError, KeyError) as exc:
        return [f"{path} is not a safetensors file with a 1-D {LOGITS_BIAS_KEY!r} tensor ({exc})"]
    if vocab is None:
        return ["the engine's config.json has no pretrained_config.vocab_size to check the logits bias against"]
    errors = []
    if length != int(vocab):
        errors.append(
            f"{path} holds {length} values but the engine's vocab_size is {vocab}: the bias must match the engine's "
            "logits row for row (convert and build from the same checkpoint)"
        )
    tp = engine_tp_size(engine)
    if int(vocab) % tp:
        errors.append(f"vocab_size {vocab} is not a multiple of the tensor-parallel size {tp}: the logits would be padded")
    return errors


def safetensors_length(path: Path, key: str) -> int:
    """Length of the 1-D tensor `key` from the file's header alone (8-byte size + JSON; no tensor is read)."""
    with open(path, "rb") as f:
        size = int.from_bytes(f.read(8), "little")
        if not 2 <= size <= 100_000_000:
            raise ValueError("bad header size")
        header = json.loads(f.read(size))
    shape = header[key]["shape"]
    if len(shape) != 1:
        raise ValueError(f"shape {shape} is not 1-D")
    return int(shape[0])


def check_trtllm_config(config, backend: facts.BackendFacts = facts.PINNED,  # noqa: ANN001 - a ModelConfig
                        sent: Sequence[TensorSpec] = io.LLM_INPUTS, read: Sequence[TensorSpec] = io.LLM_OUTPUTS
                        ) -> list[str]:
    """A tensorrt_llm model's parameters and tensors: what `backend` requires (trtllm_backend_facts), and what
    this repository relies on, consistent with each other. `sent`: the inputs its callers send (CosyVoice2's
    orchestrators by default; Spark's: `spark_io.TRTLLM_INPUTS`), `read`: the outputs they read."""
    params = {key: value.string_value for key, value in config.parameters.items()}
    declared = {tensor.name: model_config_dtype(tensor.data_type) for tensor in config.input}
    errors = [f"tensorrt_llm: {e}" for e in facts.check_parameters(params, backend)]
    errors += [f"tensorrt_llm: {e}" for e in facts.check_declared_inputs(declared, backend)]
    # ours: the values the backend would otherwise default to something this pipeline cannot use
    ours = (
        "gpt_model_type", "gpt_model_path", "max_beam_width", "batch_scheduler_policy", "max_tokens_in_paged_kv_cache",
        "max_attention_window_size", "kv_cache_free_gpu_mem_fraction", "exclude_input_in_output", "decoding_mode",
    )  # fmt: skip
    errors += [f"tensorrt_llm: parameter {key} missing" for key in ours if not params.get(key)]
    if errors:
        return errors
    if params["gpt_model_type"] != "inflight_fused_batching":
        errors.append("tensorrt_llm: gpt_model_type must be inflight_fused_batching")
    if not config.model_transaction_policy.decoupled:
        errors.append("tensorrt_llm: must be decoupled (streaming)")
    if params["exclude_input_in_output"] != "true":
        errors.append("tensorrt_llm: exclude_input_in_output must be true (the orchestrator reads only new ids)")
    window = int(params["max_attention_window_size"])
    if int(params["max_tokens_in_paged_kv_cache"]) < config.max_batch_size * window:
        errors.append(
            f"tensorrt_llm: KV pool {params['max_tokens_in_paged_kv_cache']} < max_batch_size {config.max_batch_size}"
            f" x max sequence {window}: not every slot could hold a full sequence"
        )
    if params["max_beam_width"] != "1":
        errors.append("tensorrt_llm: max_beam_width must be 1 (sampling)")
    declared = {tensor.name for tensor in config.input}
    missing = [spec.name for spec in sent if spec.name not in declared]
    if missing:
        errors.append(f"tensorrt_llm: inputs the orchestrator sends are not declared: {', '.join(missing)}")
    outputs = {tensor.name for tensor in config.output}
    errors += [f"tensorrt_llm: output {spec.name} missing" for spec in read if spec.name not in outputs]
    return errors


def model_config_dtype(data_type: int) -> str:
    """ModelConfig's DataType enum value -> the Triton dtype name ("INT32", "BYTES", ...)."""
    from tritonclient.grpc import model_config_pb2  # noqa: PLC0415 - only needed where configs are parsed

    name = model_config_pb2.DataType.Name(data_type).removeprefix("TYPE_")
    return "BYTES" if name == "STRING" else name
