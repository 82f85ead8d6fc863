"""Load a DiT token2wav directory in the released layout (Step-Audio-2-mini `token2wav/`).

Files: `flow.yaml` (constructor arguments), `flow.pt` (the flow state dict, loaded strictly), `hift.pt` (HiFT,
an optional `generator.` key prefix stripped). The released runtime builds HiFT with its default (full-size)
arguments; a directory may add `hift.yaml` (`hift:` mapping of HiFTGenerator arguments) for other sizes (the
micro test models). `campplus.onnx` and `speech_tokenizer_v2_25hz.onnx` serve the voice frontend, not this loader.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from cosyvoice2.config import resolve_dtype
from cosyvoice2.hift import HiFTConfig, HiFTGenerator
from speech_lm.checkpoints import load_into, meta_without_init, read_checkpoint

from .config import DiTFlowConfig, DiTSolverConfig, _load_tagged_yaml
from .flow import DiTFlow
from .layout import DIT_FLOW_CONFIG, DIT_FLOW_FILE, DIT_HIFT_CONFIG, DIT_HIFT_FILE
from .token2wav import DiTStreamingConfig, DiTToken2Wav


def check_dit_dir(model_dir: Path) -> None:
    """Raise FileNotFoundError naming every file the DiT token2wav needs that is missing."""
    if not model_dir.is_dir():
        raise FileNotFoundError(f"DiT token2wav directory {model_dir} does not exist")
    missing = [name for name in (DIT_FLOW_CONFIG, DIT_FLOW_FILE, DIT_HIFT_FILE) if not (model_dir / name).is_file()]
    if missing:
        raise FileNotFoundError(f"DiT token2wav directory {model_dir} lacks {', '.join(missing)}")


def hift_config(model_dir: Path) -> HiFTConfig:
    path = model_dir / DIT_HIFT_CONFIG
    if not path.is_file():
        return HiFTConfig()
    data = _load_tagged_yaml(path.read_text(), top="hift")["hift"]
    return HiFTConfig.from_dict(_without_tags(data))


def _without_tags(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _without_tags(v) for k, v in value.items() if k != "__class__"}
    return value


def load_dit_flow(model_dir: Path, device: torch.device | str = "cpu", dtype: str | torch.dtype = torch.float32,
                  solver: DiTSolverConfig | None = None) -> DiTFlow:
    config = DiTFlowConfig.from_flow_yaml(model_dir / DIT_FLOW_CONFIG, solver)
    with meta_without_init():
        flow = DiTFlow(config)  # the solver's noise buffer is still drawn on the CPU (it is not in the file)
    path = model_dir / DIT_FLOW_FILE
    load_into(flow, read_checkpoint(path), path)
    return flow.to(device=torch.device(device), dtype=resolve_dtype(dtype)).eval()


def load_dit_hift(model_dir: Path, device: torch.device | str = "cpu") -> HiFTGenerator:
    hift = HiFTGenerator(hift_config(model_dir))
    path = model_dir / DIT_HIFT_FILE
    load_into(hift, HiFTGenerator.read_state_dict(path), path)
    hift.fold_weight_norm()
    return hift.to(torch.device(device)).eval()


def load_dit_token2wav(model_dir: str | Path, device: torch.device | str = "cpu",
                       dtype: str | torch.dtype = torch.float32, solver: DiTSolverConfig | None = None,
                       streaming: DiTStreamingConfig = DiTStreamingConfig()) -> DiTToken2Wav:
    """Flow in `dtype` (fp32 / fp16 / bf16), HiFT in fp32, both on `device`."""
    model_dir = Path(model_dir)
    check_dit_dir(model_dir)
    return DiTToken2Wav(load_dit_flow(model_dir, device, dtype, solver), load_dit_hift(model_dir, device), streaming)
