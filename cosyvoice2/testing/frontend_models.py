"""Tiny random stand-ins for `campplus.onnx` and `speech_tokenizer_v2.onnx` for tests and tiny model dirs.

They have the released files' interfaces: campplus `input` (B, T, 80) float -> (B, 192) float;
tokenizer `feats` (B, 128, T) float + `feats_length` (B,) int32 -> `indices` (B, ceil(T / 4)) int64 in
[0, 6561) (two stride-2 convolutions, as S3Tokenizer v2, then argmax over the 6561 codes).
The campplus output name of the released file is undocumented; the stand-in calls it `embedding`.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from cosyvoice2.frontend.onnx_models import CAMPPLUS_FILE, SPEECH_TOKENIZER_FILE

XVECTOR_DIM = 192
FBANK_DIM = 80
WHISPER_MELS = 128
SPEECH_CODES = 6561
_OPSET = 17


def _save(graph: onnx.GraphProto, path: Path) -> Path:
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", _OPSET)])
    model.ir_version = 8  # readable by older onnxruntime releases too
    onnx.checker.check_model(model)
    onnx.save(model, str(path))
    return path


def write_tiny_campplus(path: str | Path, seed: int = 0, hidden: int = 16) -> Path:
    """x-vector = tanh(mean over time of a two-layer projection of the fbank)."""
    rng = np.random.default_rng(seed)
    w1 = numpy_helper.from_array((rng.standard_normal((FBANK_DIM, hidden)) / np.sqrt(FBANK_DIM)).astype(np.float32), "w1")
    w2 = numpy_helper.from_array((rng.standard_normal((hidden, XVECTOR_DIM)) / np.sqrt(hidden)).astype(np.float32), "w2")
    nodes = [
        helper.make_node("MatMul", ["input", "w1"], ["h1"]),
        helper.make_node("Relu", ["h1"], ["h1r"]),
        helper.make_node("MatMul", ["h1r", "w2"], ["h2"]),
        helper.make_node("ReduceMean", ["h2"], ["pooled"], axes=[1], keepdims=0),
        helper.make_node("Tanh", ["pooled"], ["embedding"]),
    ]
    graph = helper.make_graph(
        nodes, "tiny_campplus",
        [helper.make_tensor_value_info("input", TensorProto.FLOAT, ["batch", "frames", FBANK_DIM])],
        [helper.make_tensor_value_info("embedding", TensorProto.FLOAT, ["batch", XVECTOR_DIM])],
        [w1, w2])
    return _save(graph, Path(path))


def write_tiny_speech_tokenizer(path: str | Path, seed: int = 0, hidden: int = 8) -> Path:
    """tokens = argmax over 6561 codes of conv(k3, s2) -> tanh -> conv(k3, s2) on the log-mel."""
    rng = np.random.default_rng(seed)
    w1 = numpy_helper.from_array(
        (rng.standard_normal((hidden, WHISPER_MELS, 3)) / np.sqrt(3 * WHISPER_MELS)).astype(np.float32), "w1")
    w2 = numpy_helper.from_array(rng.standard_normal((SPEECH_CODES, hidden, 3)).astype(np.float32), "w2")
    nodes = [
        helper.make_node("Conv", ["feats", "w1"], ["c1"], kernel_shape=[3], strides=[2], pads=[1, 1]),
        helper.make_node("Tanh", ["c1"], ["a1"]),
        helper.make_node("Conv", ["a1", "w2"], ["logits"], kernel_shape=[3], strides=[2], pads=[1, 1]),
        helper.make_node("ArgMax", ["logits"], ["indices"], axis=1, keepdims=0),
    ]
    graph = helper.make_graph(
        nodes, "tiny_speech_tokenizer_v2",
        [helper.make_tensor_value_info("feats", TensorProto.FLOAT, ["batch", WHISPER_MELS, "frames"]),
         helper.make_tensor_value_info("feats_length", TensorProto.INT32, ["batch"])],
        [helper.make_tensor_value_info("indices", TensorProto.INT64, ["batch", "tokens"])],
        [w1, w2])
    return _save(graph, Path(path))


def write_tiny_frontend_models(model_dir: str | Path, seed: int = 0,
                               speech_tokenizer_file: str = SPEECH_TOKENIZER_FILE) -> tuple[Path, Path]:
    """Write both stand-ins under their released file names into `model_dir` (`speech_tokenizer_file`: v2 by
    default; CosyVoice3's v3 has the same interface)."""
    model_dir = Path(model_dir)
    model_dir.mkdir(parents=True, exist_ok=True)
    return (write_tiny_campplus(model_dir / CAMPPLUS_FILE, seed),
            write_tiny_speech_tokenizer(model_dir / speech_tokenizer_file, seed + 1))
