"""The gateway, the orchestrator and every configuration module import without torch or transformers.

These run in processes that never execute a model (the gateway container has no torch at all; the orchestrator
reads its configuration and routes requests), so a stray module-level ``import torch`` costs seconds of start-up
and gigabytes of memory, or breaks the gateway image outright. Each import runs in a fresh interpreter, because
this test process has long since imported torch.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]
HEAVY = ("torch", "transformers")

# The Triton Python backend's module exists only inside tritonserver; a stand-in lets the orchestrator's Triton
# model import here (the attributes it reads at import time are never called).
_PROBE = """
import json, sys
from unittest import mock
sys.modules["triton_python_backend_utils"] = mock.MagicMock()
import importlib
importlib.import_module(sys.argv[1])
print(json.dumps(sorted(name for name in {heavy!r} if name in sys.modules)))
""".format(heavy=HEAVY)

TORCH_FREE = [
    "gateway.app",
    "gateway.__main__",
    "cosyvoice2.config",
    "cosyvoice2.llm.config",
    "cosyvoice2.flow.config",
    "cosyvoice2.hift.config",
    "cosyvoice2.dit.config",
    "spark_tts.config",
    "speech_lm.config",
    "speech_lm.testing",
    "speech_serving.orchestrator",
    "triton_repo.adapters.orchestrator",
    "cosyvoice3.config",
    "cosyvoice3.prompts",
    "speech_serving.cosyvoice3",
    "triton_repo.adapters.cosyvoice3",
]


def heavy_modules_loaded_by(module: str) -> list[str]:
    result = subprocess.run([sys.executable, "-c", _PROBE, module], cwd=REPO_ROOT, capture_output=True,
                            text=True, timeout=120, check=False)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("module", TORCH_FREE)
def test_module_imports_without_torch(module: str) -> None:
    assert heavy_modules_loaded_by(module) == []


def test_the_probe_sees_torch_when_a_module_loads_it() -> None:
    # The model modules do import torch: the probe must report it, or the checks above prove nothing.
    assert heavy_modules_loaded_by("cosyvoice2.llm.model") == ["torch"]
    assert "transformers" in heavy_modules_loaded_by("transformers")
