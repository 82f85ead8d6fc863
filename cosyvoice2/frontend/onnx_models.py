"""The two ONNX models of the prompt frontend, run with onnxruntime:
`campplus.onnx` (CAM++ speaker encoder: fbank (1, T, 80) -> x-vector (1, 192)) and
`speech_tokenizer_v2.onnx` (S3Tokenizer v2: Whisper log-mel (1, 128, T) + length -> 25 Hz token ids).

Why onnxruntime rather than the `s3tokenizer` package for the tokenizer: running the released ONNX graph is
what upstream CosyVoice does, so the tokens are the reference tokens by construction (a torch re-implementation
can flip FSQ roundings); `s3tokenizer` also imports torchaudio, whose PyPI build does not import on our
machines; and onnxruntime serves both models with one mechanism. Input/output names are read from the
session, never assumed (the released files' names are only partly documented).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnxruntime as ort

from cosyvoice2.layout import CAMPPLUS_FILE, SPEECH_TOKENIZER_FILE



def default_providers() -> list[str]:
    """CUDA when this onnxruntime build has it, else CPU."""
    available = ort.get_available_providers()
    if "CUDAExecutionProvider" in available:
        return ["CUDAExecutionProvider", "CPUExecutionProvider"]
    return ["CPUExecutionProvider"]


def _session(path: str | Path, providers: list[str] | None, threads: int) -> ort.InferenceSession:
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    options.intra_op_num_threads = threads
    return ort.InferenceSession(str(path), sess_options=options,
                                providers=providers if providers is not None else ["CPUExecutionProvider"])


class SpeakerEncoder:
    """CAM++ x-vector from mean-normalised Kaldi fbank. Upstream runs it on CPU; so do we by default."""

    def __init__(self, path: str | Path, providers: list[str] | None = None, threads: int = 1) -> None:
        self.session = _session(path, providers, threads)
        self.input_name = self.session.get_inputs()[0].name

    def __call__(self, fbank: np.ndarray) -> np.ndarray:
        """(T, 80) -> (192,) float32."""
        feats = np.ascontiguousarray(fbank, dtype=np.float32)[None]
        (embedding,) = self.session.run(None, {self.input_name: feats})[:1]
        return np.asarray(embedding, dtype=np.float32).reshape(-1)


class SpeechTokenizer:
    """S3Tokenizer v2: speech tokens at 25 Hz (ids 0..6560) from a Whisper 128-bin log-mel at 16 kHz."""

    def __init__(self, path: str | Path, providers: list[str] | None = None, threads: int = 1) -> None:
        self.session = _session(path, providers, threads)
        inputs = self.session.get_inputs()
        self.feats_name, self.length_name = inputs[0].name, inputs[1].name

    def __call__(self, log_mel: np.ndarray) -> np.ndarray:
        """(128, T) -> (T_tok,) int32, T_tok = ceil(T / 4)."""
        feats = np.ascontiguousarray(log_mel, dtype=np.float32)[None]
        length = np.array([feats.shape[2]], dtype=np.int32)
        (indices,) = self.session.run(None, {self.feats_name: feats, self.length_name: length})[:1]
        return np.asarray(indices).reshape(-1).astype(np.int32)


class PromptModels:
    """Both frontend ONNX models of one model directory."""

    def __init__(self, speaker_encoder: SpeakerEncoder, speech_tokenizer: SpeechTokenizer) -> None:
        self.speaker_encoder = speaker_encoder
        self.speech_tokenizer = speech_tokenizer

    @classmethod
    def from_model_dir(cls, model_dir: str | Path, providers: list[str] | None = None,
                       speech_tokenizer_file: str = SPEECH_TOKENIZER_FILE) -> "PromptModels":
        """Speech tokenizer on `providers` (default: CUDA if available); CAM++ on CPU as upstream.
        `speech_tokenizer_file`: v2 here; CosyVoice3 passes its v3 file (same interface)."""
        model_dir = Path(model_dir)
        tokenizer_providers = providers if providers is not None else default_providers()
        return cls(SpeakerEncoder(model_dir / CAMPPLUS_FILE),
                   SpeechTokenizer(model_dir / speech_tokenizer_file, tokenizer_providers))
