"""Flow parity against the upstream reference outputs on the micro model (parity/README.md)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from cosyvoice2.flow import CausalFlow, FlowConfig
from tests.conftest import FIXTURES_DIR

PARITY_DIR = FIXTURES_DIR / "parity"
pytestmark = [
    pytest.mark.parity,
    pytest.mark.skipif(not (PARITY_DIR / "micro" / "flow.pt").exists(), reason="parity data absent"),
]

MU_TOL = 5e-6
MEL_TOL = 5e-5
# (dump suffix, token array, streaming, finalize) as the reference was called
CALLS = {
    "offline": ("in_flow_token", False, True),
    "stream0": ("in_flow_stream_token", True, False),
}


@pytest.fixture(scope="module")
def dump() -> dict[str, torch.Tensor]:
    with np.load(PARITY_DIR / "micro_dump_seed1234.npz") as arrays:
        return {k: torch.from_numpy(arrays[k]) for k in arrays.files if k.startswith(("flow_", "in_"))}


@pytest.fixture(scope="module")
def model() -> CausalFlow:
    harness = json.loads((PARITY_DIR / "micro" / "harness_config.json").read_text())
    flow = CausalFlow(FlowConfig.from_harness(harness["flow"])).eval()
    flow.load_state_dict(torch.load(PARITY_DIR / "micro" / "flow.pt", weights_only=True), strict=True)
    return flow


def run(model: CausalFlow, dump: dict[str, torch.Tensor], call: str, streaming: bool) -> tuple[torch.Tensor, torch.Tensor]:
    token_key, _, finalize = CALLS[call]
    token = dump[token_key].long()
    prompt_token = dump["in_prompt_speech_token"].long()
    with torch.inference_mode():
        mu = model.encode(token, prompt_token, streaming, finalize).transpose(1, 2)
    mel = model.inference(token, prompt_token, dump["in_prompt_feat"], dump["in_xvector"], streaming, finalize)
    return mu, mel


def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    assert a.shape == b.shape
    return (a - b).abs().max().item()


def test_noise_head_matches_reference(model: CausalFlow, dump: dict[str, torch.Tensor]) -> None:
    head = dump["flow_rand_noise_head"]
    assert torch.equal(model.decoder.rand_noise[:, :, : head.size(-1)], head)


@pytest.mark.parametrize("call", sorted(CALLS))
def test_mu_and_mel_match_reference(model: CausalFlow, dump: dict[str, torch.Tensor], call: str) -> None:
    _, streaming, _ = CALLS[call]
    mu, mel = run(model, dump, call, streaming)
    assert mel.dtype == torch.float32
    assert max_diff(mu, dump[f"flow_mu_{call}"]) <= MU_TOL
    assert max_diff(mel, dump[f"flow_mel_{call}"]) <= MEL_TOL


def test_streaming_masks_change_the_first_chunk(model: CausalFlow, dump: dict[str, torch.Tensor]) -> None:
    """Guards the mask wiring: full attention on the streaming call must not reproduce the chunked reference."""
    mu, mel = run(model, dump, "stream0", streaming=False)
    assert max_diff(mu, dump["flow_mu_stream0"]) > MU_TOL
    assert max_diff(mel, dump["flow_mel_stream0"]) > 100 * MEL_TOL
