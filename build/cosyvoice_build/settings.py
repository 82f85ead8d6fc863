"""Build settings: one frozen object, every output path derived from it (so every stage finds the others' outputs).

Each option can be given on the command line or as an environment variable ``COSYVOICE_<OPTION>`` (upper case,
dashes as underscores), which is how docker-compose passes them; the command line wins.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from cosyvoice3.layout import RELEASE_DIRNAME as COSYVOICE3_WEIGHTS_DIRNAME
from cosyvoice3.layout import RELEASE_REPO as COSYVOICE3_MODEL_ID

ModelSource = Literal["hf", "modelscope", "local"]
LLMBackend = Literal["trtllm", "torch"]
#: colocated = LLM and token2wav in one process (PyTorch LLM only; avoids GPU time-slicing between processes)
TritonLayout = Literal["single", "colocated"]

DEFAULT_MODEL_IDS: dict[str, str] = {"hf": "FunAudioLLM/CosyVoice2-0.5B", "modelscope": "iic/CosyVoice2-0.5B"}
WEIGHTS_DIRNAME = "CosyVoice2-0.5B"
#: unet = CosyVoice2's own flow (in the weights above); dit = Step-Audio-2-mini's DiT flow (downloaded besides)
Token2WavKind = Literal["unet", "dit"]
DitSource = Literal["hf", "local"]
DIT_MODEL_ID = "stepfun-ai/Step-Audio-2-mini"
DIT_DIRNAME = "Step-Audio-2-mini"
#: Spark-TTS weights (CC-BY-NC-SA-4.0): "off" (default) never fetches them.
SparkSource = Literal["off", "hf", "local"]
SPARK_MODEL_ID = "SparkAudio/Spark-TTS-0.5B"
SPARK_WEIGHTS_DIRNAME = "Spark-TTS-0.5B"
#: Fun-CosyVoice3-0.5B-2512 (engine `cosyvoice3/`): "off" (default) never fetches it. Both hubs publish it under
#: the same repository name.
CosyVoice3Source = Literal["off", "hf", "modelscope", "local"]


@dataclass(frozen=True)
class TrtllmOptions:
    """What shapes and precision the TensorRT-LLM engine is built for."""

    dtype: Literal["bfloat16", "float16"] = "bfloat16"
    weight_only: Literal["none", "int8", "int4"] = "none"
    tp_size: int = 1
    max_batch_size: int = 32
    #: Tokens per engine step over the whole batch (prefill + decode); bounds activation memory.
    max_num_tokens: int = 8192
    #: Prompt (sos + text + task_id + prompt speech tokens) plus generated speech tokens.
    max_seq_len: int = 4096
    max_input_len: int = 2048

    def __post_init__(self) -> None:
        if self.tp_size < 1 or self.tp_size & (self.tp_size - 1):
            raise ValueError(f"tp_size must be a power of two, got {self.tp_size}")
        if not 0 < self.max_input_len < self.max_seq_len:
            raise ValueError(f"need 0 < max_input_len ({self.max_input_len}) < max_seq_len ({self.max_seq_len})")
        if self.max_num_tokens < self.max_input_len:
            raise ValueError(f"max_num_tokens ({self.max_num_tokens}) < max_input_len ({self.max_input_len})")
        if self.max_batch_size < 1:
            raise ValueError("max_batch_size must be >= 1")

    @property
    def tag(self) -> str:
        """Names checkpoint/engine directories by what changes their content (never by GPU model)."""
        quant = "" if self.weight_only == "none" else f"_wo{self.weight_only}"
        return f"{self.dtype}{quant}_tp{self.tp_size}"


@dataclass(frozen=True)
class BuildSettings:
    work_dir: Path = Path("models")
    model_source: ModelSource = "hf"
    model_id: str | None = None  # None: the official repository of model_source
    model_revision: str | None = None
    model_dir: Path | None = None  # the weights, for model_source "local"
    llm_backend: LLMBackend = "trtllm"
    triton_layout: TritonLayout = "single"
    hf_dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    #: Where/in which precision Triton runs the PyTorch models; None: the render tool's default
    #: (cuda for TensorRT-LLM, otherwise cpu; fp32).
    triton_device: Literal["cpu", "cuda"] | None = None
    triton_dtype: Literal["fp32", "fp16", "bf16"] | None = None
    trtllm: TrtllmOptions = field(default_factory=TrtllmOptions)
    smoke_text: str = "Hello, this is a smoke test of the speech pipeline."
    smoke_url: str | None = None  # an already running Triton (gRPC host:port); None: start one
    token2wav: Token2WavKind = "unet"
    dit_source: DitSource = "hf"
    dit_model_id: str = DIT_MODEL_ID
    dit_revision: str | None = None
    dit_local_dir: Path | None = None  # an existing token2wav/ directory (dit source 'local')
    spark_source: SparkSource = "off"
    spark_model_id: str = SPARK_MODEL_ID
    spark_revision: str | None = None
    spark_model_dir: Path | None = None  # the weights, for spark_source "local"
    accept_spark_license: bool = False  # required for a hub download (the weights are non-commercial)
    cosyvoice3_source: CosyVoice3Source = "off"
    cosyvoice3_model_id: str = COSYVOICE3_MODEL_ID
    cosyvoice3_revision: str | None = None
    cosyvoice3_model_dir: Path | None = None  # the weights, for cosyvoice3_source "local"

    def __post_init__(self) -> None:
        if self.model_source == "local" and self.model_dir is None:
            raise ValueError("model source 'local' needs a model directory (--model-dir / COSYVOICE_MODEL_DIR)")
        if self.dit_source == "local" and self.dit_local_dir is None:
            raise ValueError("DiT source 'local' needs a token2wav directory (--dit-dir / COSYVOICE_DIT_DIR)")
        if self.spark_source == "local" and self.spark_model_dir is None:
            raise ValueError("spark source 'local' needs --spark-model-dir / COSYVOICE_SPARK_MODEL_DIR")
        if self.cosyvoice3_source == "local" and self.cosyvoice3_model_dir is None:
            raise ValueError("cosyvoice3 source 'local' needs --cosyvoice3-model-dir / COSYVOICE_COSYVOICE3_MODEL_DIR")

    @property
    def dit_dir(self) -> Path:
        """The DiT token2wav files (flow.yaml, flow.pt, hift.pt, campplus.onnx, speech_tokenizer_v2_25hz.onnx)."""
        if self.dit_source == "local":
            assert self.dit_local_dir is not None
            return self.dit_local_dir
        return self.work_dir / DIT_DIRNAME / "token2wav"

    @property
    def resolved_model_id(self) -> str:
        return self.model_id or DEFAULT_MODEL_IDS.get(self.model_source, "")

    @property
    def weights_dir(self) -> Path:
        if self.model_source == "local":
            assert self.model_dir is not None
            return self.model_dir
        return self.work_dir / WEIGHTS_DIRNAME

    @property
    def spark_weights_dir(self) -> Path:
        if self.spark_source == "local":
            assert self.spark_model_dir is not None
            return self.spark_model_dir
        return self.work_dir / SPARK_WEIGHTS_DIRNAME

    @property
    def cosyvoice3_weights_dir(self) -> Path:
        if self.cosyvoice3_source == "local":
            assert self.cosyvoice3_model_dir is not None
            return self.cosyvoice3_model_dir
        return self.work_dir / COSYVOICE3_WEIGHTS_DIRNAME

    @property
    def hf_llm_dir(self) -> Path:
        return self.work_dir / "cosyvoice2_llm_hf"

    @property
    def trtllm_checkpoint_dir(self) -> Path:
        return self.work_dir / "trtllm" / f"checkpoint_{self.trtllm.tag}"

    @property
    def engine_dir(self) -> Path:
        return self.work_dir / "trtllm" / f"engine_{self.trtllm.tag}"

    @property
    def triton_repo_dir(self) -> Path:
        """One repository per backend/layout, so switching compose profiles never serves a stale one."""
        return self.work_dir / "triton_repo" / f"{self.llm_backend}_{self.triton_layout}"

    @property
    def state_dir(self) -> Path:
        """Stage markers, digest cache and logs."""
        return self.work_dir / ".build"
