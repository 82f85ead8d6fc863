"""Smoke test of a rendered repository: synthesize one sentence through Triton's offline model, check the audio.

Starts a tritonserver on the rendered repository (``triton_repo.server.TritonServer``) unless the settings name
a running one. Silence is a failure too: it is how a mismatched engine shows up upstream.
"""

from __future__ import annotations

import hashlib
import logging

import numpy as np

from cosyvoice_build.pipeline import StageError
from cosyvoice_build.settings import BuildSettings
import pipeline_contract as contract

log = logging.getLogger("cosyvoice_build")

REFERENCE_TEXT = "This is a short reference recording."
SILENCE_PEAK = 1e-4


def synthetic_reference(seconds: float = 2.0) -> np.ndarray:
    """A deterministic voice-like 16 kHz signal (harmonics of a gliding 140 Hz pitch, syllable-rate envelope)."""
    rate = contract.REFERENCE_SAMPLE_RATE
    t = np.arange(int(seconds * rate)) / rate
    f0 = 140.0 + 20.0 * np.sin(2 * np.pi * 0.7 * t)
    phase = 2 * np.pi * np.cumsum(f0) / rate
    voice = sum(np.sin(k * phase) / k for k in range(1, 8))
    envelope = 0.5 * (1 - np.cos(2 * np.pi * 4.0 * t))
    return (0.3 * voice * envelope / np.abs(voice).max()).astype(np.float32)


def check_audio(waveform: np.ndarray) -> None:
    if waveform.size == 0:
        raise StageError("smoke test: the pipeline returned no audio")
    if not np.all(np.isfinite(waveform)):
        raise StageError("smoke test: the audio contains NaN/inf samples")
    peak = float(np.abs(waveform).max())
    if peak < SILENCE_PEAK:
        raise StageError(f"smoke test: the audio is silent (peak {peak:.2e}); a mismatched engine does this")


def _bytes_tensor(client_module, spec: contract.TensorSpec, text: str):
    tensor = client_module.InferInput(spec.name, list(spec.dims), spec.triton_dtype)
    tensor.set_data_from_numpy(np.array([text.encode("utf-8")], dtype=np.object_))
    return tensor


def synthesize_once(grpc_url: str, text: str, reference: np.ndarray, reference_text: str, timeout_s: float = 600.0) -> np.ndarray:
    """One request to the offline model; returns the 24 kHz waveform."""
    import tritonclient.grpc as grpcclient  # noqa: PLC0415 - only the smoke test talks to Triton
    from tritonclient.utils import InferenceServerException  # noqa: PLC0415

    wav = grpcclient.InferInput(contract.REFERENCE_WAV.name, [reference.size], contract.REFERENCE_WAV.triton_dtype)
    wav.set_data_from_numpy(reference.astype(np.float32))
    wav_len = grpcclient.InferInput(contract.REFERENCE_WAV_LEN.name, [1], contract.REFERENCE_WAV_LEN.triton_dtype)
    wav_len.set_data_from_numpy(np.array([reference.size], dtype=np.int32))
    voice_id = hashlib.sha256(reference.tobytes() + reference_text.encode()).hexdigest()
    inputs = [
        wav,
        wav_len,
        _bytes_tensor(grpcclient, contract.REFERENCE_TEXT, reference_text),
        _bytes_tensor(grpcclient, contract.TARGET_TEXT, text),
        _bytes_tensor(grpcclient, contract.VOICE_ID, voice_id),
    ]
    outputs = [grpcclient.InferRequestedOutput(contract.WAVEFORM.name)]
    try:
        with grpcclient.InferenceServerClient(grpc_url) as client:
            result = client.infer(contract.OFFLINE_MODEL, inputs, outputs=outputs, client_timeout=timeout_s)
    except InferenceServerException as exc:
        raise StageError(f"smoke test: request to {contract.OFFLINE_MODEL} at {grpc_url} failed: {exc}") from exc
    return result.as_numpy(contract.WAVEFORM.name)


def run_smoke_test(settings: BuildSettings) -> None:
    from triton_repo.server import TritonLaunchError, TritonServer  # noqa: PLC0415

    reference = synthetic_reference()
    if settings.smoke_url:
        waveform = synthesize_once(settings.smoke_url, settings.smoke_text, reference, REFERENCE_TEXT)
    else:
        try:
            with TritonServer(model_repository=settings.triton_repo_dir) as server:
                waveform = synthesize_once(server.grpc_url, settings.smoke_text, reference, REFERENCE_TEXT)
        except TritonLaunchError as exc:
            raise StageError(f"smoke test: tritonserver did not start: {exc}") from exc
    check_audio(waveform)
    seconds = waveform.size / contract.OUTPUT_SAMPLE_RATE
    log.info("smoke test: %.2f s of audio, peak %.3f", seconds, float(np.abs(waveform).max()))
