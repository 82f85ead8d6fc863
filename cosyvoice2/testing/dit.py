"""Random-weight DiT token2wav directories in the released layout, for tests and benchmarks.

`write_dit_model(dir)` writes flow.yaml, flow.pt and hift.pt (+ hift.yaml when HiFT is not the released size)
with the released key names. `micro_dit_config()` are the parity data's micro dimensions.
`write_full_size_random_dit(dir)` is `write_dit_model` at the released sizes (for GPU benchmarks; ~700 MB).
`write_full_size_layout(dir)` writes released-size files whose tensors are views of one small random row each
(stride 0 over all but the last axis): every key and shape of the real files in a few MB, for strict-load tests.
"""

from __future__ import annotations

from pathlib import Path

import torch

from cosyvoice2.dit.config import DiTEncoderConfig, DiTEstimatorConfig, DiTFlowConfig
from cosyvoice2.dit.flow import DiTFlow
from cosyvoice2.dit.layout import DIT_FLOW_CONFIG, DIT_FLOW_FILE, DIT_HIFT_CONFIG, DIT_HIFT_FILE
from cosyvoice2.hift import HiFTConfig, HiFTGenerator
from speech_lm.checkpoints import meta_without_init
from cosyvoice2.testing.models import _hift_overrides, randomize_


def micro_dit_config() -> DiTFlowConfig:
    """The parity data's micro model: encoder width 32 (3 + 2 layers), DiT width 48, depth 2, 3 heads x 16."""
    return DiTFlowConfig(input_size=32,
                         encoder=DiTEncoderConfig(width=32, attention_heads=2, linear_units=128, num_blocks=3,
                                                  num_up_blocks=2),
                         estimator=DiTEstimatorConfig(hidden_size=48, depth=2, num_heads=3, head_dim=16))


MICRO_HIFT = HiFTConfig(base_channels=16, f0_cond_channels=16)


def _hift_yaml(config: HiFTConfig) -> str:
    import json

    lines = ["# HiFTGenerator arguments (not a released file: the released runtime uses the defaults)", "hift:"]
    lines += [f"    {key}: {json.dumps(value)}" for key, value in config.to_dict().items()]
    return "\n".join(lines) + "\n"


def _write_configs(path: Path, flow: DiTFlowConfig, hift: HiFTConfig) -> None:
    path.mkdir(parents=True, exist_ok=True)
    (path / DIT_FLOW_CONFIG).write_text(flow.to_flow_yaml())
    if hift != HiFTConfig():
        (path / DIT_HIFT_CONFIG).write_text(_hift_yaml(hift))


def write_dit_model(path: str | Path, flow: DiTFlowConfig | None = None, hift: HiFTConfig = MICRO_HIFT,
                    seed: int = 0) -> Path:
    """Seeded random weights (flow fp32 and HiFT with weight norm unfolded, as released); returns the directory."""
    path = Path(path)
    flow = flow or micro_dit_config()
    _write_configs(path, flow, hift)
    torch.save(randomize_(DiTFlow(flow), seed).state_dict(), path / DIT_FLOW_FILE)
    hift_module = randomize_(HiFTGenerator(hift), seed + 1, _hift_overrides(hift))
    torch.save(hift_module.state_dict(), path / DIT_HIFT_FILE)
    return path


def write_full_size_random_dit(path: str | Path, seed: int = 0) -> Path:
    """Released-size random DiT token2wav (flow fp32, HiFT without hift.yaml, as released; ~700 MB, seconds on a
    CPU); returns the directory."""
    return write_dit_model(path, DiTFlowConfig(), HiFTConfig(), seed)


def _cheap_state(module: torch.nn.Module, seed: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    state = {}
    for name, tensor in module.state_dict().items():
        row = torch.randn(tensor.shape[-1], generator=generator) * 0.02
        state[name] = row.expand(tensor.shape)  # saved as the row's storage plus the view's strides
    return state


def write_full_size_layout(path: str | Path, seed: int = 0) -> Path:
    """Released sizes, every key and shape, a few MB on disk (see the module docstring)."""
    path = Path(path)
    _write_configs(path, DiTFlowConfig(), HiFTConfig())
    with meta_without_init():
        flow = DiTFlow(DiTFlowConfig())
        hift = HiFTGenerator(HiFTConfig())
    torch.save(_cheap_state(flow, seed), path / DIT_FLOW_FILE)
    torch.save(_cheap_state(hift, seed + 1), path / DIT_HIFT_FILE)
    return path
