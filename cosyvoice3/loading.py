"""Strict loading of a released Fun-CosyVoice3-0.5B-2512 directory.

Every checkpoint tensor must be consumed by our modules and every module tensor must come from the file, with
the same shape; otherwise `CosyVoice3ModelError` names the file and the offending keys (all of them, up to a
limit per kind). The LLM and the flow are built on the meta device and take the file's tensors directly (no
random init, no second copy), then are cast to the requested dtype; HiFT stays fp32 (its f0 predictor float64).
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Mapping

import torch
from torch import nn

from cosyvoice2.config import resolve_dtype
from speech_lm.checkpoints import CheckpointMismatchError, check_state_dict, meta_without_init, read_checkpoint

from .config import CosyVoice3Config
from .errors import CosyVoice3ModelError
from .flow import CosyVoice3Flow
from .hift import CausalHiFT
from .layout import ENGINE_FILES, FLOW_FILE, FRONTEND_FILES, HIFT_FILE, LLM_FILE, TOKENIZER_FILES
from .llm import CosyVoice3LM


def check_model_dir(model_dir: Path) -> None:
    """Raise CosyVoice3ModelError naming every file the engine reads that is missing."""
    if not model_dir.is_dir():
        raise CosyVoice3ModelError(f"model directory {model_dir} does not exist")
    missing = [name for name in ENGINE_FILES if not (model_dir / name).is_file()]
    if missing:
        raise CosyVoice3ModelError(f"model directory {model_dir} lacks {', '.join(missing)}")


def load_strict(module: nn.Module, state: Mapping[str, torch.Tensor], path: Path) -> None:
    """Every key consumed, every shape equal (CosyVoice3ModelError otherwise), then assign the file's tensors."""
    try:
        check_state_dict(module.state_dict(), state, path)
    except CheckpointMismatchError as exc:
        raise CosyVoice3ModelError(str(exc)) from exc
    module.load_state_dict(state, strict=True, assign=True)


def _read(path: Path) -> dict[str, torch.Tensor]:
    try:
        return read_checkpoint(path)
    except Exception as exc:  # a truncated or foreign file: say which one
        raise CosyVoice3ModelError(f"{path}: not a readable torch checkpoint ({exc})") from exc


def load_llm(path: Path, config: CosyVoice3Config, device: torch.device | str = "cpu",
             dtype: torch.dtype = torch.float32) -> CosyVoice3LM:
    with meta_without_init():
        llm = CosyVoice3LM(config.llm)
    load_strict(llm, _read(path), path)
    llm.to(device=torch.device(device), dtype=dtype)
    # assign=True gave lm_head its own tensor; tie it to the text embedding again, as the release does
    llm.llm.model.lm_head.weight = llm.body.embed_tokens.weight
    return llm.eval()


def load_flow(path: Path, config: CosyVoice3Config, device: torch.device | str = "cpu",
              dtype: torch.dtype = torch.float32) -> CosyVoice3Flow:
    with meta_without_init():
        flow = CosyVoice3Flow(config.flow)  # the CFM noise table is still drawn on the CPU (it is not in the file)
    load_strict(flow, _read(path), path)
    return flow.to(device=torch.device(device), dtype=dtype).eval()


def load_hift(path: Path, config: CosyVoice3Config, device: torch.device | str = "cpu") -> CausalHiFT:
    hift = CausalHiFT(config.hift)  # small: built normally, so its window and noise tables are real tensors
    load_strict(hift, CausalHiFT.read_state_dict(path), path)
    hift.fold_weight_norm()
    return hift.to(torch.device(device)).eval()


def load_config(model_dir: str | Path, hift_noise_seed: int | None = None, **llm_overrides: object) -> CosyVoice3Config:
    config = CosyVoice3Config.from_model_dir(model_dir, **llm_overrides)
    if hift_noise_seed is not None:
        config = replace(config, hift=replace(config.hift, noise_seed=hift_noise_seed))
    return config


def load(model_dir: str | Path, device: str | torch.device = "cpu", dtype: str | torch.dtype = torch.float32,
         config: CosyVoice3Config | None = None,
         onnx_providers: list[str] | None = None):  # -> CosyVoice3 (import cycle avoided)
    """Load a released directory (or one written by `cosyvoice3.testing`) into a `CosyVoice3` engine.
    dtype applies to the LLM and the flow; HiFT runs in fp32. The text tokenizer and the prompt frontend are
    loaded when their files are there (a directory with only the engine files serves id-level calls);
    `onnx_providers` places the speech tokenizer (default: CUDA when onnxruntime has it)."""
    from .engine import CosyVoice3
    from .frontend import PromptFrontend
    from .text import CosyVoice3Tokenizer

    model_dir = Path(model_dir)
    check_model_dir(model_dir)
    config = config or load_config(model_dir)
    dtype = resolve_dtype(dtype)
    has = lambda names: all((model_dir / name).is_file() for name in names)  # noqa: E731
    tokenizer = CosyVoice3Tokenizer.from_model_dir(model_dir) if has(TOKENIZER_FILES) else None
    frontend = PromptFrontend.from_model_dir(model_dir, onnx_providers) if has(FRONTEND_FILES) else None
    return CosyVoice3(config, load_llm(model_dir / LLM_FILE, config, device, dtype),
                      load_flow(model_dir / FLOW_FILE, config, device, dtype),
                      load_hift(model_dir / HIFT_FILE, config, device), tokenizer, frontend)
