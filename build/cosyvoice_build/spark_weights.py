"""Fetch the Spark-TTS-0.5B weights (``SparkAudio/Spark-TTS-0.5B``) - only when asked.

The weights are licensed CC-BY-NC-SA-4.0 (non-commercial, share-alike); the code that runs them is ours and
Apache-2.0. So nothing is downloaded by default: the ``spark-weights`` stage does nothing unless a source is
chosen (``--spark-source hf`` or ``local``), and a hub download also needs ``--accept-spark-license``. Whenever
the weights are fetched or used from a local directory, the licence notice is printed.

Only the files the engine reads are fetched (``spark_tts.layout.MODEL_FILES`` plus the tokenizer's companions).
"""

from __future__ import annotations

import json
import logging
import zipfile
from pathlib import Path
from typing import Callable

import yaml

from cosyvoice_build.pipeline import StageError
from cosyvoice_build.settings import BuildSettings
from cosyvoice_build.weights import HubDownload, huggingface_download
from spark_tts import layout

log = logging.getLogger("cosyvoice_build")

DOWNLOAD_PATTERNS = (
    *layout.MODEL_FILES,
    f"{layout.LLM_DIR}/*.json",  # tokenizer_config, added_tokens, special_tokens_map, vocab
    f"{layout.LLM_DIR}/merges.txt",
    f"{layout.WAV2VEC2_DIR}/preprocessor_config.json",
)

LICENSE_NOTICE = (
    f"Spark-TTS-0.5B weights ({layout.RELEASE_REPO}) are licensed {layout.WEIGHTS_LICENSE} "
    f"({layout.WEIGHTS_LICENSE_URL}): attribution, non-commercial use only, derivatives under the same licence. "
    "You are responsible for complying with it; do not use the weights to clone a voice without consent."
)

HUBS: dict[str, HubDownload] = {"hf": huggingface_download}


def verify_spark_dir(model_dir: Path) -> None:
    """Raise StageError naming every missing or malformed file the Spark engine reads."""
    if not model_dir.is_dir():
        raise StageError(f"Spark model directory {model_dir} does not exist")
    problems = []
    for name in layout.MODEL_FILES:
        path = model_dir / name
        if not path.is_file():
            problems.append(f"{name}: missing")
            continue
        if path.stat().st_size == 0:
            problems.append(f"{name}: empty")
            continue
        try:
            if name.endswith(".json"):
                json.loads(path.read_text(encoding="utf-8"))
            elif name.endswith(".yaml"):
                yaml.safe_load(path.read_text(encoding="utf-8"))
            elif name.endswith(".bin") and not zipfile.is_zipfile(path):
                problems.append(f"{name}: not a torch.save archive (truncated download?)")
            elif name.endswith(".safetensors"):
                _check_safetensors_header(path)
        except (ValueError, UnicodeDecodeError, yaml.YAMLError) as exc:
            problems.append(f"{name}: unreadable ({exc})")
    if problems:
        raise StageError(f"Spark model directory {model_dir} is incomplete: " + "; ".join(problems))


def _check_safetensors_header(path: Path) -> None:
    """The header length and JSON parse, and the file holds every byte the header promises."""
    with path.open("rb") as handle:
        size = int.from_bytes(handle.read(8), "little")
        header = json.loads(handle.read(size))
    end = max((entry["data_offsets"][1] for key, entry in header.items() if key != "__metadata__"), default=0)
    if path.stat().st_size < 8 + size + end:
        raise ValueError("truncated")


def fetch_spark_weights(settings: BuildSettings, hubs: dict[str, HubDownload] | None = None,
                        say: Callable[[str], None] = print) -> Path | None:
    """Make ``settings.spark_weights_dir`` hold verified Spark weights and return it; None when not requested."""
    if settings.spark_source == "off":
        log.info("[spark-weights] not requested (--spark-source hf|local); weights are %s", layout.WEIGHTS_LICENSE)
        return None
    target = settings.spark_weights_dir
    if settings.spark_source != "local":
        if not settings.accept_spark_license:
            raise StageError(f"{LICENSE_NOTICE} Pass --accept-spark-license (COSYVOICE_ACCEPT_SPARK_LICENSE=1) "
                             "to download them.")
        say(LICENSE_NOTICE)
        target.mkdir(parents=True, exist_ok=True)
        download = (hubs or HUBS)[settings.spark_source]
        download(settings.spark_model_id, settings.spark_revision, target, list(DOWNLOAD_PATTERNS))
    else:
        say(LICENSE_NOTICE)
    verify_spark_dir(target)
    return target


# TensorRT-LLM configuration of the Spark LLM -----------------------------------------------------------------
#: ``LLM/`` is already a Hugging Face Qwen2 checkpoint (no conversion of ours needed): the same converter and
#: ``trtllm-build`` flags as CosyVoice2's engine, with Spark's shapes. Prompt = 38 fixed tokens + text + 50 per
#: reference second (a 10 s reference with ~500 text tokens stays under 1536); output <= 512 new tokens.
SPARK_MAX_NEW_TOKENS = 512


def spark_trtllm_options(max_batch_size: int = 16, max_input_len: int = 1536) -> "TrtllmOptions":
    from cosyvoice_build.settings import TrtllmOptions

    return TrtllmOptions(dtype="bfloat16", max_batch_size=max_batch_size, max_input_len=max_input_len,
                         max_seq_len=max_input_len + SPARK_MAX_NEW_TOKENS,
                         max_num_tokens=max(8192, max_input_len))


def spark_trtllm_commands(weights_dir: Path, work_dir: Path, options: "TrtllmOptions | None" = None
                          ) -> list[list[str]]:
    """The convert and build commands for the Spark LLM engine (run where TensorRT-LLM is installed)."""
    from cosyvoice_build.trtllm import build_command, convert_command

    options = options or spark_trtllm_options()
    checkpoint = work_dir / "trtllm" / f"spark_checkpoint_{options.tag}"
    engine = work_dir / "trtllm" / f"spark_engine_{options.tag}"
    return [convert_command(options, weights_dir / layout.LLM_DIR, checkpoint),
            build_command(options, checkpoint, engine)]
