"""CosyVoice3 engine fixtures: the micro oracle (released layout, seeded random weights) and the reference
implementation's outputs for it (``parity_cv3``; its README says how the arrays are fed); the tiny random model's
token2wav engine and the streams, prompts and rounds of `run_chunks` calls its tests run."""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Optional, Sequence

import numpy as np
import pytest

from tests.conftest import FIXTURES_DIR
from tests.oracle import max_abs  # noqa: F401 - the parity tests import it from here

PARITY_DIR = FIXTURES_DIR / "parity_cv3"
MICRO_DIR = PARITY_DIR / "micro"
DUMP_FILE = PARITY_DIR / "micro_dump_seed1234.npz"

needs_parity_data = pytest.mark.skipif(not DUMP_FILE.exists(), reason="parity data absent")

if TYPE_CHECKING:
    import torch

    from cosyvoice3.token2wav import CosyVoice3Stream, CosyVoice3Token2Wav, FlowCache, VoicePrompt

# Rows solved together (batched, or padded to a graph bucket) differ from rows alone only in float summation order
# (padded keys add exact zeros to the softmax; the rows' matrix products are split differently). Measured on the
# tiny model: mel at most 4.8e-7 of a scale of 4 (about 1e-7 relative). The audio is compared relative to its scale
# and looser: the causal HiFT magnifies mel rounding (its f0 drives an accumulated source phase): a random 1e-7
# change of a mel moves its audio by up to 1.4e-3 of a scale of 0.64; the batched calls measured at most 5.6e-4 of
# the scale.
MEL_ATOL = 1e-5
AUDIO_OF_SCALE = 5e-3


def harness() -> dict:
    return json.loads((MICRO_DIR / "harness_config.json").read_text())


def micro_text_rows(ids: np.ndarray) -> list[int]:
    """The micro model's text-row rule (harness_config `micro_text`): `<|endofprompt|>` is looked up as the last
    row of the 512-row text embedding, every other id as itself."""
    rule = harness()["micro_text"]
    return [rule["endofprompt_row"] if int(i) == rule["endofprompt_id"] else int(i) for i in np.ravel(ids)]


@pytest.fixture(scope="session")
def dump() -> dict[str, np.ndarray]:
    with np.load(DUMP_FILE) as arrays:
        return {k: arrays[k] for k in arrays.files}


@pytest.fixture(scope="session")
def meta(dump) -> dict:
    return json.loads(str(dump["meta"]))


@pytest.fixture(scope="session")
def micro_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The oracle's files in a released directory: the yaml and checkpoints, plus `CosyVoice-BlankEN/config.json`
    written from the harness's Qwen2 config (a release ships it; the oracle keeps it in harness_config.json)."""
    from cosyvoice3.layout import CHECKPOINT_FILES, MODEL_YAML, QWEN_CONFIG

    root = tmp_path_factory.mktemp("cv3_micro")
    for name in (MODEL_YAML, *CHECKPOINT_FILES):
        shutil.copy(MICRO_DIR / name, root / name)
    (root / QWEN_CONFIG).parent.mkdir()
    (root / QWEN_CONFIG).write_text(json.dumps(harness()["llm"]["qwen"]))
    return root


@pytest.fixture(scope="session")
def micro_config(micro_model_dir):
    from cosyvoice3.config import CosyVoice3Config

    return CosyVoice3Config.from_model_dir(micro_model_dir, endofprompt_id=harness()["micro_text"]["endofprompt_row"])


@pytest.fixture(scope="session")
def micro_token2wav(micro_model_dir, dump):
    """Flow + HiFT of the oracle, the HiFT noise tables seeded as the dump says."""
    from cosyvoice3.loading import load_config, load_flow, load_hift
    from cosyvoice3.token2wav import CosyVoice3Token2Wav

    config = load_config(micro_model_dir, hift_noise_seed=int(dump["in_hift_noise_seed"]))
    return CosyVoice3Token2Wav(load_flow(micro_model_dir / "flow.pt", config),
                               load_hift(micro_model_dir / "hift.pt", config))


@pytest.fixture(scope="session")
def voice(dump):
    from cosyvoice3.token2wav import VoicePrompt

    return VoicePrompt.from_arrays(dump["in_prompt_speech_token"][0], dump["in_prompt_feat"][0], dump["in_xvector"][0])


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny random model (seed 5) without the text frontend: what the token2wav tests run (read only)."""
    from cosyvoice3.testing import write_tiny_model

    return write_tiny_model(tmp_path_factory.mktemp("cv3tiny"), seed=5, text_frontend=False)


@pytest.fixture(scope="module")
def tiny_parts(tiny_model_dir: Path):
    """The tiny model's flow and HiFT, loaded once per test module (engines of several budgets share them)."""
    from cosyvoice3.loading import load_config, load_flow, load_hift

    config = load_config(tiny_model_dir)
    return load_flow(tiny_model_dir / "flow.pt", config), load_hift(tiny_model_dir / "hift.pt", config)


@pytest.fixture(scope="module")
def token2wav(tiny_parts) -> "CosyVoice3Token2Wav":
    """A token2wav engine of the tiny model, one per test module (a test that swaps its graphs or schedule puts
    them back)."""
    from cosyvoice3.token2wav import CosyVoice3Token2Wav

    return CosyVoice3Token2Wav(*tiny_parts)


def make_voice(seed: int, tokens: int) -> "VoicePrompt":
    """A random voice prompt of `tokens` speech tokens (2 mel frames each, around the mel's usual level)."""
    from cosyvoice3.token2wav import VoicePrompt

    rng = np.random.default_rng(seed)
    return VoicePrompt.from_arrays(rng.integers(0, 6561, tokens), rng.standard_normal((2 * tokens, 80)) - 5,
                                   rng.standard_normal(192))


def stream_tokens(seed: int, count: int) -> list[int]:
    """`count` random speech tokens of a stream."""
    return np.random.default_rng(100 + seed).integers(0, 6561, count).tolist()


def open_stream(token2wav: "CosyVoice3Token2Wav", voice: "VoicePrompt", tokens: list[int],
                cached: bool = True) -> "CosyVoice3Stream":
    """A stream of `voice` holding all of `tokens` (its chunks are then cut with `finished=True`)."""
    stream = token2wav.open_stream(voice, cached=cached)
    stream.extend(tokens)
    return stream


@dataclass
class Rounds:
    """What `run_rounds` gave each stream: its audio pieces and mels per chunk, and its flow cache after each chunk
    that left one."""

    pieces: list[list[np.ndarray]]
    mels: list[list[torch.Tensor]]
    caches: list[list[FlowCache]]


def run_rounds(token2wav: "CosyVoice3Token2Wav", streams: Sequence["CosyVoice3Stream"],
               first_rounds: Optional[Sequence[int]] = None, extra: Optional[Callable[[int], list]] = None,
               on_round: Optional[Callable[[int, list], None]] = None) -> Rounds:
    """Rounds of `run_chunks` calls until every stream is finished, one chunk of each live stream per call (stream
    i joins at round first_rounds[i]); `extra(round)` adds work items (offline jobs) after the streams' chunks, and
    `on_round(round, their outputs)` runs after each call."""
    first_rounds = first_rounds or [0] * len(streams)
    rounds = Rounds([[] for _ in streams], [[] for _ in streams], [[] for _ in streams])
    round_ = 0
    while not all(stream.finished for stream in streams):
        live = [i for i, stream in enumerate(streams) if first_rounds[i] <= round_ and not stream.finished]
        more = extra(round_) if extra is not None else []
        out = token2wav.run_chunks([*[(streams[i], streams[i].next_chunk(finished=True)) for i in live], *more])
        for i, piece in zip(live, out):
            rounds.pieces[i].append(piece)
            rounds.mels[i].append(streams[i].last_mel)
            if streams[i].flow_cache is not None:
                rounds.caches[i].append(streams[i].flow_cache)
        if on_round is not None:
            on_round(round_, out[len(live):])
        round_ += 1
    return rounds
