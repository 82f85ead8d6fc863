"""A TensorRT-LLM engine directory and HF checkpoint as the render step sees them (no GPU: only the files it
reads): the engine's `config.json` as trtllm-build writes it, one rank file, and a real logits bias file."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from safetensors.numpy import save_file

from cosyvoice2.vocab import LOGITS_BIAS_FILE, LOGITS_BIAS_KEY

PINNED_TRTLLM_VERSION = "0.20.0"  # what the 25.06-trtllm-python-py3 image ships
VOCAB_SIZE = 158336  # the padded CosyVoice2 vocabulary (docs/deploy.md)


def fake_trtllm_inputs(
    tmp_path: Path,
    max_batch_size: int = 32,
    max_seq_len: int = 4096,
    version: str | None = PINNED_TRTLLM_VERSION,
    logits_dtype: str | None = "float32",
    vocab_size: int = VOCAB_SIZE,
    bias_length: int = VOCAB_SIZE,
    tp_size: int = 1,
) -> tuple[Path, Path]:
    engine = tmp_path / "engine"
    engine.mkdir(parents=True)
    pretrained = {"architecture": "Qwen2ForCausalLM", "vocab_size": vocab_size, "mapping": {"tp_size": tp_size, "pp_size": 1}}
    if logits_dtype is not None:
        pretrained["logits_dtype"] = logits_dtype
    config = {"pretrained_config": pretrained, "build_config": {"max_batch_size": max_batch_size, "max_seq_len": max_seq_len}}
    if version is not None:
        config["version"] = version
    (engine / "config.json").write_text(json.dumps(config))
    for rank in range(tp_size):
        (engine / f"rank{rank}.engine").write_bytes(b"\0")
    llm_dir = tmp_path / "hf"
    llm_dir.mkdir()
    save_file({LOGITS_BIAS_KEY: np.zeros(bias_length, np.float32)}, str(llm_dir / LOGITS_BIAS_FILE))
    return engine, llm_dir
