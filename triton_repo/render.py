"""Render a concrete Triton model repository for the CosyVoice2 pipeline from `templates/`.

    python -m triton_repo.render --model-dir models/CosyVoice2-0.5B --out models/triton_repo \\
        [--llm-backend pytorch|tensorrt_llm] [--engine-dir DIR --llm-dir DIR] [--device cpu|cuda] \\
        [--dtype fp32|fp16|bf16] [--max-batch 16] [--max-seq-len 4096] [--instances cosyvoice2_stream=2] \\
        [--first-hop 25] [--chunk-growth 2] [--layout colocated|single|disaggregated] [--llm-delivery chunk|token] \
        [--token2wav unet|dit --dit-dir models/Step-Audio-2-mini/token2wav] [--spark-dir models/Spark-TTS-0.5B] \
        [--token2wav-gpus 1,2,3 --token2wav-instances-per-gpu 2]  # --layout disaggregated

Both pipeline models (`cosyvoice2` offline, `cosyvoice2_stream` decoupled) are always rendered, so
switching between offline and streaming never needs a re-render. With `--spark-dir` the Spark-TTS models
(`spark_tts`, `spark_tts_stream` and their internal models, `triton_repo.spark_render`) are rendered beside
them. Every option is checked before anything is written; the result is validated (no unresolved
placeholder, every config parses as Triton's ModelConfig, values consistent); the same options give
byte-identical output, and re-rendering replaces a previously rendered repository atomically (other
directories are refused).
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import sys
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path
from string import Template
from typing import Sequence

from cosyvoice2.config import EngineConfig
from cosyvoice2.dit.config import DiTFlowConfig
from cosyvoice2.dit.layout import DIT_FLOW_CONFIG
from cosyvoice2.dit.loading import check_dit_dir
from cosyvoice2.layout import MODEL_FILES
from cosyvoice2.streaming import FLOW_CACHE_MODES
from cosyvoice2.vocab import LOGITS_BIAS_FILE, LOGITS_BIAS_KEY
from cosyvoice2_serving.repetition import LoopGuardConfig
from cosyvoice2_serving.schedule import StreamScheduleParams
from cosyvoice2_serving.token2wav import T2W_SCHEDULING
import pipeline_contract as contract
from pipeline_contract import TensorSpec
from triton_repo import internal_io as io
from triton_repo import spark_io, spark_render
from triton_repo import trtllm_backend_facts as facts
from triton_repo.model_params import (
    AudioModelParams,
    BenchmarkMode,
    EngineParams,
    InternalModels,
    LLMParams,
    ModelParams,
    OrchestratorParams,
    Token2WavParams,
    VoicePromptParams,
)
from triton_repo.spark_render import SparkRenderOptions

TEMPLATES = Path(__file__).resolve().parent / "templates"
MARKER = ".cosyvoice2-render.json"  # options of the render; also marks the directory as ours

LLM_BACKENDS = {"pytorch": "pytorch", "torch": "pytorch", "tensorrt_llm": "tensorrt_llm", "trtllm": "tensorrt_llm"}
DTYPES = ("fp32", "fp16", "bf16")
#: colocated: the PyTorch LLM and token2wav in one model (`engine`, one process: concurrent CUDA streams);
#: single: separate `llm` and `token2wav` models on one device; disaggregated: the LLM on GPU 0, token2wav
#: replicas on GPUs 1..N (`token2wav_gpus`, `token2wav_instances_per_gpu`; see `token2wav_replicas`).
LAYOUTS = ("colocated", "single", "disaggregated")
DEFAULT_LAYOUT = {"pytorch": "colocated", "tensorrt_llm": "single"}
#: How the LLM hands its tokens to a streaming orchestrator: `chunk` = one response per chunk boundary of the
#: streaming schedule (the PyTorch LLM's `deliver_at`), `token` = one response per token (all TensorRT-LLM can).
LLM_DELIVERIES = ("chunk", "token")
#: unet: CosyVoice2's own flow (`--model-dir`); dit: the DiT flow of Step-Audio-2-mini (`--dit-dir`, docs/engine.md).
TOKEN2WAVS = ("unet", "dit")
DEFAULT_LLM_DELIVERY = {"pytorch": "chunk", "tensorrt_llm": "token"}
ENGINE_MODEL = "engine"
#: The engine's logits type the per-request embedding bias (float32) needs: trtllm-build --logits_dtype float32.
LOGITS_DTYPE = "float32"
#: Models whose instance count may be chosen; llm, token2wav and engine keep per-request state in-process.
SCALABLE = (
    contract.OFFLINE_MODEL, contract.STREAMING_MODEL, "voice_prompt", "audio_tokenizer", "speaker_embedding",
    *spark_render.SCALABLE,
)  # fmt: skip
#: The GPU of the LLM in the disaggregated layout (TensorRT-LLM's `gpu_device_ids`, the PyTorch LLM's instance group).
LLM_GPU = 0
#: Default token2wav GPUs of the disaggregated layout: the one GPU after the LLM's.
DEFAULT_TOKEN2WAV_GPUS = (1,)


def default_device(llm_backend: str, layout: str | None, gpu_emulation: bool = False) -> str:
    """TensorRT-LLM and the disaggregated layout (several GPUs) need CUDA, except the layout's CPU rehearsal
    (`gpu_emulation`); anything else renders for the CPU."""
    if gpu_emulation:
        return "cpu"
    return "cuda" if llm_backend == "tensorrt_llm" or layout == "disaggregated" else "cpu"


class RenderError(ValueError):
    """A render option or input is wrong; the message says which and what to do."""


@dataclass(frozen=True)
class RenderOptions:
    model_dir: Path
    out: Path
    llm_backend: str = "pytorch"
    engine_dir: Path | None = None  # TensorRT-LLM engine (tensorrt_llm backend)
    llm_dir: Path | None = None  # HF checkpoint dir with logits_bias.safetensors (tensorrt_llm backend)
    device: str | None = None  # None: default_device(llm_backend, layout, gpu_emulation)
    dtype: str = "fp32"
    max_batch: int = 16  # LLM sequences decoded together (KV slots)
    max_seq_len: int = 4096  # prompt + generated tokens per sequence
    max_waiting: int = 64  # LLM requests queued beyond the slots before [overloaded]
    instances: dict[str, int] = field(default_factory=dict)
    first_hop: int = StreamScheduleParams.first_hop
    chunk_growth: int = StreamScheduleParams.chunk_growth
    # Streaming flow caches (cosyvoice2.streaming.FLOW_CACHE_MODES) and the memory they may hold for live
    # streams (voice prefixes not counted); a stream over the budget recomputes from then on. The server runs
    # "chunked" (cheapest final chunk, measured in docs/PERFORMANCE.md); "exact" equals upstream's final chunk.
    flow_cache: str = "chunked"
    flow_cache_gb: float = 32.0
    # How token2wav schedules streaming chunks (cosyvoice2_serving.token2wav.T2W_SCHEDULING): "step" advances
    # every chunk in flight one estimator step at a time, so a new stream's first chunk starts at the next step;
    # "call" runs each batch of chunks as one whole call. "call" is the default: on the GPU it measured faster at
    # 16 streams (docs/PERFORMANCE.md, "Step scheduling"). Both token2wavs (unet, dit) can step.
    t2w_scheduling: str = "call"
    # With call scheduling, a second token2wav worker that runs only first chunks, concurrently with the calls of
    # later chunks on its own higher-priority CUDA stream (and its own CUDA graphs: more GPU memory), so a new
    # stream's first chunk never waits for a running call (cosyvoice2_serving.token2wav).
    t2w_first_chunk_worker: bool = False
    # With call scheduling and one worker, a running call of later chunks lets the first chunks that arrived
    # meanwhile run as their own call before its next Euler step (UNet token2wav, flow caches on).
    t2w_first_chunks_between_steps: bool = False
    # Which flow + HiFT turns speech tokens into audio; dit needs `dit_dir`, the released `token2wav/` directory
    # (the LLM, the voice frontend and the chunk schedule stay CosyVoice2's; flow_cache* apply to unet only).
    token2wav: str = "unet"
    dit_dir: Path | None = None
    # Benchmark mode for random-weight models (they stop at random): every request generates exactly
    # round(ratio x target text tokens) speech tokens and the stop ids are never sampled. None = off.
    benchmark_speech_ratio: float | None = None
    layout: str | None = None  # None: DEFAULT_LAYOUT of the LLM backend
    llm_delivery: str | None = None  # None: DEFAULT_LLM_DELIVERY of the LLM backend
    voice_cache: int = 64  # voices kept in the voice-prompt cache
    max_target_text_tokens: int = contract.MAX_SEGMENT_TOKENS
    audio_max_batch: int = 8
    max_queue_delay_us: int = 1000
    # TensorRT-LLM only (the PyTorch LLM samples with RAS): the backend's repetition penalty (upstream's 1.1) and
    # the orchestrator's loop guard, together the nearest the C++ backend gets to RAS (docs/deploy.md)
    repetition_penalty: float = 1.1
    loop_guard: LoopGuardConfig = field(default_factory=LoopGuardConfig)
    # Disaggregated layout only: the GPUs of the token2wav replicas (None: DEFAULT_TOKEN2WAV_GPUS) and how many
    # replicas each GPU runs. Each replica is a model of its own with one instance (see `token2wav_replicas`).
    token2wav_gpus: tuple[int, ...] | None = None
    token2wav_instances_per_gpu: int = 1
    # Rehearse the disaggregated GPU placement on a machine without GPUs (tests, CI): every GPU instance group
    # renders as a CPU one and every device as cpu; the models, replicas and routing stay those of the GPU render.
    gpu_emulation: bool = False
    # Spark-TTS beside CosyVoice2 (`--spark-dir`); None: CosyVoice2 only
    spark: SparkRenderOptions | None = None

    def __post_init__(self) -> None:
        # The one place that fills in what was left open, for the command line, the library call and the stack alike.
        object.__setattr__(self, "llm_backend", LLM_BACKENDS.get(self.llm_backend, self.llm_backend))
        for name in ("model_dir", "out", "engine_dir", "llm_dir", "dit_dir"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, Path):
                object.__setattr__(self, name, Path(value))
        if self.layout is None:
            object.__setattr__(self, "layout", DEFAULT_LAYOUT.get(self.llm_backend, "single"))
        if self.llm_delivery is None:
            object.__setattr__(self, "llm_delivery", DEFAULT_LLM_DELIVERY.get(self.llm_backend, "token"))
        if self.device is None:
            object.__setattr__(self, "device", default_device(self.llm_backend, self.layout, self.gpu_emulation))
        if self.token2wav_gpus is not None and not isinstance(self.token2wav_gpus, tuple):
            # a list from settings or JSON: the options and their record keep a tuple
            object.__setattr__(self, "token2wav_gpus", tuple(self.token2wav_gpus))

    def instances_of(self, model: str) -> int:
        return self.instances.get(model, 1)

    def device_of(self, model: str) -> str:
        """The `device` parameter of `model`'s adapter. `disaggregated` renders "cuda" for the models it pins to a
        GPU by their instance group (`gpus_of`): the adapter takes the GPU Triton gives the instance
        (`triton_repo.devices.instance_device`); other layouts run every model on cuda:0 or the CPU."""
        if self.device == "cpu" or self.gpu_emulation:
            return "cpu"
        if self.layout != "disaggregated":
            return "cuda:0"
        return "cuda" if self.gpus_of(model) is not None else "cuda:0"

    def gpus_of(self, model: str) -> tuple[int, ...] | None:
        """The GPUs of `model`'s KIND_GPU instance group in the disaggregated layout; None: a KIND_CPU group.

        The PyTorch LLM gets LLM_GPU (TensorRT-LLM places itself: `gpu_device_ids`); each token2wav replica its
        GPU; the audio front-end (`audio_tokenizer`, `speaker_embedding`: once per new voice, then cached) the
        first token2wav GPU, which keeps the LLM's GPU to the LLM's KV cache."""
        if self.layout != "disaggregated":
            return None
        if model == "llm":
            return (LLM_GPU,) if self.llm_backend == "pytorch" else None
        replicas = dict(token2wav_replicas(self))
        if model in replicas:
            return (replicas[model],)
        if model in ("audio_tokenizer", "speaker_embedding"):
            return (self.resolved_token2wav_gpus[0],)
        return None

    @property
    def resolved_token2wav_gpus(self) -> tuple[int, ...]:
        return DEFAULT_TOKEN2WAV_GPUS if self.token2wav_gpus is None else tuple(self.token2wav_gpus)


def token2wav_replicas(opts: RenderOptions) -> list[tuple[str, int | None]]:
    """(model name, GPU) of every token2wav model. One model per replica, each with exactly one instance: a
    stream's caches live in the process that served its first chunk, and Triton spreads the requests of one model
    over all its instances, so the orchestrator addresses a replica by name and keeps each stream on the one it
    picked (`cosyvoice2_serving.replicas.StickyRouter`). Outside the disaggregated layout: the one `token2wav`."""
    if opts.layout != "disaggregated":
        return [("token2wav", None)]
    return [
        (f"token2wav_gpu{gpu}_{k}", gpu)
        for gpu in opts.resolved_token2wav_gpus
        for k in range(opts.token2wav_instances_per_gpu)
    ]


# -- validation of options -------------------------------------------------------------------------
def check_options(opts: RenderOptions) -> None:
    errors: list[str] = []
    if not opts.model_dir.is_dir():
        errors.append(f"--model-dir {opts.model_dir} is not a directory (expected an official CosyVoice2 model dir)")
    else:
        missing = [name for name in MODEL_FILES if not (opts.model_dir / name).exists()]
        if missing:
            errors.append(f"--model-dir {opts.model_dir} lacks {', '.join(missing)}")
    if opts.llm_backend not in ("pytorch", "tensorrt_llm"):
        errors.append(f"--llm-backend must be one of {sorted(LLM_BACKENDS)}, got {opts.llm_backend!r}")
    if opts.device not in ("cpu", "cuda"):
        errors.append(f"--device must be cpu or cuda, got {opts.device!r}")
    if opts.dtype not in DTYPES:
        errors.append(f"--dtype must be one of {', '.join(DTYPES)}, got {opts.dtype!r}")
    if opts.device == "cpu" and opts.dtype != "fp32":
        errors.append(f"--dtype {opts.dtype} needs --device cuda (CPU runs fp32)")
    if opts.layout not in LAYOUTS:
        errors.append(f"--layout must be one of {', '.join(LAYOUTS)}, got {opts.layout!r}")
    if opts.layout == "colocated" and opts.llm_backend == "tensorrt_llm":
        errors.append(
            "--layout colocated needs --llm-backend pytorch: TensorRT-LLM runs inside tritonserver itself, so it "
            "cannot share the token2wav process (use --layout single or disaggregated)"
        )
    if opts.llm_delivery not in LLM_DELIVERIES:
        errors.append(f"--llm-delivery must be one of {', '.join(LLM_DELIVERIES)}, got {opts.llm_delivery!r}")
    elif opts.llm_delivery == "chunk" and opts.llm_backend == "tensorrt_llm":
        errors.append("--llm-delivery chunk needs --llm-backend pytorch: TensorRT-LLM streams one response per token")
    errors += _check_placement(opts)
    for name, value, low in (
        ("--max-batch", opts.max_batch, 1), ("--max-seq-len", opts.max_seq_len, 64), ("--max-waiting", opts.max_waiting, 0),
        ("--first-hop", opts.first_hop, 4), ("--chunk-growth", opts.chunk_growth, 1), ("--voice-cache", opts.voice_cache, 1),
        ("--max-target-text-tokens", opts.max_target_text_tokens, 1), ("--audio-max-batch", opts.audio_max_batch, 1),
        ("--max-queue-delay-us", opts.max_queue_delay_us, 0),
    ):  # fmt: skip
        if value < low:
            errors.append(f"{name} must be >= {low}, got {value}")
    if opts.flow_cache not in FLOW_CACHE_MODES:
        errors.append(f"--flow-cache must be one of {', '.join(FLOW_CACHE_MODES)}, got {opts.flow_cache!r}")
    if opts.t2w_scheduling not in T2W_SCHEDULING:
        errors.append(f"--t2w-scheduling must be one of {', '.join(T2W_SCHEDULING)}, got {opts.t2w_scheduling!r}")
    if not opts.flow_cache_gb >= 0:
        errors.append(f"--flow-cache-gb must be >= 0, got {opts.flow_cache_gb}")
    if opts.token2wav not in TOKEN2WAVS:
        errors.append(f"--token2wav must be one of {', '.join(TOKEN2WAVS)}, got {opts.token2wav!r}")
    elif opts.token2wav == "dit":
        if opts.dit_dir is None:
            errors.append("--token2wav dit needs --dit-dir (the released token2wav/ directory of Step-Audio-2-mini)")
        else:
            try:
                check_dit_dir(opts.dit_dir)
            except FileNotFoundError as exc:
                errors.append(f"--dit-dir: {exc}")
            else:
                errors += _dit_fit_errors(opts.model_dir, opts.dit_dir)
    elif opts.dit_dir is not None:
        errors.append("--dit-dir is only used with --token2wav dit")
    if not opts.repetition_penalty > 0:
        errors.append(f"--repetition-penalty must be > 0 (1 = off), got {opts.repetition_penalty}")
    if opts.benchmark_speech_ratio is not None and not opts.benchmark_speech_ratio > 0:
        errors.append(f"--benchmark-speech-ratio must be > 0, got {opts.benchmark_speech_ratio}")
    for model, count in opts.instances.items():
        if model not in SCALABLE:
            errors.append(
                f"--instances {model}={count}: only {', '.join(SCALABLE)} may have several instances "
                "(llm, token2wav and engine hold per-request state in their process)"
            )
        elif count < 1:
            errors.append(f"--instances {model}={count}: the count must be >= 1")
    if opts.llm_backend == "tensorrt_llm":
        errors += _check_trtllm(opts)
    errors += spark_render.check(opts)
    if errors:
        raise RenderError("cannot render the Triton repository:\n  - " + "\n  - ".join(errors))


def _check_placement(opts: RenderOptions) -> list[str]:
    """The disaggregated layout's GPUs; its CPU rehearsal (`gpu_emulation`)."""
    errors = []
    if opts.gpu_emulation:
        if opts.layout != "disaggregated" or opts.device != "cpu":
            errors.append("--gpu-emulation rehearses --layout disaggregated on --device cpu only")
    elif opts.layout == "disaggregated" and opts.device != "cuda":
        errors.append(
            "--layout disaggregated needs --device cuda (the LLM on GPU 0, token2wav on the others; "
            "--gpu-emulation rehearses it on the CPU)"
        )
    if opts.layout != "disaggregated":
        if opts.token2wav_gpus is not None or opts.token2wav_instances_per_gpu != 1:
            errors.append("--token2wav-gpus and --token2wav-instances-per-gpu need --layout disaggregated")
        return errors
    gpus = opts.resolved_token2wav_gpus
    if not gpus:
        errors.append("--token2wav-gpus names no GPU (give GPU ids, e.g. 1,2,3)")
    if any(gpu < 0 for gpu in gpus):
        errors.append(f"--token2wav-gpus: GPU ids are >= 0, got {','.join(map(str, gpus))}")
    if len(set(gpus)) != len(gpus):
        errors.append(f"--token2wav-gpus names a GPU twice ({','.join(map(str, gpus))}); use "
                      "--token2wav-instances-per-gpu for several replicas on one GPU")
    if opts.token2wav_instances_per_gpu < 1:
        errors.append(f"--token2wav-instances-per-gpu must be >= 1, got {opts.token2wav_instances_per_gpu}")
    return errors


def llm_shares_its_gpu(opts: RenderOptions) -> bool:
    """Whether other models run on the LLM's GPU (TensorRT-LLM then leaves them half of the free memory)."""
    return opts.layout != "disaggregated" or LLM_GPU in opts.resolved_token2wav_gpus


def _check_trtllm(opts: RenderOptions) -> list[str]:
    errors = []
    if opts.device != "cuda":
        errors.append("--llm-backend tensorrt_llm needs --device cuda")
    if opts.engine_dir is None:
        errors.append("--llm-backend tensorrt_llm needs --engine-dir (the trtllm-build output)")
    elif not (opts.engine_dir / "config.json").is_file() or not any(opts.engine_dir.glob("*.engine")):
        errors.append(f"--engine-dir {opts.engine_dir} holds no TensorRT-LLM engine (config.json + rank*.engine)")
    else:
        engine = read_engine_config(opts.engine_dir)
        build = engine.get("build_config", {})
        for key, ours in (("max_batch_size", opts.max_batch), ("max_seq_len", opts.max_seq_len)):
            if key in build and ours > int(build[key]):
                errors.append(
                    f"--{key.replace('_size', '').replace('_', '-')} {ours} exceeds the engine's {key} {build[key]}"
                )
        errors += _check_engine_facts(opts, engine)
    if opts.llm_dir is None:
        errors.append(f"--llm-backend tensorrt_llm needs --llm-dir (the HF checkpoint dir with {LOGITS_BIAS_FILE})")
    elif not (opts.llm_dir / LOGITS_BIAS_FILE).is_file():
        errors.append(f"--llm-dir {opts.llm_dir} lacks {LOGITS_BIAS_FILE} (written by the build's convert stage)")
    elif opts.engine_dir is not None and (opts.engine_dir / "config.json").is_file():
        errors += _check_logits_bias(opts.llm_dir / LOGITS_BIAS_FILE, read_engine_config(opts.engine_dir))
    return errors


def read_engine_config(engine_dir: Path) -> dict:
    """The `config.json` trtllm-build writes beside the engine: `version` (TensorRT-LLM), `pretrained_config`
    (vocab_size, logits_dtype, mapping), `build_config` (max_batch_size, max_seq_len, ...)."""
    try:
        return json.loads((engine_dir / "config.json").read_text())
    except json.JSONDecodeError as exc:
        raise RenderError(f"--engine-dir {engine_dir}: config.json is not valid JSON ({exc})") from exc


def engine_tp_size(engine: dict) -> int:
    mapping = engine.get("pretrained_config", {}).get("mapping", {})
    return int(mapping.get("tp_size", 1)) * int(mapping.get("pp_size", 1))


def _check_engine_facts(opts: RenderOptions, engine: dict) -> list[str]:
    """What the engine was built with against what this repository sends it (docs/deploy.md)."""
    errors = facts.engine_version_problems(engine, "--engine-dir", opts.engine_dir)
    pretrained = engine.get("pretrained_config", {})
    logits_dtype = pretrained.get("logits_dtype")
    if logits_dtype != LOGITS_DTYPE:
        errors.append(
            f"the engine's logits are {logits_dtype or 'of unknown type'}, not {LOGITS_DTYPE}: every request would fail "
            '("Embedding bias data type must be same as model logits type"); rebuild it with trtllm-build '
            f"--logits_dtype {LOGITS_DTYPE} (cosyvoice-build --from engine --to engine --force)"
        )
    tp = engine_tp_size(engine)
    if tp > 1 and opts.layout == "disaggregated":
        errors.append(f"a tensor-parallel engine (x{tp}) cannot run in the disaggregated layout (the LLM owns GPU {LLM_GPU} only)")
    return errors


def _check_logits_bias(path: Path, engine: dict) -> list[str]:
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


# -- rendering -------------------------------------------------------------------------------------
def _parameters(values: ModelParams | dict[str, object]) -> str:
    if isinstance(values, ModelParams):
        values = dict(values.to_parameters())
    return "\n".join(
        f'parameters: {{ key: "{key}" value: {{ string_value: "{value}" }} }}' for key, value in sorted(values.items())
    )


def _fill(template: str, **values: object) -> str:
    text = Template((TEMPLATES / template).read_text()).safe_substitute({k: str(v) for k, v in values.items()})
    leftover = sorted(set(re.findall(r"\$\{(\w+)\}", text)))
    if leftover:
        raise RenderError(f"template {template}: unresolved placeholders {', '.join(leftover)}")
    return text


def instance_group(opts: RenderOptions, model: str, count: int = 1) -> str:
    """`model`'s instance group: `count` instances on each GPU of `gpus_of` (Triton passes each instance its GPU as
    `model_instance_device_id`), else `count` CPU-kind instances (their adapters use the rendered `device`)."""
    gpus = opts.gpus_of(model)
    if gpus is None:
        return f"instance_group [ {{ kind: KIND_CPU count: {count} }} ]"
    gpu_list = ", ".join(map(str, gpus))
    if opts.gpu_emulation:  # the CPU rehearsal: same model and count, the GPU only named
        return f"# gpu_emulation of: KIND_GPU gpus [ {gpu_list} ]\ninstance_group [ {{ kind: KIND_CPU count: {count} }} ]"
    return f"instance_group [ {{ kind: KIND_GPU count: {count} gpus: [ {gpu_list} ] }} ]"


def _python_model(module: str, cls: str = "TritonPythonModel") -> str:
    return _fill("model.py.tmpl", module=f"triton_repo.adapters.{module}", cls=cls)


def render_files(opts: RenderOptions) -> dict[str, str]:
    """Relative path -> file content of the whole repository (no I/O besides reading templates and the engine's
    config.json)."""
    files: dict[str, str] = {}
    for name, decoupled, description in (
        (contract.OFFLINE_MODEL, "false", "Offline pipeline: one response with the whole waveform of one segment."),
        (contract.STREAMING_MODEL, "true", "Streaming pipeline: waveform chunks; FINAL rides on the last one."),
    ):
        files[f"{name}/config.pbtxt"] = _fill(
            "orchestrator.pbtxt",
            name=name,
            description=description,
            decoupled=decoupled,
            inputs=contract.pbtxt_io_block("input", contract.INPUTS),
            outputs=contract.pbtxt_io_block("output", contract.OUTPUTS),
            instances=opts.instances_of(name),
            parameters=_parameters(orchestrator_params(opts)),
        )
        files[f"{name}/1/model.py"] = _python_model("orchestrator")

    files["voice_prompt/config.pbtxt"] = _fill(
        "voice_prompt.pbtxt",
        name="voice_prompt",
        inputs=contract.pbtxt_io_block("input", io.VOICE_PROMPT_INPUTS),
        outputs=contract.pbtxt_io_block("output", io.VOICE_PROMPT_OUTPUTS),
        instances=opts.instances_of("voice_prompt"),
        parameters=_parameters(VoicePromptParams(cache_capacity=opts.voice_cache)),
    )
    files["voice_prompt/1/model.py"] = _python_model("voice_prompt")

    for name, output, cls, description in (
        ("audio_tokenizer", io.SPEECH_TOKENS, "AudioTokenizerModel", "Speech tokenizer (ONNX), 25 Hz tokens of 16 kHz audio."),
        ("speaker_embedding", io.XVECTOR, "SpeakerEmbeddingModel", "CAM++ x-vector (ONNX) of 16 kHz audio."),
    ):  # fmt: skip
        files[f"{name}/config.pbtxt"] = _fill(
            "audio_model.pbtxt",
            name=name,
            description=description,
            max_batch=opts.audio_max_batch,
            max_queue_delay_us=opts.max_queue_delay_us,
            inputs=contract.pbtxt_io_block("input", io.AUDIO_INPUTS),
            outputs=contract.pbtxt_io_block("output", (output,)),
            instance_group=instance_group(opts, name, opts.instances_of(name)),
            parameters=_parameters(AudioModelParams(opts.model_dir.resolve(), opts.device_of(name))),
        )
        files[f"{name}/1/model.py"] = _python_model("audio_features", cls)

    if opts.layout == "colocated":
        files[f"{ENGINE_MODEL}/config.pbtxt"] = _fill(
            "engine.pbtxt",
            name=ENGINE_MODEL,
            inputs=contract.pbtxt_io_block("input", io.ENGINE_INPUTS),
            outputs=contract.pbtxt_io_block("output", io.ENGINE_OUTPUTS),
            parameters=_parameters(EngineParams(llm_params(opts), token2wav_params(opts))),
        )
        files[f"{ENGINE_MODEL}/1/model.py"] = _python_model("engine")
    else:
        files.update(_llm_files(opts))
        for name, _ in token2wav_replicas(opts):
            files[f"{name}/config.pbtxt"] = _fill(
                "token2wav.pbtxt",
                name=name,
                inputs=contract.pbtxt_io_block("input", io.TOKEN2WAV_INPUTS),
                outputs=contract.pbtxt_io_block("output", (io.WAVEFORM,)),
                instance_group=instance_group(opts, name),
                parameters=_parameters(token2wav_params(opts, name)),
            )
            files[f"{name}/1/model.py"] = _python_model("token2wav")
    files.update(spark_render.files(opts))
    files[MARKER] = json.dumps(_options_record(opts), indent=1, sort_keys=True) + "\n"
    return files


def internal_models(opts: RenderOptions) -> InternalModels:
    """The orchestrator's targets for its LLM and token2wav calls."""
    colocated = opts.layout == "colocated"
    return InternalModels(
        llm_model=ENGINE_MODEL if colocated else "llm",
        token2wav_model=(ENGINE_MODEL,) if colocated else tuple(name for name, _ in token2wav_replicas(opts)),
        token2wav_decoupled=colocated,
        llm_deliver_at=opts.llm_delivery == "chunk",
    )


def _benchmark(opts: RenderOptions) -> BenchmarkMode | None:
    return None if opts.benchmark_speech_ratio is None else BenchmarkMode(opts.benchmark_speech_ratio)


def _schedule(opts: RenderOptions) -> StreamScheduleParams:
    return StreamScheduleParams(first_hop=opts.first_hop, chunk_growth=opts.chunk_growth)


def orchestrator_params(opts: RenderOptions) -> OrchestratorParams:
    """Parameters of both pipeline models (`adapters.orchestrator`)."""
    trtllm = opts.llm_backend == "tensorrt_llm"
    return OrchestratorParams(
        model_dir=opts.model_dir.resolve(),
        llm_backend=opts.llm_backend,
        max_sequence_len=opts.max_seq_len,
        max_target_text_tokens=opts.max_target_text_tokens,
        schedule=_schedule(opts),
        models=internal_models(opts),
        voice_cache=opts.voice_cache,
        benchmark=_benchmark(opts),
        llm_logits_bias=(opts.llm_dir / LOGITS_BIAS_FILE).resolve() if trtllm and opts.llm_dir else None,
        llm_repetition_penalty=opts.repetition_penalty if trtllm else None,
        loop_guard=opts.loop_guard if trtllm else None,
    )


def expected_models(opts: RenderOptions) -> set[str]:
    internal = {ENGINE_MODEL} if opts.layout == "colocated" else {"llm", *(n for n, _ in token2wav_replicas(opts))}
    frontend = {contract.OFFLINE_MODEL, contract.STREAMING_MODEL, "voice_prompt", "audio_tokenizer", "speaker_embedding"}
    return frontend | internal | spark_render.models(opts)


def llm_params(opts: RenderOptions) -> LLMParams:
    """Parameters of the PyTorch LLM (`adapters.llm.LLMHandler`)."""
    return LLMParams(
        model_dir=opts.model_dir.resolve(),
        device=opts.device_of("llm"),
        dtype=opts.dtype,
        max_batch=opts.max_batch,
        max_seq_len=opts.max_seq_len,
        max_waiting=opts.max_waiting,
        benchmark=_benchmark(opts),
    )


def token2wav_params(opts: RenderOptions, name: str = "token2wav") -> Token2WavParams:
    """Parameters of the token2wav model `name` (`adapters.token2wav.Token2WavHandler`), one of `token2wav_replicas`."""
    disaggregated = opts.layout == "disaggregated"
    return Token2WavParams(
        model_dir=opts.model_dir.resolve(),
        device=opts.device_of(name),
        dtype=opts.dtype,
        schedule=_schedule(opts),
        flow_cache=opts.flow_cache,
        flow_cache_gb=opts.flow_cache_gb,
        t2w_scheduling=opts.t2w_scheduling,
        t2w_first_chunk_worker=opts.t2w_first_chunk_worker,
        t2w_first_chunks_between_steps=opts.t2w_first_chunks_between_steps,
        token2wav=opts.token2wav,
        dit_dir=opts.dit_dir.resolve() if opts.dit_dir is not None else None,
        # the budget is per GPU: the replicas sharing one split it
        replicas_per_gpu=opts.token2wav_instances_per_gpu if disaggregated else None,
    )


def _llm_files(opts: RenderOptions) -> dict[str, str]:
    """The separate `llm` model (single/disaggregated layouts) of either backend."""
    inputs = io.PYTORCH_LLM_INPUTS if opts.llm_backend == "pytorch" else io.LLM_INPUTS
    llm_io = {
        "inputs": contract.pbtxt_io_block("input", inputs),
        "outputs": contract.pbtxt_io_block("output", io.LLM_OUTPUTS),
    }
    if opts.llm_backend == "pytorch":
        config = _fill(
            "llm_pytorch.pbtxt", name="llm", max_batch=opts.max_batch, max_seq_len=opts.max_seq_len, **llm_io,
            instance_group=instance_group(opts, "llm"), parameters=_parameters(llm_params(opts)),
        )  # fmt: skip
        return {"llm/config.pbtxt": config, "llm/1/model.py": _python_model("llm")}
    config = _fill(
        "llm_tensorrt_llm.pbtxt", name="llm", max_batch=opts.max_batch, max_seq_len=opts.max_seq_len, **llm_io,
        parameters=_parameters(trtllm_parameters(opts, opts.engine_dir, opts.max_seq_len,
                                                 0.5 if llm_shares_its_gpu(opts) else 0.9)),
    )  # fmt: skip
    # the backend needs the version directory; the engine stays in engine_dir
    return {"llm/config.pbtxt": config, "llm/1/.keep": ""}


def trtllm_parameters(opts: RenderOptions, engine_dir: Path | None, max_seq_len: int,
                      kv_cache_free_gpu_mem_fraction: float) -> dict[str, object]:
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
        "kv_cache_free_gpu_mem_fraction": kv_cache_free_gpu_mem_fraction,
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


def _options_record(opts: RenderOptions) -> dict[str, object]:
    record = asdict(opts)
    record.pop("out")
    record = {k: (str(Path(v).resolve()) if isinstance(v, Path) else v) for k, v in record.items()}
    if opts.spark is not None:
        record["spark"] = {k: (str(Path(v).resolve()) if isinstance(v, Path) else v) for k, v in record["spark"].items()}
    return record


def _dit_fit_errors(model_dir: Path, dit_dir: Path) -> list[str]:
    """The DiT flow must take every speech token the LLM can emit, and the lookahead the orchestrators' chunks
    carry (CosyVoice2's schedule drives the DiT streams)."""
    try:
        dit = DiTFlowConfig.from_flow_yaml(dit_dir / DIT_FLOW_CONFIG)
    except (ValueError, KeyError, TypeError, AttributeError, OSError) as exc:  # a malformed yaml, any shape
        return [f"--dit-dir: {dit_dir / DIT_FLOW_CONFIG} is not a DiT flow config ({exc})"]
    if not model_dir.is_dir():
        return []  # reported above
    engine = EngineConfig.for_model_dir(model_dir)
    errors = []
    if dit.vocab_size < engine.llm.speech_token_size:
        errors.append(f"--dit-dir: the DiT flow knows {dit.vocab_size} speech tokens, the LLM emits "
                      f"{engine.llm.speech_token_size}")
    if dit.pre_lookahead_len != engine.flow.pre_lookahead_len:
        errors.append(f"--dit-dir: the DiT flow's lookahead is {dit.pre_lookahead_len} tokens, the chunk schedule "
                      f"sends {engine.flow.pre_lookahead_len}")
    return errors


# -- validation of the rendered repository --------------------------------------------------------
def validate_repository(repo: Path, expected: set[str]) -> None:
    """Structural check of a rendered repository holding the models `expected`; raises RenderError naming every problem."""
    from google.protobuf import text_format  # noqa: PLC0415 - only needed here
    from tritonclient.grpc import model_config_pb2  # noqa: PLC0415

    errors: list[str] = []
    models = sorted(p.parent.name for p in repo.glob("*/config.pbtxt"))
    if set(models) != expected:
        errors.append(f"models {models} != expected {sorted(expected)}")
    for name in models:
        path = repo / name / "config.pbtxt"
        text = path.read_text()
        if "${" in text:
            errors.append(f"{path}: unresolved placeholder")
        config = model_config_pb2.ModelConfig()
        try:
            text_format.Parse(text, config)
        except text_format.ParseError as exc:
            errors.append(f"{path}: not a valid ModelConfig ({exc})")
            continue
        if config.name != name:
            errors.append(f"{path}: name {config.name!r} != directory {name!r}")
        if not (repo / name / "1").is_dir():
            errors.append(f"{repo / name}: missing version directory 1/")
        if config.backend == "python" and not (repo / name / "1" / "model.py").is_file():
            errors.append(f"{repo / name}/1/model.py missing")
        single = name in ("llm", ENGINE_MODEL, *spark_render.SINGLE_INSTANCE) or name.startswith("token2wav")
        if single and (
            len(config.instance_group) != 1 or any(g.count != 1 or len(g.gpus) > 1 for g in config.instance_group)
        ):
            errors.append(f"{path}: {name} must have exactly one instance")
        if config.backend == "tensorrtllm":
            spark = name == spark_render.LLM
            errors += check_trtllm_config(config, facts.PINNED, spark_io.TRTLLM_INPUTS if spark else io.LLM_INPUTS,
                                          spark_io.TRTLLM_OUTPUTS if spark else io.LLM_OUTPUTS)
    if errors:
        raise RenderError("invalid Triton repository:\n  - " + "\n  - ".join(errors))


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


# -- writing ---------------------------------------------------------------------------------------
def write_repository(opts: RenderOptions) -> Path:
    check_options(opts)
    files = render_files(opts)
    out = opts.out
    if out.exists() and any(out.iterdir()) and not (out / MARKER).is_file():
        raise RenderError(f"--out {out} exists and was not rendered by this tool; refusing to replace it")
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out.name}.render-", dir=out.parent))
    try:
        for rel, content in files.items():
            path = staging / rel
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(content)
        validate_repository(staging, expected_models(opts))
        if out.exists():
            old = out.with_name(f".{out.name}.old-{staging.name.rsplit('-', 1)[-1]}")
            out.rename(old)
            staging.rename(out)
            shutil.rmtree(old)
        else:
            staging.rename(out)
    finally:
        if staging.exists():
            shutil.rmtree(staging)
    return out


def render_repository(output_dir: Path, model_dir: Path, **options: object) -> Path:
    """Library entry point (the build tooling's `render` stage calls this): `RenderOptions` fields by name."""
    return write_repository(RenderOptions(model_dir=Path(model_dir), out=Path(output_dir), **options))  # type: ignore[arg-type]


# -- command line ----------------------------------------------------------------------------------
def parse_gpus(value: str) -> tuple[int, ...]:
    """`--token2wav-gpus 1,2,3` -> (1, 2, 3); the values are checked with the other options."""
    parts = [part.strip() for part in value.split(",") if part.strip()]
    if not all(part.lstrip("-").isdigit() for part in parts):
        raise RenderError(f"--token2wav-gpus expects comma-separated GPU ids (e.g. 1,2,3), got {value!r}")
    return tuple(int(part) for part in parts)


def _instances(values: Sequence[str]) -> dict[str, int]:
    out: dict[str, int] = {}
    for value in values:
        name, sep, count = value.partition("=")
        if not sep or not count.strip().lstrip("-").isdigit():
            raise RenderError(f"--instances expects MODEL=COUNT, got {value!r}")
        out[name.strip()] = int(count)
    return out


def main(argv: Sequence[str] | None = None) -> int:
    defaults = RenderOptions(model_dir=Path(), out=Path())
    parser = argparse.ArgumentParser(prog="python -m triton_repo.render", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model-dir", type=Path, required=True, help="official CosyVoice2 model directory")
    parser.add_argument("--out", type=Path, required=True, help="repository directory to (re)write")
    parser.add_argument("--llm-backend", default=defaults.llm_backend, choices=sorted(LLM_BACKENDS))
    parser.add_argument("--engine-dir", type=Path, help="TensorRT-LLM engine directory (tensorrt_llm backend)")
    parser.add_argument(
        "--llm-dir", type=Path, help=f"HF checkpoint dir with {LOGITS_BIAS_FILE} (tensorrt_llm backend)"
    )
    parser.add_argument(
        "--device", default=None, choices=("cpu", "cuda"),
        help="default: cuda for tensorrt_llm or the disaggregated layout, else cpu"
    )
    parser.add_argument("--dtype", default=defaults.dtype, choices=DTYPES, help="LLM and flow dtype")
    parser.add_argument("--max-batch", type=int, default=defaults.max_batch, help="LLM sequences decoded together")
    parser.add_argument("--max-seq-len", type=int, default=defaults.max_seq_len, help="prompt + generated tokens")
    parser.add_argument(
        "--max-waiting", type=int, default=defaults.max_waiting, help="queued LLM requests before overload"
    )
    parser.add_argument(
        "--instances", action="append", default=[], metavar="MODEL=COUNT", help=f"one of {', '.join(SCALABLE)}"
    )
    parser.add_argument("--first-hop", type=int, default=defaults.first_hop, help="tokens in the first streaming chunk")
    parser.add_argument("--chunk-growth", type=int, default=defaults.chunk_growth, help="hop multiplier per chunk")
    parser.add_argument(
        "--flow-cache", default=defaults.flow_cache, choices=FLOW_CACHE_MODES,
        help="streaming flow: chunked (all chunks over caches), exact (final chunk recomputed like upstream), "
        "off (every chunk recomputed)",
    )  # fmt: skip
    parser.add_argument("--flow-cache-gb", type=float, default=defaults.flow_cache_gb,
                        help="memory for live streams' flow caches (0: no limit)")
    parser.add_argument(
        "--t2w-scheduling", default=defaults.t2w_scheduling, choices=T2W_SCHEDULING,
        help="token2wav: step (one estimator step at a time across streams; new streams join at the next step) "
        "or call (whole batched calls)",
    )  # fmt: skip
    parser.add_argument(
        "--t2w-first-chunk-worker", action=argparse.BooleanOptionalAction, default=defaults.t2w_first_chunk_worker,
        help="call scheduling: a second token2wav worker (own CUDA stream and graphs) runs only first chunks",
    )  # fmt: skip
    parser.add_argument(
        "--t2w-first-chunks-between-steps", action=argparse.BooleanOptionalAction,
        default=defaults.t2w_first_chunks_between_steps,
        help="call scheduling: first chunks run between two Euler steps of a running call of later chunks",
    )  # fmt: skip
    parser.add_argument(
        "--token2wav", default=defaults.token2wav, choices=TOKEN2WAVS,
        help="unet: CosyVoice2's flow from --model-dir; dit: the DiT flow of Step-Audio-2-mini from --dit-dir",
    )  # fmt: skip
    parser.add_argument("--dit-dir", type=Path, help="the released token2wav/ directory (flow.yaml, flow.pt, hift.pt)")
    parser.add_argument(
        "--layout", default=None, choices=LAYOUTS,
        help="default: colocated for the pytorch LLM (LLM + token2wav in one process), single for tensorrt_llm",
    )  # fmt: skip
    parser.add_argument(
        "--token2wav-gpus", default=None, metavar="IDS",
        help=f"disaggregated: GPUs of the token2wav replicas, e.g. 1,2,3 (default {','.join(map(str, DEFAULT_TOKEN2WAV_GPUS))};"
        f" the LLM has GPU {LLM_GPU})",
    )  # fmt: skip
    parser.add_argument(
        "--token2wav-instances-per-gpu", type=int, default=defaults.token2wav_instances_per_gpu, metavar="N",
        help="disaggregated: token2wav replicas on each of those GPUs",
    )  # fmt: skip
    parser.add_argument(
        "--gpu-emulation", action="store_true",
        help="tests/CI: rehearse --layout disaggregated on --device cpu (same models and routing, every device cpu)",
    )  # fmt: skip
    parser.add_argument(
        "--llm-delivery", default=None, choices=LLM_DELIVERIES,
        help="tokens to the streaming orchestrator per chunk boundary (default for pytorch) or per token (tensorrt_llm)",
    )  # fmt: skip
    parser.add_argument(
        "--benchmark-speech-ratio", type=float, default=None, metavar="R",
        help="benchmarks on random weights only: every request generates round(R x text tokens) speech tokens",
    )  # fmt: skip
    spark = SparkRenderOptions(model_dir=Path())
    parser.add_argument("--spark-dir", type=Path, help="a Spark-TTS model directory: render the spark_tts models too")
    parser.add_argument("--spark-max-new-tokens", type=int, default=spark.max_new_tokens,
                        help="Spark LLM tokens per segment (50 per second of audio)")
    parser.add_argument("--spark-first-chunk", type=int, default=spark.first_chunk_tokens,
                        help="Spark streaming: tokens in the first piece")
    parser.add_argument("--spark-chunk-scale", type=float, default=spark.chunk_scale,
                        help="Spark streaming: growth of each next piece")
    parser.add_argument("--spark-max-seq-len", type=int, default=spark.max_seq_len,
                        help="Spark LLM prompt + generated tokens per sequence")
    parser.add_argument("--spark-engine-dir", type=Path,
                        help="a TensorRT-LLM engine of the Spark LLM (python -m cosyvoice_build.spark_trtllm): "
                             "rendered as spark_llm on the tensorrtllm backend")
    parser.add_argument("--spark-benchmark-ratio", type=float, default=None, metavar="R",
                        help="Spark benchmarks on random weights only: every request generates round(R x text "
                             "tokens) semantic tokens")
    parser.add_argument("--voice-cache", type=int, default=defaults.voice_cache, help="voices kept in the prompt cache")
    parser.add_argument(
        "--repetition-penalty", type=float, default=defaults.repetition_penalty,
        help="tensorrt_llm only: the backend's repetition penalty (1 = off; the PyTorch LLM uses RAS instead)",
    )  # fmt: skip
    args = parser.parse_args(argv)
    try:
        out = write_repository(
            RenderOptions(
                model_dir=args.model_dir,
                out=args.out,
                llm_backend=args.llm_backend,
                engine_dir=args.engine_dir,
                llm_dir=args.llm_dir,
                device=args.device,
                dtype=args.dtype,
                max_batch=args.max_batch,
                max_seq_len=args.max_seq_len,
                max_waiting=args.max_waiting,
                instances=_instances(args.instances),
                first_hop=args.first_hop,
                chunk_growth=args.chunk_growth,
                flow_cache=args.flow_cache,
                flow_cache_gb=args.flow_cache_gb,
                t2w_scheduling=args.t2w_scheduling,
                t2w_first_chunk_worker=args.t2w_first_chunk_worker,
                t2w_first_chunks_between_steps=args.t2w_first_chunks_between_steps,
                token2wav=args.token2wav,
                dit_dir=args.dit_dir,
                layout=args.layout,
                llm_delivery=args.llm_delivery,
                voice_cache=args.voice_cache,
                benchmark_speech_ratio=args.benchmark_speech_ratio,
                repetition_penalty=args.repetition_penalty,
                token2wav_gpus=parse_gpus(args.token2wav_gpus) if args.token2wav_gpus is not None else None,
                token2wav_instances_per_gpu=args.token2wav_instances_per_gpu,
                gpu_emulation=args.gpu_emulation,
                spark=None if args.spark_dir is None else SparkRenderOptions(
                    model_dir=args.spark_dir, max_new_tokens=args.spark_max_new_tokens,
                    first_chunk_tokens=args.spark_first_chunk, chunk_scale=args.spark_chunk_scale,
                    max_seq_len=args.spark_max_seq_len, benchmark_ratio=args.spark_benchmark_ratio,
                    engine_dir=args.spark_engine_dir,
                ),
            )
        )
    except RenderError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"rendered {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
