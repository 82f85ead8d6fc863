"""The real pipeline (tiny random model, PyTorch LLM, CPU) in one tritonserver shared by the module's tests."""

from __future__ import annotations

import re
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as grpcclient

from triton_repo import contract
from triton_repo.render import RenderOptions, write_repository
from triton_repo.server import TritonServer

FIRST_HOP = 5


@dataclass
class Pipeline:
    server: TritonServer
    repo: Path

    def metrics(self) -> dict[tuple[str, str], float]:
        """(stat, model) -> value of every `cosyvoice2_*` metric."""
        text = urllib.request.urlopen(f"http://127.0.0.1:{self.server.metrics_port}/metrics").read().decode()
        out = {}
        for name, model, value in re.findall(r'^cosyvoice2_(\w+)\{model="(\w+)"\} (\S+)$', text, re.M):
            out[(name, model)] = float(value)
        return out


def synthesis_inputs(text: str, voice: str = "voice-a", seed: int | None = 1, seconds: float = 1.0) -> list:
    wav = (np.random.default_rng(len(voice)).standard_normal(int(16000 * seconds)) * 0.1).astype(np.float32)
    values = {
        contract.REFERENCE_WAV.name: wav,
        contract.REFERENCE_WAV_LEN.name: np.array([wav.size], np.int32),
        contract.REFERENCE_TEXT.name: np.array([b"a reference"], object),
        contract.TARGET_TEXT.name: np.array([text.encode()], object),
        contract.VOICE_ID.name: np.array([voice.encode()], object),
    }
    if seed is not None:
        values[contract.SEED.name] = np.array([seed], np.uint64)
    inputs = []
    for spec in contract.INPUTS:
        if spec.name in values:
            tensor = grpcclient.InferInput(spec.name, list(values[spec.name].shape), spec.triton_dtype)
            tensor.set_data_from_numpy(values[spec.name])
            inputs.append(tensor)
    return inputs


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    from cosyvoice2.testing import write_tiny_model

    return write_tiny_model(tmp_path_factory.mktemp("tiny_model"))


@pytest.fixture(scope="session")
def pipeline(tiny_model_dir, tmp_path_factory, triton_server_factory) -> Pipeline:
    repo = write_repository(
        RenderOptions(
            model_dir=tiny_model_dir,
            out=tmp_path_factory.mktemp("pipeline") / "repo",
            max_batch=8,
            max_seq_len=2048,
            first_hop=FIRST_HOP,
        )
    )
    return Pipeline(server=triton_server_factory(repo, ready_timeout=240), repo=repo)
