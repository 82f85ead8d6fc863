"""Benchmark inputs: manifests, the default set, the upstream seed-tts set -> prepared requests."""

from __future__ import annotations

import json
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

# One decoder and one voice-id definition for the whole project: the gateway's.
from gateway.services.voices import Voice, VoiceRegistry, decode_to_reference, voice_id

SEED_TTS_DATASET = "yuekai/seed_tts_cosy2"
SEED_TTS_DEFAULT_SPLIT = "wenetspeech4tts"  # the 26-utterance split behind the published numbers


class InputError(ValueError):
    """A manifest or data set that cannot be used, with a message meant for the user."""


@dataclass(frozen=True)
class BenchItem:
    """One line of a manifest: who speaks (prompt audio + its transcript) and what to say."""

    id: str
    prompt_audio: Path
    prompt_text: str
    target_text: str


@dataclass(frozen=True)
class BenchRequest:
    """What a target sends: the voice prompt decoded up front (never inside a timing) + the text."""

    id: str
    voice: Voice
    target_text: str


_REQUIRED = ("prompt_audio", "prompt_text", "target_text")


def parse_manifest_line(line: str, base_dir: Path, default_id: str) -> BenchItem | None:
    """One JSONL line (``prompt_audio``, ``prompt_text``, ``target_text``, optional ``id``) or
    one upstream ``id|prompt_text|prompt_wav|target_text`` line; None for blanks and ``#`` comments.
    Relative audio paths are relative to the manifest's directory."""
    line = line.strip()
    if not line or line.startswith("#"):
        return None
    if line.startswith("{"):
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            raise InputError(f"not valid JSON: {exc}") from exc
        missing = [k for k in _REQUIRED if not isinstance(row.get(k), str) or not row[k]]
        if missing:
            raise InputError(f"missing or empty field(s): {', '.join(missing)}")
        item_id, audio, prompt_text, target_text = (
            str(row.get("id") or default_id), row["prompt_audio"], row["prompt_text"], row["target_text"]
        )
    else:
        fields = line.split("|")
        if len(fields) != 4 or not all(fields[1:]):
            raise InputError("expected a JSON object or 'id|prompt_text|prompt_wav|target_text'")
        item_id, prompt_text, audio, target_text = fields
        item_id = item_id or default_id
    return BenchItem(item_id, base_dir / Path(audio), prompt_text, target_text)


def load_manifest(path: Path) -> list[BenchItem]:
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except OSError as exc:
        raise InputError(f"cannot read manifest {path}: {exc}") from exc
    items = []
    for number, line in enumerate(lines, start=1):
        try:
            item = parse_manifest_line(line, path.parent, default_id=f"{path.stem}-{number}")
        except InputError as exc:
            raise InputError(f"{path}:{number}: {exc}") from exc
        if item is not None:
            items.append(item)
    if not items:
        raise InputError(f"manifest {path} has no entries")
    return items


def default_requests(voices_dir: Path, texts: Sequence[str]) -> list[BenchRequest]:
    """The default set: every text once, the voices of ``voices_dir`` (the gateway's layout,
    ``<name>.<audio>`` + ``<name>.txt``) assigned round-robin."""
    voices = VoiceRegistry.from_directory(voices_dir).voices
    if not voices:
        raise InputError(f"no reference voices (<name>.<audio> + <name>.txt) in {voices_dir}")
    return [
        BenchRequest(f"{voices[i % len(voices)].name}-{i:02d}", voices[i % len(voices)], text)
        for i, text in enumerate(texts)
    ]


def load_seed_tts(source: str, split: str, audio_dir: Path | None = None) -> list[BenchItem]:
    """The upstream benchmark set (HF datasets layout), from the local HF cache or a directory.

    Loaded lazily: ``datasets`` is only needed for this option. The embedded prompt audio is
    written to ``audio_dir`` (a temporary directory by default) so it decodes like any file.
    """
    try:
        import datasets  # noqa: PLC0415 - optional, heavy
    except ImportError as exc:
        raise InputError(
            f"--seed-tts needs the 'datasets' package (pip install datasets) and a local copy of "
            f"{SEED_TTS_DATASET} (HF cache or a directory holding the dataset repository)"
        ) from exc
    try:
        ds = datasets.load_dataset(source, split=split)
    except Exception as exc:  # noqa: BLE001 - datasets raises many types for "not available"
        raise InputError(
            f"cannot load {source!r} split {split!r}: {exc}. It cannot be downloaded on this machine; "
            f"point --seed-tts at a local copy of {SEED_TTS_DATASET}"
        ) from exc
    # Undecoded audio: we decode the original bytes ourselves (PyAV), like every other input.
    ds = ds.cast_column("prompt_audio", datasets.Audio(decode=False))
    audio_dir = audio_dir or Path(tempfile.mkdtemp(prefix="ttsbench-seedtts-"))
    items = []
    for number, row in enumerate(ds):
        audio = row["prompt_audio"]
        if audio.get("bytes"):
            path = audio_dir / f"{number:05d}{Path(audio.get('path') or 'x.wav').suffix}"
            path.write_bytes(audio["bytes"])
        elif audio.get("path"):
            path = Path(audio["path"])
        else:
            raise InputError(f"{source}: row {row.get('id')} has no prompt audio")
        items.append(BenchItem(str(row["id"]), path, row["prompt_text"], row["target_text"]))
    return items


def prepare_requests(items: Sequence[BenchItem]) -> list[BenchRequest]:
    """Decode each distinct prompt file once; one Voice per distinct (file, transcript)."""
    samples: dict[Path, np.ndarray] = {}
    voices: dict[tuple[Path, str], Voice] = {}
    requests = []
    for item in items:
        if item.prompt_audio not in samples:
            try:
                samples[item.prompt_audio] = decode_to_reference(item.prompt_audio)
            except Exception as exc:  # noqa: BLE001 - PyAV/OS errors: say which item
                raise InputError(f"item {item.id}: cannot decode {item.prompt_audio}: {exc}") from exc
        key = (item.prompt_audio, item.prompt_text)
        if key not in voices:
            wav = samples[item.prompt_audio]
            voices[key] = Voice(voice_id(wav, item.prompt_text), item.prompt_audio.stem, item.prompt_text, wav)
        requests.append(BenchRequest(item.id, voices[key], item.target_text))
    return requests
