"""Flow behaviour on a tiny random model: frame counts, lookahead, streaming re-runs, batching, config."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from cosyvoice2.flow import CausalFlow, CFMConfig, EncoderConfig, EstimatorConfig, FlowConfig
from cosyvoice2.flow.cfm import euler_schedule

LOOKAHEAD = 3
TINY = FlowConfig(
    encoder=EncoderConfig(width=16, attention_heads=2, linear_units=32, num_blocks=1, num_up_blocks=2),
    estimator=EstimatorConfig(channels=16, attention_head_dim=8, num_heads=2, n_blocks=1, num_mid_blocks=1),
    cfm=CFMConfig(noise_frames=400),
)


@pytest.fixture(scope="module")
def flow() -> CausalFlow:
    torch.manual_seed(7)
    model = CausalFlow(TINY).eval()
    with torch.no_grad():  # non-zero positional biases so the rel-pos terms take part
        for name, param in model.named_parameters():
            if "pos_bias" in name:
                param.normal_(0, 0.5)
    return model


def make_inputs(prompt_tokens: int, tokens: int, batch: int = 1, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "token": torch.randint(0, 6561, (batch, tokens), generator=g),
        "prompt_token": torch.randint(0, 6561, (batch, prompt_tokens), generator=g),
        "prompt_feat": torch.randn(batch, 2 * prompt_tokens, 80, generator=g),
        "embedding": torch.randn(batch, 192, generator=g),
    }


@pytest.mark.parametrize("streaming", [False, True])
@pytest.mark.parametrize("prompt_tokens", [0, 10])
def test_finalized_call_gives_two_frames_per_new_token(flow: CausalFlow, streaming: bool, prompt_tokens: int) -> None:
    mel = flow.inference(**make_inputs(prompt_tokens, 30), streaming=streaming, finalize=True)
    assert mel.shape == (1, 80, 60)


@pytest.mark.parametrize("streaming", [False, True])
def test_unfinalized_call_spends_lookahead_tokens_on_context(flow: CausalFlow, streaming: bool) -> None:
    inputs = make_inputs(10, 30)
    mel = flow.inference(**inputs, streaming=streaming, finalize=False)
    assert mel.shape == (1, 80, 2 * (30 - LOOKAHEAD))
    with torch.inference_mode():
        mu = flow.encode(inputs["token"], inputs["prompt_token"], streaming, finalize=False)
    assert mu.shape == (1, 80, 2 * (10 + 30 - LOOKAHEAD))


def test_lookahead_context_changes_the_last_frames(flow: CausalFlow) -> None:
    """The 3 context tokens feed the pre-lookahead conv: other context, other tail; the head stays put."""
    inputs = make_inputs(10, 25)  # context = tokens 32..34 of prompt + token
    other = dict(inputs, token=inputs["token"].clone())
    other["token"][:, -LOOKAHEAD:] = (other["token"][:, -LOOKAHEAD:] + 1000) % 6561
    with torch.inference_mode():
        a = flow.encode(inputs["token"], inputs["prompt_token"], True, finalize=False)
        b = flow.encode(other["token"], other["prompt_token"], True, finalize=False)
    assert (a[..., -2:] - b[..., -2:]).abs().max() > 1e-3
    # streaming chunk 0 (frames 0..49 = tokens 0..24) sees tokens 0..27 only (3 tokens of lookahead)
    assert torch.allclose(a[..., :50], b[..., :50], atol=1e-6)


def test_streaming_rerun_reproduces_earlier_chunks(flow: CausalFlow) -> None:
    """Re-running a longer prefix with chunk masks reproduces the frames already emitted
    (docs/reference/cosyvoice2.md#streaming-at-the-flow-level)."""
    prompt, first, hop = 10, 15, 25  # first chunk ends on the 25-token grid counted from the prompt start
    inputs = make_inputs(prompt, first + hop + LOOKAHEAD)
    short = dict(inputs, token=inputs["token"][:, : first + LOOKAHEAD])
    for streaming, reproduced in ((True, True), (False, False)):
        head = flow.inference(**short, streaming=streaming, finalize=False)
        longer = flow.inference(**inputs, streaming=streaming, finalize=False)
        assert head.shape[-1] == 2 * first and longer.shape[-1] == 2 * (first + hop)
        diff = (longer[..., : 2 * first] - head).abs().max().item()
        assert (diff < 1e-4) if reproduced else (diff > 1e-3)


def test_batch_of_two_equals_single_calls(flow: CausalFlow) -> None:
    inputs = make_inputs(10, 20, batch=2)
    batched = flow.inference(**inputs, streaming=True, finalize=False)
    for i in range(2):
        single = flow.inference(**{k: v[i : i + 1] for k, v in inputs.items()}, streaming=True, finalize=False)
        assert torch.allclose(batched[i : i + 1], single, atol=1e-5)
    assert (batched[0] - batched[1]).abs().max() > 1e-3


def test_too_long_call_is_rejected(flow: CausalFlow) -> None:
    with pytest.raises(ValueError, match="noise buffer"):
        flow.inference(**make_inputs(0, 201))


def test_injected_noise_is_used() -> None:
    noise = torch.zeros(1, 80, 100)
    flow = CausalFlow(TINY, noise=noise)
    assert flow.decoder.rand_noise.data_ptr() == noise.data_ptr()
    assert "decoder.rand_noise" not in flow.state_dict()


def test_euler_schedule_follows_cosine_grid() -> None:
    steps = euler_schedule(10)
    assert len(steps) == 10
    for k, (t, _) in enumerate(steps):
        assert t == pytest.approx(1 - math.cos(k / 10 * math.pi / 2), abs=1e-6)
    assert sum(dt for _, dt in steps) == pytest.approx(1.0, abs=1e-6)


def test_config_dict_round_trip() -> None:
    assert FlowConfig.from_dict(dataclasses.asdict(TINY)) == TINY
    assert FlowConfig.from_dict({}) == FlowConfig()


def test_harness_config_with_two_channel_levels_is_rejected() -> None:
    harness = {
        "input_size": 16, "output_size": 80, "spk_embed_dim": 192, "vocab_size": 6561,
        "pre_lookahead_len": 3, "token_mel_ratio": 2,
        "encoder": {"input_size": 16, "output_size": 16, "attention_heads": 2, "linear_units": 64,
                    "num_blocks": 1, "static_chunk_size": 25},
        "estimator": {"in_channels": 320, "out_channels": 80, "channels": [16, 16], "attention_head_dim": 16,
                      "num_heads": 2, "n_blocks": 1, "num_mid_blocks": 2, "static_chunk_size": 50},
        "decoder": {"cfm_params": {"inference_cfg_rate": 0.7}},
    }
    with pytest.raises(ValueError, match="single-level"):
        FlowConfig.from_harness(harness)
    harness["estimator"]["channels"] = [16]
    assert FlowConfig.from_harness(harness).estimator.channels == 16
