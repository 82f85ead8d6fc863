"""Which torch device a model instance runs on: the GPU Triton gives it, or the device the render step wrote.

Kept free of `triton_python_backend_utils` so that the render tests can resolve every instance's device from the
same `args` the python backend passes to `initialize`.
"""

from __future__ import annotations

from typing import Mapping

#: `args["model_instance_kind"]` of an instance of a KIND_GPU instance group (python backend).
GPU_KIND = "GPU"


def instance_device(args: Mapping[str, str], rendered: str) -> str:
    """The device of one model instance.

    A KIND_GPU instance group makes Triton create `count` instances on each GPU it lists and hand each one its GPU
    as `model_instance_device_id`; the python backend does not narrow the stub's visible devices, so the adapter
    must place its tensors there itself (the disaggregated layout renders `device` "cuda" for such models). Any
    other instance runs on the rendered `device` ("cpu", "cuda:0").
    """
    if args.get("model_instance_kind") == GPU_KIND:
        if not rendered.startswith("cuda"):
            raise ValueError(f"a KIND_GPU instance was rendered for device {rendered!r}")
        return f"cuda:{int(args['model_instance_device_id'])}"
    if rendered == "cuda":
        raise ValueError('device "cuda" (the GPU of the instance) needs a KIND_GPU instance group')
    return rendered


def make_current(device: str) -> None:
    """Make `device` the stub's current CUDA device (nothing for the CPU).

    Each model instance is a stub process of its own, but CUDA starts every process on GPU 0: whatever the engine
    creates without naming a device (streams, events, CUDA graphs and their capture stream, index-less "cuda"
    tensors) would otherwise land on GPU 0 while the instance's weights sit on its own GPU."""
    if not device.startswith("cuda"):
        return
    import torch

    if torch.cuda.is_available():  # (a CPU build never gets here in production: the engine would fail first)
        torch.cuda.set_device(torch.device(device))
