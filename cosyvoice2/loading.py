"""Load a CosyVoice2 model directory in the official layout (docs/reference/cosyvoice2.md#model-directory) into a
`CosyVoice2` pipeline.

Checkpoints are matched strictly: every key of our modules must be in the file with the same shape and the
file may hold no other key; errors name the file and the offending keys/shapes. The LLM and the flow are
built on the meta device and take the checkpoint tensors directly (no random init, no double memory), then
are cast to the requested dtype; HiFT and the ONNX frontend stay fp32, as upstream.
"""

from __future__ import annotations

from pathlib import Path

import torch

from cosyvoice2.config import TOKENIZER_SUBDIR, EngineConfig, resolve_dtype
from cosyvoice2.flow import CausalFlow
from cosyvoice2.frontend.onnx_models import PromptModels
from cosyvoice2.hift import HiFTGenerator
from cosyvoice2.layout import CHECKPOINT_FILES, FLOW_FILE, HIFT_FILE, LLM_FILE, ONNX_FILES
from cosyvoice2.llm import CosyVoice2LM
from cosyvoice2.pipeline import CosyVoice2
from cosyvoice2.text.tokenizer import CosyVoice2Tokenizer
from speech_lm.checkpoints import load_into, meta_without_init, read_checkpoint

REQUIRED_FILES = (*CHECKPOINT_FILES, *ONNX_FILES)


def check_model_dir(model_dir: Path) -> None:
    """Raise FileNotFoundError naming every official file or directory that is missing."""
    if not model_dir.is_dir():
        raise FileNotFoundError(f"model directory {model_dir} does not exist")
    missing = [name for name in REQUIRED_FILES if not (model_dir / name).is_file()]
    if not (model_dir / TOKENIZER_SUBDIR).is_dir():
        missing.append(f"{TOKENIZER_SUBDIR}/")
    if missing:
        raise FileNotFoundError(f"model directory {model_dir} lacks {', '.join(missing)}")


def load_llm(path: Path, config: EngineConfig, device: torch.device, dtype: torch.dtype) -> CosyVoice2LM:
    with meta_without_init():
        llm = CosyVoice2LM(config.llm)
    load_into(llm, read_checkpoint(path), path)
    llm.to(device=device, dtype=dtype)
    # assign=True gave lm_head its own tensor; re-tie it to the text embedding as upstream (it is never used)
    llm.llm.model.lm_head.weight = llm.body.embed_tokens.weight
    return llm.eval()


def load_flow(path: Path, config: EngineConfig, device: torch.device, dtype: torch.dtype) -> CausalFlow:
    with meta_without_init():
        flow = CausalFlow(config.flow)  # its fixed CFM noise is still created on the CPU (not in the file)
    load_into(flow, read_checkpoint(path), path)
    return flow.to(device=device, dtype=dtype).eval()


def load_hift(path: Path, config: EngineConfig, device: torch.device) -> HiFTGenerator:
    hift = HiFTGenerator(config.hift)  # small; built normally so its STFT window is a real tensor
    load_into(hift, HiFTGenerator.read_state_dict(path), path)
    hift.fold_weight_norm()  # g * v / |v| once, instead of on every forward
    return hift.to(device).eval()


def load(model_dir: str | Path, device: str | torch.device = "cpu",
         dtype: str | torch.dtype = torch.float32) -> CosyVoice2:
    """Load an official CosyVoice2 model directory (or a tiny/random one written by `cosyvoice2.testing`).

    dtype applies to the LLM and the flow (fp32, fp16 or bf16); HiFT and the ONNX frontend run in fp32.
    """
    model_dir = Path(model_dir)
    device = torch.device(device)
    dtype = resolve_dtype(dtype)
    check_model_dir(model_dir)
    config = EngineConfig.for_model_dir(model_dir)
    llm = load_llm(model_dir / LLM_FILE, config, device, dtype)
    flow = load_flow(model_dir / FLOW_FILE, config, device, dtype)
    hift = load_hift(model_dir / HIFT_FILE, config, device)
    tokenizer = CosyVoice2Tokenizer.from_model_dir(model_dir)
    providers = None if device.type == "cuda" else ["CPUExecutionProvider"]  # None: CUDA if onnxruntime has it
    prompt_models = PromptModels.from_model_dir(model_dir, providers)
    return CosyVoice2(config, llm, flow, hift, tokenizer, prompt_models)
