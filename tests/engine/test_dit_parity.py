"""DiT token2wav parity with the reference outputs on the micro model (shared parity_dit data, fp32, CPU).

Tolerances from the data's own noise floor: mu 1e-5, mel 5e-5, caches 2e-5 / 2e-4, f0 2e-3 Hz, source 1e-3,
audio 5e-3. Staged as recommended: the flow against the mel tolerance, HiFT fed the recorded mel against the
audio tolerance, then end to end.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from cosyvoice2.dit.config import DiTSolverConfig
from cosyvoice2.dit.flow import FlowState
from cosyvoice2.dit.loading import load_dit_token2wav
from cosyvoice2.dit.token2wav import Chunk, DiTToken2Wav
from cosyvoice2.hift import SourceNoise
from tests.conftest import FIXTURES_DIR

PARITY_DIR = FIXTURES_DIR / "parity_dit"
MICRO_DIR = PARITY_DIR / "micro"
pytestmark = [
    pytest.mark.parity,
    pytest.mark.skipif(not (MICRO_DIR / "flow.pt").exists(), reason="DiT parity data absent"),
]

MU, MEL, AUDIO, F0, SOURCE = 1e-5, 5e-5, 5e-3, 2e-3, 1e-3


@pytest.fixture(scope="module")
def dump() -> dict[str, torch.Tensor]:
    with np.load(PARITY_DIR / "micro_dump_seed1234.npz") as arrays:
        return {k: torch.from_numpy(arrays[k]) for k in arrays.files if not k.startswith("meta")}


@pytest.fixture(scope="module")
def engine(dump: dict[str, torch.Tensor]) -> DiTToken2Wav:
    # the reference's streaming noise buffer is torch.randn(1, 80, 30000) after seeding with in_rand_noise_seed
    return load_dit_token2wav(MICRO_DIR, solver=DiTSolverConfig(noise_seed=int(dump["in_rand_noise_seed"])))


def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    assert a.shape == b.shape, (a.shape, b.shape)
    return (a.float() - b.float()).abs().max().item()


def chunks(dump: dict[str, torch.Tensor]) -> list[tuple[int, int, bool]]:
    return [(s, e, bool(last)) for s, e, last in dump["in_stream_chunks"].tolist()]


def recorded_noise(dump: dict[str, torch.Tensor], call: int, frames: int) -> SourceNoise:
    """HiFT call `call` (0 offline, 1.. the chunks): its stored initial phase and, regenerated bit-exactly from
    its seed, the sine noise the shared copy leaves out."""
    seed = int(dump["in_hift_seeds"][call])
    drawn = SourceNoise.draw(1, frames * 480, 9, torch.Generator().manual_seed(seed))
    name = "offline" if call == 0 else f"stream{call - 1}"
    assert torch.equal(drawn.initial_phase, dump[f"{name}_hift_noise_rand_ini"])
    return drawn


def test_noise_buffer_matches_reference(engine: DiTToken2Wav, dump: dict[str, torch.Tensor]) -> None:
    head = dump["flow_rand_noise_head"]
    assert torch.equal(engine.flow.decoder.rand_noise[:, :, : head.shape[2]], head)


def test_offline_flow(engine: DiTToken2Wav, dump: dict[str, torch.Tensor]) -> None:
    tokens = torch.cat([dump["in_prompt_speech_token"], dump["in_speech_token"]], dim=1).long()
    lengths = torch.tensor([tokens.shape[1]])
    flow = engine.flow
    with torch.inference_mode():
        mu = flow.encoder_proj(flow.encoder(flow.input_embedding(tokens), lengths))
    assert max_diff(mu, dump["offline_mu"]) < MU
    mel = flow.inference(tokens, lengths, [dump["in_prompt_feat"][0]], dump["in_xvector"], dump["offline_noise"])
    assert max_diff(mel, dump["offline_mel"]) < MEL


def test_offline_hift_given_reference_mel(engine: DiTToken2Wav, dump: dict[str, torch.Tensor]) -> None:
    mel = dump["offline_mel"][:, :, dump["prefill_mel"].shape[2] :]  # the prompt's frames come first
    audio, source = engine.hift.inference(mel, None, noise=recorded_noise(dump, 0, mel.shape[2]))
    with torch.inference_mode():
        f0 = engine.hift.predict_f0(mel)
    assert max_diff(f0, dump["offline_hift_f0"]) < F0
    assert max_diff(source, dump["offline_hift_source"]) < SOURCE
    assert max_diff(audio, dump["offline_audio"]) < AUDIO


def test_offline_end_to_end(engine: DiTToken2Wav, dump: dict[str, torch.Tensor]) -> None:
    generator = torch.Generator().manual_seed(int(dump["in_hift_seeds"][0]))
    audio = engine.offline(dump["in_speech_token"][0].tolist(), dump["in_prompt_speech_token"][0],
                           dump["in_prompt_feat"], dump["in_xvector"], generator, flow_noise=dump["offline_noise"])
    assert audio.shape == (960 * dump["in_speech_token"].shape[1],)
    assert max_diff(torch.from_numpy(audio)[None], dump["offline_audio"]) < AUDIO


def test_prefill_caches(engine: DiTToken2Wav, dump: dict[str, torch.Tensor]) -> None:
    prompt = engine.prompt_cache(dump["in_prompt_speech_token"][0], dump["in_prompt_feat"], dump["in_xvector"])
    assert prompt.prompt_frames == dump["prefill_mel"].shape[2]
    assert max_diff(prompt.prompt_mu, dump["prefill_mu"]) < MU
    assert max_diff(prompt.prompt_mel, dump["prefill_mel"]) < MEL
    # the reference packs conv2's 2-frame context, then the up conv's 4 frames, along time
    cnn = torch.cat([prompt.encoder.lookahead, prompt.encoder.upsample], dim=2)
    assert max_diff(cnn, dump["prefill_conformer_cnn_cache"]) < 2e-5
    # the reference stores the token-rate layers' K/V twice along time ([c || c]) to share one tensor
    att = dump["prefill_conformer_att_cache"]
    lower = prompt.encoder.lower
    assert max_diff(lower, att[: lower.shape[0], :, :, : lower.shape[3]]) < 2e-5
    assert max_diff(prompt.encoder.upper, att[lower.shape[0]:]) < 2e-5
    assert max_diff(prompt.estimator.conv, dump["prefill_estimator_cnn_cache"]) < 2e-4
    assert max_diff(prompt.estimator.kv, dump["prefill_estimator_att_cache"]) < 2e-4


def test_streaming_flow_every_chunk(engine: DiTToken2Wav, dump: dict[str, torch.Tensor]) -> None:
    prompt = engine.prompt_cache(dump["in_prompt_speech_token"][0], dump["in_prompt_feat"], dump["in_xvector"])
    state = FlowState.start(prompt)
    lengths_before_trim = dump["stream_estimator_att_len_before_trim"].tolist()
    held = dump["stream_shape_estimator_att_cache"][:, 4].tolist()
    offsets = dump["stream_noise_offsets"].tolist()
    for k, (start, end, last) in enumerate(chunks(dump)):
        assert state.estimator.frames == offsets[k + 1]
        mu, mel, state = engine.flow.chunk(dump["in_speech_token"][:, start:end].long(), state, last)
        assert max_diff(mu, dump[f"stream{k}_mu"]) < MU
        assert max_diff(mel, dump[f"stream{k}_mel"]) < MEL
        assert offsets[k + 1] + mel.shape[2] == lengths_before_trim[k + 1]
        assert state.estimator.frames == held[k + 1]
        assert state.encoder.upper.shape[3] == dump["stream_shape_conformer_att_cache"][k + 1, 3]


def test_streaming_end_to_end(engine: DiTToken2Wav, dump: dict[str, torch.Tensor]) -> None:
    """The stream object over the reference's chunk boundaries: every chunk's audio within tolerance."""
    prompt = engine.prompt_cache(dump["in_prompt_speech_token"][0], dump["in_prompt_feat"], dump["in_xvector"])
    stream = engine.open_stream(prompt, torch.Generator())
    stream.extend(dump["in_speech_token"][0].tolist())
    pieces = []
    for k, (start, end, last) in enumerate(chunks(dump)):
        chunk = stream.next_chunk(finished=True)
        assert chunk == Chunk(start, end if last else end - 3, end, last)
        stream.generator.manual_seed(int(dump["in_hift_seeds"][k + 1]))  # the reference seeds every HiFT call
        (audio,) = engine.run_chunks([(stream, chunk)])
        assert max_diff(torch.from_numpy(audio)[None], dump[f"stream{k}_audio"]) < AUDIO
        pieces.append(audio)
    assert stream.finished and stream.next_chunk(finished=True) is None
    assert max_diff(torch.from_numpy(np.concatenate(pieces))[None], dump["stream_audio"]) < AUDIO


def test_streaming_hift_given_reference_mel(engine: DiTToken2Wav, dump: dict[str, torch.Tensor]) -> None:
    """HiFT alone per chunk, fed the recorded mel, cached source and speech tail."""
    window = np.hamming(7680)
    for k in range(4):
        mel_in = dump[f"stream{k}_hift_mel_in"]
        cache = None if k == 0 else dump[f"stream{k - 1}_hift_source"][:, :, -3840:]
        speech, source = engine.hift.inference(mel_in, cache, noise=recorded_noise(dump, k + 1, mel_in.shape[2]))
        assert max_diff(source, dump[f"stream{k}_hift_source"]) < SOURCE
        assert max_diff(speech, dump[f"stream{k}_hift_speech"]) < AUDIO
        if k > 0:
            tail = dump[f"stream{k - 1}_hift_speech"][0, -3840:].double().numpy()
            head = speech[0, :3840].double().numpy() * window[:3840] + tail * window[3840:]
            assert np.abs(head.astype(np.float32) - dump[f"stream{k}_audio"][0, :3840].numpy()).max() < AUDIO


@pytest.mark.parametrize(("dtype", "max_tol", "mean_tol"), [("fp16", 0.5, 0.08), ("bf16", 2.0, 0.3)])
def test_half_precision_offline_mel_stays_near_fp32(dump: dict[str, torch.Tensor], dtype: str, max_tol: float,
                                                    mean_tol: float) -> None:
    """The flow in fp16/bf16 (HiFT stays fp32): rounding only, no dtype mix-up (mel spans about +-7, std 1.7)."""
    from cosyvoice2.dit.loading import load_dit_flow

    flow = load_dit_flow(MICRO_DIR, dtype=dtype)
    tokens = torch.cat([dump["in_prompt_speech_token"], dump["in_speech_token"]], dim=1).long()
    mel = flow.inference(tokens, torch.tensor([tokens.shape[1]]), [dump["in_prompt_feat"][0]], dump["in_xvector"],
                         dump["offline_noise"])
    assert mel.dtype == flow.input_embedding.weight.dtype
    difference = (mel.float() - dump["offline_mel"]).abs()
    assert difference.max() < max_tol and difference.mean() < mean_tol
