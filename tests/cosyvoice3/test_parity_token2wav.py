"""Flow and HiFT parity (parity_cv3), offline and streaming on the served runtime's schedule; the cached flow
path against the recompute path. Chunk boundaries, lengths and the schedule are read from the dump."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from cosyvoice3.errors import CosyVoice3InputError
from cosyvoice3.token2wav import CosyVoice3Token2Wav, VoicePrompt
from tests.cosyvoice3.conftest import max_abs, needs_parity_data

pytestmark = [pytest.mark.parity, needs_parity_data]
MEL_TOL = 1e-4  # measured about 1.5e-6
F0_TOL = 5e-3  # Hz; measured 0 (the predictor runs in float64 like the reference)
SOURCE_TOL = 2e-3  # measured 0
AUDIO_TOL = 5e-3  # measured: 1.3e-6 from the reference mel, about 1e-4 end to end


def schedule_rows(dump) -> list[dict[str, int]]:
    names = ("chunk", "tokens_end", "token_offset", "finalize", "mel_frames", "vocoder_in", "vocoder_out", "emitted")
    return [dict(zip(names, (int(v) for v in row))) for row in dump["stream_schedule"]]


def test_noise_table_head(micro_token2wav: CosyVoice3Token2Wav, dump) -> None:
    head = dump["flow_rand_noise_head"]
    assert max_abs(micro_token2wav.flow.decoder.rand_noise[:, :, : head.shape[2]], head) == 0.0
    noise = micro_token2wav.hift.noise_tables.noise(8, torch.device("cpu"))
    assert max_abs(noise.initial_phase, dump["hift_noise_rand_ini"]) == 0.0


@torch.inference_mode()
def test_offline_flow(micro_token2wav: CosyVoice3Token2Wav, voice: VoicePrompt, dump) -> None:
    flow, tokens = micro_token2wav.flow, dump["in_speech_token"][0].tolist()
    h = flow.token_features(torch.cat([voice.tokens, torch.as_tensor(tokens)]), finalize=True)
    assert max_abs(h, dump["offline_h"]) <= MEL_TOL
    assert max_abs(micro_token2wav.mel(tokens, voice), dump["offline_mel"]) <= MEL_TOL


@torch.inference_mode()
def test_offline_hift_from_the_reference_mel(micro_token2wav: CosyVoice3Token2Wav, dump) -> None:
    hift, mel = micro_token2wav.hift, torch.from_numpy(dump["offline_mel"])
    assert max_abs(hift.predict_f0(mel), dump["offline_hift_f0"]) <= F0_TOL
    audio, source = hift.inference(mel, finalize=True)
    assert max_abs(source, dump["offline_hift_source"]) <= SOURCE_TOL
    assert max_abs(audio, dump["offline_audio"]) <= AUDIO_TOL


def test_offline_end_to_end(micro_token2wav: CosyVoice3Token2Wav, voice: VoicePrompt, dump) -> None:
    audio = micro_token2wav.offline(dump["in_speech_token"][0].tolist(), voice)
    assert max_abs(audio, dump["offline_audio"][0]) <= AUDIO_TOL


def test_schedule_is_the_runtimes(micro_token2wav: CosyVoice3Token2Wav, dump) -> None:
    chunks = micro_token2wav.schedule.chunks(dump["in_speech_token"].shape[1])
    assert [(c.feed, c.start, int(c.final)) for c in chunks] == [
        (r["tokens_end"], r["token_offset"], r["finalize"]) for r in schedule_rows(dump)]


@pytest.mark.parametrize("cached", [False, True], ids=["recompute", "cached"])
def test_streaming_chunks(micro_token2wav: CosyVoice3Token2Wav, voice: VoicePrompt, dump, cached: bool) -> None:
    """Each chunk's mel and emitted audio equal the reference's; the vocoder's f0 over the accumulated mel too."""
    stream = micro_token2wav.open_stream(voice, cached=cached)
    stream.extend(dump["in_speech_token"][0].tolist())
    rows = schedule_rows(dump)
    mels = []
    for row in rows:
        chunk = stream.next_chunk(finished=True)
        assert chunk is not None and chunk.final == bool(row["finalize"])
        audio = stream.run(chunk)
        k = row["chunk"]
        mel = stream.last_mel  # this chunk's own frames
        mels.append(mel)
        assert mel.shape[2] == row["mel_frames"]
        assert max_abs(mel, dump[f"stream{k}_mel"]) <= MEL_TOL, k
        assert audio.shape[0] == row["emitted"]
        assert max_abs(audio, dump[f"stream{k}_audio"][0]) <= AUDIO_TOL, k
        accumulated = torch.cat(mels, dim=2)
        assert accumulated.shape[2] == row["vocoder_in"]
        f0 = micro_token2wav.hift.predict_f0(accumulated, finalize=bool(row["finalize"]))
        assert max_abs(f0, dump[f"stream{k}_hift_f0"]) <= F0_TOL, k
    assert stream.next_chunk(finished=True) is None and stream.finished


def test_streams_emit_960_samples_per_token(micro_token2wav: CosyVoice3Token2Wav, voice: VoicePrompt, dump) -> None:
    """Tokens pushed one at a time, other lengths than the dump's: the same total as offline, and the cached
    path emits what the recompute path emits."""
    tokens = dump["in_speech_token"][0].tolist()
    for n in (1, len(tokens) // 5, len(tokens) * 4 // 5):
        pieces = {}
        for cached in (False, True):
            stream = micro_token2wav.open_stream(voice, cached=cached)
            out = [piece for t in tokens[:n] for piece in stream.push([t])]
            out.append(stream.finish())
            pieces[cached] = np.concatenate(out)
        assert pieces[False].shape == (n * micro_token2wav.samples_per_token,)
        assert max_abs(pieces[True], pieces[False]) <= 1e-4


def test_cached_path_keeps_only_complete_chunks(micro_token2wav: CosyVoice3Token2Wav, voice: VoicePrompt,
                                                dump) -> None:
    stream = micro_token2wav.open_stream(voice, cached=True)
    stream.extend(dump["in_speech_token"][0].tolist())
    chunk_frames = micro_token2wav.flow.config.dit.static_chunk_size
    ratio = micro_token2wav.flow.config.token_mel_ratio
    # the voice's own cache: complete chunks of the frames that depend on the prompt alone
    voice_only = ratio * (voice.tokens.numel() - micro_token2wav.lookahead)
    assert stream.flow_cache is micro_token2wav.prompt_flow_cache(voice)
    assert stream.flow_cache.committed == voice_only // chunk_frames * chunk_frames
    for row in schedule_rows(dump)[:-1]:
        stream.run(stream.next_chunk(finished=True))
        frames = voice.mel.shape[0] + ratio * (row["tokens_end"] - micro_token2wav.lookahead)
        assert stream.flow_cache is not None
        assert stream.flow_cache.committed == frames // chunk_frames * chunk_frames
        assert stream.flow_cache.kv[-1].shape[4] == stream.flow_cache.committed


def test_bad_inputs_are_refused(micro_token2wav: CosyVoice3Token2Wav, voice: VoicePrompt) -> None:
    vocab = micro_token2wav.flow.config.vocab_size
    with pytest.raises(CosyVoice3InputError, match="speech tokens"):
        micro_token2wav.offline([1, 2, vocab], voice)
    short = VoicePrompt(voice.tokens, voice.mel[:-1], voice.xvector)
    with pytest.raises(CosyVoice3InputError, match="prompt mel"):
        micro_token2wav.offline([1, 2, 3], short)
    assert micro_token2wav.offline([], voice).shape == (0,)


def test_offline_job_equals_offline_and_failed_batches_change_nothing(micro_token2wav: CosyVoice3Token2Wav,
                                                                      voice: VoicePrompt, dump) -> None:
    tokens = dump["in_speech_token"][0].tolist()
    job = micro_token2wav.offline_job(tokens, voice)
    good = micro_token2wav.open_stream(voice, cached=True)
    good.extend(tokens[: micro_token2wav.schedule.hop(0) + micro_token2wav.lookahead])  # exactly a first chunk
    bad = micro_token2wav.open_stream(voice)
    bad.extend([1, 2, 3, 4, micro_token2wav.flow.config.vocab_size + 5, 5, 6])  # outside the flow vocabulary
    with pytest.raises(CosyVoice3InputError):
        micro_token2wav.run_chunks([(good, good.next_chunk(finished=False)), (bad, bad.next_chunk(finished=True))])
    assert not good.chunks and good.flow_cache is micro_token2wav.prompt_flow_cache(voice)
    first, offline = micro_token2wav.run_chunks([(good, good.next_chunk(finished=False)), job])
    assert good.chunks and good.flow_cache.committed > 0 and first.shape[0] > 0
    # the batched flow solve equals the offline one up to float summation order; HiFT magnifies that in the audio
    assert max_abs(job[0].last_mel, micro_token2wav.mel(tokens, voice)) <= MEL_TOL
    assert max_abs(offline, micro_token2wav.offline(tokens, voice)) <= AUDIO_TOL


def test_voice_flow_cache_of_a_longer_prompt(micro_token2wav: CosyVoice3Token2Wav, voice: VoicePrompt, dump) -> None:
    """A prompt long enough for the voice's own cache to hold complete chunks: a cached stream still emits what
    the recompute path emits, chunk by chunk, and leaves the shared voice cache as it was."""
    extra = dump["in_speech_token"].shape[1] // 2
    long_voice = VoicePrompt(torch.cat([voice.tokens, torch.as_tensor(dump["in_speech_token"][0, :extra]).long()]),
                             torch.cat([voice.mel, torch.from_numpy(dump["offline_mel"][0, :, : 2 * extra].T)]),
                             voice.xvector)
    shared = micro_token2wav.prompt_flow_cache(long_voice)
    chunk_frames = micro_token2wav.flow.config.dit.static_chunk_size
    assert shared.committed >= chunk_frames
    held = shared.kv[0].clone()
    tokens = dump["in_speech_token"][0, extra:].tolist()
    streams = [micro_token2wav.open_stream(long_voice, cached=c) for c in (False, True)]
    for stream in streams:
        stream.extend(tokens)
    while not streams[0].finished:
        pieces = [stream.run(stream.next_chunk(finished=True)) for stream in streams]
        assert max_abs(pieces[1], pieces[0]) <= 1e-4
    assert torch.equal(shared.kv[0], held)  # the shared cache is unchanged
    assert micro_token2wav.open_stream(long_voice, cached=True).flow_cache is shared
