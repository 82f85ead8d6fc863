"""Strict checkpoint loading shared by every engine: a module's state dict and a checkpoint must hold the same keys
with the same shapes, and one error lists every difference (the file, the missing, unexpected and mis-shaped
keys). Modules are built on the meta device without their random init and then take the checkpoint's tensors
directly (no second copy of the weights, no wasted initialisation).
"""

from __future__ import annotations

from contextlib import contextmanager
from pathlib import Path
from typing import Iterator, Mapping

import torch
from torch import nn

_MAX_LISTED = 10
_INIT_FUNCTIONS = ("normal_", "uniform_", "kaiming_uniform_", "kaiming_normal_", "xavier_uniform_",
                   "xavier_normal_", "trunc_normal_", "ones_", "zeros_", "constant_")


class CheckpointMismatchError(ValueError):
    """A checkpoint's keys or shapes do not match the module built from the engine config."""


def check_state_dict(expected: Mapping[str, torch.Tensor], found: Mapping[str, torch.Tensor], path: Path) -> None:
    """Compare a module's state dict with a checkpoint's; raise one error listing every difference."""
    missing = [k for k in expected if k not in found]
    unexpected = [k for k in found if k not in expected]
    wrong_shape = [f"{k}: file {tuple(found[k].shape)}, model {tuple(expected[k].shape)}"
                   for k in expected if k in found and found[k].shape != expected[k].shape]
    problems = []
    for label, items in (("missing keys", missing), ("unexpected keys", unexpected), ("wrong shapes", wrong_shape)):
        if items:
            more = f" ... (+{len(items) - _MAX_LISTED} more)" if len(items) > _MAX_LISTED else ""
            problems.append(f"{label} ({len(items)}): {', '.join(items[:_MAX_LISTED])}{more}")
    if problems:
        raise CheckpointMismatchError(f"{path}: checkpoint does not match the model config; " + "; ".join(problems))


def read_checkpoint(path: Path) -> dict[str, torch.Tensor]:
    """A ``torch.save``d state dict, memory-mapped on the CPU (tensors only, no pickled code)."""
    return torch.load(path, map_location="cpu", weights_only=True, mmap=True)


def load_into(module: nn.Module, state: Mapping[str, torch.Tensor], path: Path) -> None:
    """Strict load that assigns the checkpoint tensors (the module may live on the meta device)."""
    check_state_dict(module.state_dict(), state, path)
    module.load_state_dict(state, strict=True, assign=True)


@contextmanager
def meta_without_init() -> Iterator[None]:
    """Build modules on the meta device without running their random init (the checkpoint replaces every
    parameter anyway). Skipping it also avoids `normal_` on meta tensors, which imports torch._dynamo and fails
    wherever a stray `triton` package shadows the real one (our tests/triton under pytest)."""
    saved = {name: getattr(nn.init, name) for name in _INIT_FUNCTIONS}
    for name in _INIT_FUNCTIONS:
        setattr(nn.init, name, lambda tensor, *args, **kwargs: tensor)
    try:
        with torch.device("meta"):
            yield
    finally:
        for name, function in saved.items():
            setattr(nn.init, name, function)
