"""The render tool's options: `RenderOptions` (and its Spark and CosyVoice3 parts, `SparkRenderOptions`,
`CosyVoice3RenderOptions`), each option ONE field.

A field's metadata (`option(...)`) carries everything else that option has: its command-line help, flag name,
choices, metavar and lower bound. The command line (`triton_repo.render`) and the generic checks
(`triton_repo.render_checks`) are built by walking the fields, so adding, changing or deleting an option is an
edit of its field here. A field without `help` is a library option only (no flag).

Values may come as strings from wherever options are written as ``FIELD=VALUE`` (benchmark scripts, settings):
every field parses its string form by its type (`parse_option`), a ``dict[str, int]`` from comma-separated
``MODEL=COUNT`` items.
"""

from __future__ import annotations

import dataclasses
import typing
from dataclasses import MISSING, dataclass, field
from pathlib import Path
from typing import Any, Sequence

from cosyvoice2.streaming import FLOW_CACHE_MODES
from cosyvoice2.vocab import LOGITS_BIAS_FILE
from speech_serving.gpu_yield import LLM_YIELD_MODES
from speech_serving.repetition import LoopGuardConfig
from speech_serving.schedule import FIRST_HOP_ALIGNMENTS, StreamScheduleParams
from spark_tts.llm import SparkSampling
from spark_tts.streaming import ChunkSchedule
import pipeline_contract as contract
from triton_repo import internal_io, spark_io
from triton_repo.model_params import optional_type


class RenderError(ValueError):
    """A render option or input is wrong; the message says which and what to do."""


LLM_BACKENDS = {"pytorch": "pytorch", "torch": "pytorch", "tensorrt_llm": "tensorrt_llm", "trtllm": "tensorrt_llm"}
DTYPES = ("fp32", "fp16", "bf16")
DEVICES = ("cpu", "cuda")
#: colocated: the PyTorch LLM, token2wav and the streaming orchestrator in one process, the streaming entry model
#: itself (its orchestrator calls the LLM's scheduler and token2wav's service directly, no BLS hop per chunk; the
#: offline entry model reaches that engine over BLS; concurrent CUDA streams). single: separate `llm` and `token2wav`
#: models on one device, both entry models orchestrating over BLS. Several GPUs are served by one whole repository
#: per GPU (replicas behind one gRPC target, docs/deploy.md "Several GPUs").
LAYOUTS = ("colocated", "single")
DEFAULT_LAYOUT = {"pytorch": "colocated", "tensorrt_llm": "single"}
#: How the LLM hands its tokens to a streaming orchestrator: `chunk` = one response per chunk boundary of the
#: streaming schedule (the PyTorch LLM's `deliver_at`), `token` = one response per token (all TensorRT-LLM can).
LLM_DELIVERIES = ("chunk", "token")
DEFAULT_LLM_DELIVERY = {"pytorch": "chunk", "tensorrt_llm": "token"}
#: unet: CosyVoice2's own flow (`--model-dir`); dit: the DiT flow of Step-Audio-2-mini (`--dit-dir`, docs/engine.md).
TOKEN2WAVS = ("unet", "dit")
#: CosyVoice3's streaming flow: cached (per-stream flow caches, the same audio up to float rounding), chunked
#: (cached, and the final chunk too continues the caches under the chunk mask instead of recomputing the whole
#: utterance with full attention) or recompute (every chunk re-runs the flow over the prompt and all tokens: the
#: reference path). As CosyVoice2's flow_cache modes exact / chunked / off.
COSYVOICE3_FLOW_CACHES = ("cached", "chunked", "recompute")
#: Models whose instance count may be chosen; llm, token2wav, `spark_engine` and `cosyvoice3_engine` keep
#: per-request state in-process (and so does `cosyvoice2_stream` in the colocated layout: `render_checks`).
SCALABLE = (
    contract.OFFLINE_MODEL, contract.STREAMING_MODEL, "voice_prompt", "audio_tokenizer", "speaker_embedding",
    contract.SPARK_OFFLINE_MODEL, contract.SPARK_STREAMING_MODEL, spark_io.VOICE_PROMPT_MODEL,
    spark_io.AUDIO_TOKENIZER_MODEL,
    contract.COSYVOICE3_OFFLINE_MODEL, contract.COSYVOICE3_STREAMING_MODEL, internal_io.COSYVOICE3_VOICE_PROMPT_MODEL,
    internal_io.COSYVOICE3_AUDIO_TOKENIZER_MODEL, internal_io.COSYVOICE3_SPEAKER_EMBEDDING_MODEL,
)  # fmt: skip
#: LLM sequences decoded together unless `--max-batch` says: 16, and 64 where only PyTorch LLMs run on a GPU. A GPU's
#: decode step costs little more for 64 rows than for 32, and with 32 slots 64 streams queued 250-320 ms for a slot
#: before their prefill (one H100: first chunk p50 635-705 ms against 745-923, docs/PERFORMANCE.md), while a CPU's
#: step grows with every row; a TensorRT-LLM engine is built for its own maximum (Spark's build: 16).
DEFAULT_MAX_BATCH = 16
GPU_PYTORCH_MAX_BATCH = 64
_SPARK_SCHEDULE = ChunkSchedule()


def option(
    default: Any = MISSING,
    *,
    help: str | None = None,  # noqa: A002 - argparse's word; None: no command-line flag
    flag: str | None = None,  # the flag without "--" and prefix; default: the field name with hyphens
    choices: Sequence[str] | None = None,
    metavar: str | None = None,
    minimum: float | None = None,  # refused below this (`render_checks.field_errors`)
    default_factory: Any = MISSING,
) -> Any:
    """A field of an options class with what its command line and its checks need."""
    metadata = {"help": help, "flag": flag, "choices": choices, "metavar": metavar, "minimum": minimum}
    return field(default=default, default_factory=default_factory, metadata=metadata)


def default_device(llm_backend: str) -> str:
    """TensorRT-LLM needs CUDA; anything else renders for the CPU unless told."""
    return "cuda" if llm_backend == "tensorrt_llm" else "cpu"


# -- string forms ----------------------------------------------------------------------------------
def _items(value: str | Sequence[str]) -> list[str]:
    """Comma-separated items of a string, or of each string of a sequence (a repeated flag); blanks dropped."""
    texts = [value] if isinstance(value, str) else list(value)
    return [part.strip() for text in texts for part in str(text).split(",") if part.strip()]


def parse_option(kind: Any, value: Any, flag: str) -> Any:
    """`value` as the field type `kind` when it is written as a string (a dict also from a list of ``KEY=VALUE``
    strings); values of the field's type pass unchanged."""
    kind, _ = optional_type(kind)
    origin, args = typing.get_origin(kind), typing.get_args(kind)
    if origin is dict:
        if not isinstance(value, (str, list, tuple)):
            return value
        out = {}
        for item in _items(value):
            key, sep, count = item.partition("=")
            if not sep or not count.strip().lstrip("-").isdigit():
                raise RenderError(f"{flag} expects MODEL=COUNT, got {item!r}")
            out[key.strip()] = args[1](count)
        return out
    if not isinstance(value, str) or kind is str or not isinstance(kind, type):
        return value
    if kind is bool:
        if value.lower() not in ("true", "false"):
            raise RenderError(f"{flag} expects true or false, got {value!r}")
        return value.lower() == "true"
    try:
        return kind(value)
    except (TypeError, ValueError):
        raise RenderError(f"{flag} expects a {kind.__name__}, got {value!r}") from None


def flag_of(f: dataclasses.Field, prefix: str = "") -> str:
    """The command-line flag of field `f` (also how errors name the option), e.g. "--max-batch"."""
    return "--" + prefix + (f.metadata.get("flag") or f.name.replace("_", "-"))


class _Options:
    """Base of the options classes (frozen dataclasses): string values parsed by their field types."""

    #: the flags' prefix of this class's fields on the command line
    FLAG_PREFIX = ""

    def __post_init__(self) -> None:
        hints = typing.get_type_hints(type(self))
        for f in dataclasses.fields(self):  # type: ignore[arg-type]
            value = getattr(self, f.name)
            parsed = parse_option(hints[f.name], value, flag_of(f, self.FLAG_PREFIX))
            if parsed is not value:
                object.__setattr__(self, f.name, parsed)


@dataclass(frozen=True)
class SparkRenderOptions(_Options):
    """The Spark part of a render (`RenderOptions.spark`); defaults are the served runtime's."""

    FLAG_PREFIX = "spark-"

    # the released layout (SparkAudio/Spark-TTS-0.5B)
    model_dir: Path = option(help="a Spark-TTS model directory: render the spark_tts models too", flag="dir")
    max_new_tokens: int = option(SparkSampling().max_new_tokens, minimum=1,  # 512 = 10.24 s per segment
                                 help="Spark LLM tokens per segment (50 per second of audio)")
    first_chunk_tokens: int = option(_SPARK_SCHEDULE.first_chunk_tokens, flag="first-chunk", minimum=1,
                                     help="Spark streaming: tokens in the first piece")
    chunk_scale: float = option(_SPARK_SCHEDULE.scale, minimum=1, help="Spark streaming: growth of each next piece")
    max_chunk_tokens: int = _SPARK_SCHEDULE.max_chunk_tokens
    # prompt + generated tokens per sequence: a 10 s reference (500 tokens) + 200 text tokens + 512 fit in 2048
    max_seq_len: int = option(2048, minimum=64, help="Spark LLM prompt + generated tokens per sequence")
    # Benchmark mode for random weights (they stop at random): every request generates exactly
    # round(ratio x target text tokens) semantic tokens and the stop id is never drawn. None = off. Spark's own
    # ratio: its tokenizer and token rate (50 per second) are not CosyVoice2's.
    benchmark_ratio: float | None = option(None, metavar="R", help="Spark benchmarks on random weights only: every "
                                           "request generates round(R x text tokens) semantic tokens")
    # A TensorRT-LLM engine of the Spark LLM (`python -m cosyvoice_build.spark_trtllm`): rendered as `spark_llm`
    # (tensorrtllm backend) and the orchestrators' LLM; None: the PyTorch LLM inside `spark_engine`.
    engine_dir: Path | None = option(None, help="a TensorRT-LLM engine of the Spark LLM (python -m "
                                     "cosyvoice_build.spark_trtllm): rendered as spark_llm on the tensorrtllm backend")


@dataclass(frozen=True)
class CosyVoice3RenderOptions(_Options):
    """The CosyVoice3 part of a render (`RenderOptions.cosyvoice3`); defaults are the served runtime's. The LLM's
    capacity (`--max-batch`, `--max-seq-len`, `--max-waiting`), `--dtype`, `--device` and `--voice-cache` are the
    render's, shared with CosyVoice2."""

    FLAG_PREFIX = "cosyvoice3-"

    # the released layout (Fun-CosyVoice3-0.5B-2512)
    model_dir: Path = option(help="a CosyVoice3 model directory: render the cosyvoice3 models too", flag="dir")
    flow_cache: str = option("cached", choices=COSYVOICE3_FLOW_CACHES,
                             help="CosyVoice3 streaming flow: cached (per-stream flow caches, the final chunk "
                                  "recomputed with full attention as the reference), chunked (the final chunk over "
                                  "the caches too) or recompute (every chunk from scratch, the reference)")
    # Each kept voice holds its prompt's keys and values per Euler step and DiT block: ~3.6 MB per prompt frame in
    # fp32 at the released size, ~1.8 GB for a 10 s prompt (docs/cosyvoice3.md, "Token2wav and streaming").
    flow_voices: int = option(8, minimum=1, help="CosyVoice3 cached streaming: voices whose prompt flow caches are "
                              "kept (about 1.8 GB each for a 10 s prompt in fp32)")
    # What the live cached streams' own flow caches may hold together (~1.8 MB per frame in bf16 at the released
    # size: ~0.9 GB for 10 s of speech); a stream whose next cache would pass it recomputes from then on (the same
    # audio, only slower). The voices' prompt caches are bounded by flow_voices and not counted. None: sized to the
    # GPU at start beside the step graphs' buffers, at most 16 GiB (`cosyvoice2.flow.memory`).
    flow_cache_gb: float | None = option(None, minimum=0, help="CosyVoice3 cached streaming: memory for live streams' "
                                         "flow caches (0: no limit; default: sized to the GPU, 16 on 80 GB-class "
                                         "GPUs); a stream over it recomputes from then on")
    first_hop: int = option(15, minimum=4, help="CosyVoice3 streaming: tokens in the first chunk")
    second_hop: int = option(25, minimum=4, help="CosyVoice3 streaming: tokens in the second chunk, doubling after")
    # Benchmark mode for random weights: every request generates exactly round(ratio x text tokens) speech tokens
    # (the text ids the LLM's length limits count) and no stop id is drawn. None = off.
    benchmark_ratio: float | None = option(None, metavar="R", help="CosyVoice3 benchmarks on random weights only: "
                                           "every request generates round(R x text tokens) speech tokens")
    # A TensorRT-LLM engine of the CosyVoice3 LLM and the merged-vocabulary checkpoint it was built from (both from
    # `python -m cosyvoice_build.cosyvoice3_trtllm`): rendered as cosyvoice3_llm on the tensorrtllm backend,
    # whatever CosyVoice2's --llm-backend is; cosyvoice3_engine then runs token2wav only
    engine_dir: Path | None = option(None, help="a TensorRT-LLM engine of the CosyVoice3 LLM (python -m "
                                     "cosyvoice_build.cosyvoice3_trtllm): rendered as cosyvoice3_llm on the "
                                     "tensorrtllm backend")
    llm_dir: Path | None = option(None, help=f"with --cosyvoice3-engine-dir: the converted checkpoint dir with "
                                  f"{LOGITS_BIAS_FILE}")


@dataclass(frozen=True)
class RenderOptions(_Options):
    """Everything a render is made of, as the command line, `render_repository` and the local stack give it;
    `__post_init__` fills in what was left open (layout, LLM delivery, device) the same way for all three."""

    model_dir: Path = option(help="official CosyVoice2 model directory")
    out: Path = option(help="repository directory to (re)write")
    llm_backend: str = option("pytorch", choices=sorted(LLM_BACKENDS),
                              help="the LLM's backend (torch and trtllm name the same two)")
    engine_dir: Path | None = option(None, help="TensorRT-LLM engine directory (tensorrt_llm backend)")
    # HF checkpoint dir with logits_bias.safetensors (tensorrt_llm backend)
    llm_dir: Path | None = option(None, help=f"HF checkpoint dir with {LOGITS_BIAS_FILE} (tensorrt_llm backend)")
    # None: default_device(llm_backend)
    device: str | None = option(None, choices=DEVICES, help="default: cuda for tensorrt_llm, else cpu")
    dtype: str = option("fp32", choices=DTYPES, help="LLM and flow dtype")
    # KV slots; None: GPU_PYTORCH_MAX_BATCH or DEFAULT_MAX_BATCH (above)
    max_batch: int | None = option(None, minimum=1, help=f"LLM sequences decoded together (default: "
                                   f"{GPU_PYTORCH_MAX_BATCH} on CUDA without TensorRT-LLM engines, else {DEFAULT_MAX_BATCH})")
    max_seq_len: int = option(4096, minimum=64, help="prompt + generated tokens")  # per sequence
    # LLM requests queued beyond the slots before [overloaded]
    max_waiting: int = option(64, minimum=0, help="queued LLM requests before overload")
    instances: dict[str, int] = option(default_factory=dict, metavar="MODEL=COUNT", help=f"one of {', '.join(SCALABLE)}")
    first_hop: int = option(StreamScheduleParams.first_hop, minimum=4, help="tokens in the first streaming chunk")
    chunk_growth: int = option(StreamScheduleParams.chunk_growth, minimum=1, help="hop multiplier per chunk")
    align_first_hop: str = option(StreamScheduleParams.align_first_hop, choices=FIRST_HOP_ALIGNMENTS,
                                  help="pad the first hop so it ends on the flow's 25-token grid (upstream's "
                                       "schedule): always; busy (not for a stream that starts alone); never")
    busy_streams: int = option(StreamScheduleParams.busy_streams, minimum=2,
                               help="align_first_hop=busy: pad the first hop of a stream that starts while this "
                                    "many streams run, itself counted (fewer: unpadded, a shorter first chunk)")
    # 12 measured against 25 (one H100, c=1 first chunk p50 132-140 ms against 159-168, c=4 unchanged;
    # docs/experiments/2026-11-28-four-h100s-lease.md); never longer than --first-hop
    lone_first_hop: int | None = option(12, minimum=4, help="tokens in the first chunk of a stream that starts "
                                        "while no other stream runs (at most --first-hop)")
    # Streaming flow caches (cosyvoice2.streaming.FLOW_CACHE_MODES) and the memory they may hold for live
    # streams (voice prefixes not counted); a stream over the budget recomputes from then on. The server runs
    # "chunked" (cheapest final chunk, measured in docs/PERFORMANCE.md); "exact" equals upstream's final chunk.
    flow_cache: str = option("chunked", choices=FLOW_CACHE_MODES,
                             help="streaming flow: chunked (all chunks over caches), exact (final chunk recomputed "
                                  "like upstream), off (every chunk recomputed)")
    # None (this and the rows below): sized to the GPU at start (`cosyvoice2.flow.memory`): 32 GiB and 32 rows, the
    # values measured on 80 GB-class GPUs, where they fit; less on smaller GPUs (docs/deploy.md, "Resource needs").
    flow_cache_gb: float | None = option(None, minimum=0, help="memory for live streams' flow caches (0: no limit; "
                                         "default: sized to the GPU, 32 on 80 GB-class GPUs)")
    # The UNet token2wav's jobs per call (its CUDA graphs' largest row bucket; the service never forms a larger
    # call); 32 measured against 16 on one H100; each row takes 504 MiB of key buffer.
    token2wav_rows: int | None = option(None, minimum=1, help="unet: jobs (streams' chunks) per token2wav call at "
                                        "most, the largest row bucket of its CUDA graphs (default: sized to the "
                                        "GPU, 32 on 80 GB-class GPUs)")
    # None: lone in the colocated layout on a GPU, else off. Measured on one H200 (docs/PERFORMANCE.md): lone took a lone
    # stream's first chunk from 111-113 ms to 100-104 (its token2wav call 64 -> 56 ms) and changed nothing measurable
    # from 4 streams up.
    llm_yield: str | None = option(None, choices=LLM_YIELD_MODES,
                                   help="colocated layout: the LLM waits for the running token2wav call while it "
                                        "decodes one stream past its first chunk (lone) or never (off); default: lone when colocated on a GPU, else off")
    # Which flow + HiFT turns speech tokens into audio; dit needs `dit_dir`, the released `token2wav/` directory
    # (the LLM, the voice frontend and the chunk schedule stay CosyVoice2's; flow_cache* apply to unet only).
    token2wav: str = option("unet", choices=TOKEN2WAVS, help="unet: CosyVoice2's flow from --model-dir; dit: the DiT "
                            "flow of Step-Audio-2-mini from --dit-dir")
    dit_dir: Path | None = option(None, help="the released token2wav/ directory (flow.yaml, flow.pt, hift.pt)")
    # Benchmark mode for random-weight models (they stop at random): every request generates exactly
    # round(ratio x target text tokens) speech tokens and the stop ids are never sampled. None = off.
    benchmark_speech_ratio: float | None = option(None, metavar="R", help="benchmarks on random weights only: every "
                                                  "request generates round(R x text tokens) speech tokens")
    # None: DEFAULT_LAYOUT of the LLM backend
    layout: str | None = option(None, choices=LAYOUTS, help="default: colocated for the pytorch LLM (LLM + token2wav "
                                "in one process), single for tensorrt_llm")
    # None: DEFAULT_LLM_DELIVERY of the LLM backend
    llm_delivery: str | None = option(None, choices=LLM_DELIVERIES, help="tokens to the streaming orchestrator per "
                                      "chunk boundary (default for pytorch) or per token (tensorrt_llm)")
    voice_cache: int = option(64, minimum=1, help="voices kept in the prompt cache")
    max_target_text_tokens: int = option(contract.MAX_SEGMENT_TOKENS, minimum=1)
    audio_max_batch: int = option(8, minimum=1)
    max_queue_delay_us: int = option(1000, minimum=0)
    # TensorRT-LLM only (the PyTorch LLM samples with RAS): the backend's repetition penalty (upstream's 1.1) and
    # the orchestrator's loop guard, together the nearest the C++ backend gets to RAS (docs/deploy.md)
    repetition_penalty: float = option(1.1, help="tensorrt_llm only: the backend's repetition penalty (1 = off; the "
                                       "PyTorch LLM uses RAS instead)")
    loop_guard: LoopGuardConfig = field(default_factory=LoopGuardConfig)
    # Spark-TTS beside CosyVoice2 (`--spark-dir`); None: CosyVoice2 only
    spark: SparkRenderOptions | None = None
    # CosyVoice3 beside CosyVoice2 (`--cosyvoice3-dir`); None: no CosyVoice3
    cosyvoice3: CosyVoice3RenderOptions | None = None

    def __post_init__(self) -> None:
        # The one place that fills in what was left open, for the command line, the library call and the stack alike.
        super().__post_init__()
        object.__setattr__(self, "llm_backend", LLM_BACKENDS.get(self.llm_backend, self.llm_backend))
        if self.layout is None:
            object.__setattr__(self, "layout", DEFAULT_LAYOUT.get(self.llm_backend, "single"))
        if self.llm_delivery is None:
            object.__setattr__(self, "llm_delivery", DEFAULT_LLM_DELIVERY.get(self.llm_backend, "token"))
        if self.device is None:
            object.__setattr__(self, "device", default_device(self.llm_backend))
        if self.llm_yield is None:
            # a GPU shared by the LLM and token2wav in one process is what it measured a gain on
            gpu_colocated = self.layout == "colocated" and self.device != "cpu"
            object.__setattr__(self, "llm_yield", "lone" if gpu_colocated else "off")
        if self.max_batch is None:
            engines = self.engine_dir is not None or (self.spark is not None and self.spark.engine_dir is not None)
            gpu_pytorch = self.device != "cpu" and self.llm_backend == "pytorch" and not engines
            object.__setattr__(self, "max_batch", GPU_PYTORCH_MAX_BATCH if gpu_pytorch else DEFAULT_MAX_BATCH)

    def instances_of(self, model: str) -> int:
        return self.instances.get(model, 1)

    @property
    def model_device(self) -> str:
        """The `device` parameter of every torch or ONNX model's adapter: "cpu", or "cuda:0", the first GPU the
        tritonserver process sees (one process per GPU serves several GPUs, each pinned by CUDA_VISIBLE_DEVICES)."""
        return "cpu" if self.device == "cpu" else "cuda:0"
