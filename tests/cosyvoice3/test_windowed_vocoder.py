"""The causal HiFT's windowed streaming (`CausalHiFT.stream_chunks`): a chunk vocodes only a window of its stream's
mel (its new frames plus the context the causal layers read) and continues the harmonic phase from a per-stream
state, yet emits the samples of the reference (the whole accumulated mel vocoded again, `reference_chunk`), chunk
by chunk; several streams' windows in one batch equal each alone; the context bound is the network's real left
reach (a NaN placed before it reaches no output sample after it). CPU, fp32, tiny random weights."""

from __future__ import annotations

import math

import pytest
import torch

from cosyvoice3.config import CausalHiFTConfig
from cosyvoice3.hift import CausalHiFT, VocoderState

# The two paths differ in float summation order only (conv lengths, the batch): measured at most 1.2e-7 on audio of
# scale 0.14; a window one frame too short, or a phase not continued, moves samples by orders of magnitude more.
AUDIO_ATOL = 2e-6


def tiny_hift(voiced: bool) -> CausalHiFT:
    torch.manual_seed(3)
    hift = CausalHiFT(CausalHiFTConfig(base_channels=16, f0_cond_channels=16))
    hift.fold_weight_norm()
    if voiced:  # random weights give f0 near 0 (unvoiced: noise only); a large bias makes the harmonics sound
        with torch.no_grad():
            hift.f0_predictor.classifier.bias.fill_(180.0)
    return hift.eval()


def mels(sizes: list[int], seed: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(1, 80, n, generator=generator) - 5 for n in sizes]


SCHEDULES = {
    "served": [30, 50, 100, 200, 400, 170],  # the runtime's hops (15, 25, 50 ... tokens, 2 frames each)
    "short_first": [4, 6, 50, 50, 50, 50, 13],  # a first chunk with nothing to vocode yet, then equal hops
    "one_final": [90],
    "long_tail": [30, 50, 100, 2],
}


@pytest.mark.parametrize("voiced", [True, False], ids=["voiced", "unvoiced"])
@pytest.mark.parametrize("name", sorted(SCHEDULES))
def test_windowed_chunks_equal_the_whole_mel_reference(name: str, voiced: bool) -> None:
    hift = tiny_hift(voiced)
    reference, windowed = hift.stream_start(), hift.stream_start()
    sizes = SCHEDULES[name]
    kept = []
    for k, mel in enumerate(mels(sizes, seed=len(name))):
        final = k == len(sizes) - 1
        theirs, reference = hift.reference_chunk(reference, mel, final)
        ours, windowed = hift.stream_chunks([(windowed, mel, final)])[0]
        assert ours.shape == theirs.shape, k
        torch.testing.assert_close(ours, theirs, rtol=0, atol=AUDIO_ATOL, msg=f"chunk {k}")
        assert windowed.sent == reference.sent and windowed.frames == reference.frames
        kept.append(windowed.mel.shape[2])
    assert reference.sent == hift.config.samples_per_frame * sum(sizes)
    # a stream keeps a bounded tail of its mel, not all of it (the window's context, the frames held back)
    bound = hift.decoder_context() + hift.f0_context + hift.config.held_back_frames
    assert max(kept[:-1], default=0) <= bound and kept[-1] == 0


def test_windows_batched_equal_each_alone() -> None:
    """Streams at different points (two first chunks of one length, which run together unpadded, a second chunk
    still vocoded from frame 0, windows of different lengths; final and not) in one call: each row's samples and
    state are those of the row alone."""
    hift = tiny_hift(voiced=True)
    histories = {"fresh": [], "also fresh": [], "one": [30], "two": [30, 50], "long": [30, 50, 100, 200]}
    states = {}
    for name, sizes in histories.items():
        state = hift.stream_start()
        for mel in mels(sizes, seed=7 + len(name)):
            state = hift.stream_chunks([(state, mel, False)])[0][1]
        states[name] = state
    for final in (False, True):
        rows = [(states[name], mel, final) for name, mel in zip(histories, mels([30, 30, 100, 50, 400], seed=11))]
        together = hift.stream_chunks(rows)
        for (name, row), (audio, state) in zip(zip(histories, rows), together):
            alone, alone_state = hift.stream_chunks([row])[0]
            torch.testing.assert_close(audio, alone, rtol=0, atol=AUDIO_ATOL, msg=f"{name} final={final}")
            assert (state.sent, state.frames, state.phase_frame) == (alone_state.sent, alone_state.frames,
                                                                    alone_state.phase_frame)
            if state.phase is not None:
                torch.testing.assert_close(state.phase, alone_state.phase, rtol=0, atol=1e-9)


def _first_clean_sample(audio: torch.Tensor) -> int:
    nan = torch.isnan(audio[0]).nonzero()
    return int(nan.max()) + 1 if nan.numel() else 0


@pytest.mark.parametrize("finalize", [True, False])
@pytest.mark.parametrize("path", ["mel", "source"])
def test_the_context_bound_is_the_networks_left_reach(finalize: bool, path: str) -> None:
    """NaN in every mel frame (or source sample) before frame t: the first output sample it does not reach lies
    `decoder_context` frames after t at most, and beyond `decoder_context - 1` frames for one of the two paths (the
    bound is tight). NaN spreads through a conv whatever its weights, so this is the structure's reach."""
    hift = tiny_hift(voiced=False)
    spf, frames, t = hift.config.samples_per_frame, 120, 60
    reach = {}
    for which in ("mel", "source"):
        mel, source = torch.randn(1, 80, frames), torch.rand(1, 1, spf * frames) * 0.1
        if which == "mel":
            mel[:, :, :t] = math.nan
        else:
            source[:, :, :spf * t] = math.nan
        with torch.inference_mode():
            audio = hift.decode_causal(mel, source, finalize)
        reach[which] = _first_clean_sample(audio) / spf - t
    context = hift.decoder_context()
    assert max(reach.values()) <= context, reach
    assert max(reach.values()) > context - 1, reach
    assert reach[path] > 0


def test_the_f0_context_is_the_predictors_left_reach() -> None:
    hift = tiny_hift(voiced=False)
    mel, t = torch.randn(1, 80, 60), 30
    mel[:, :, :t] = math.nan
    with torch.inference_mode():
        f0 = hift.predict_f0(mel, finalize=True)
    assert int(torch.isnan(f0[0]).nonzero().max()) + 1 - t == hift.f0_context


def test_a_state_that_does_not_match_the_window_is_refused() -> None:
    hift = tiny_hift(voiced=True)
    state = hift.stream_start()
    for mel in mels([30, 50, 100], seed=3):
        state = hift.stream_chunks([(state, mel, False)])[0][1]
    assert state.phase is not None
    shifted = VocoderState(state.mel, state.frames, state.sent, state.phase, state.phase_frame + 1)
    with pytest.raises(RuntimeError, match="phase"):
        hift.stream_chunks([(shifted, mels([50], seed=4)[0], False)])
