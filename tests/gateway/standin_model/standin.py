"""STAND-IN pipeline model: a test double, NOT speech synthesis.

It implements the pipeline contract (pipeline_contract) for both the offline (one response)
and the streaming (decoupled, N responses, FINAL with the last one) model, so the gateway can be
tested against a real tritonserver without the CosyVoice2 engine. Its audio is a deterministic sine
derived from the target text, so tests can predict duration, pitch and order.

Behaviour switches, as words anywhere in ``target_text`` (case-insensitive, letters only so text
normalization leaves them alone):

* ``failstart``     error before any audio
* ``failmid``       streaming: one chunk, then an error
* ``invalidinput``  error tagged ``[invalid_input]``; ``overloaded``: tagged ``[overloaded]``; ``unknownvoice``:
  tagged ``[unknown_voice]`` (even for a request that carries the audio)
* ``holdstream``    after the first chunk (offline: before the response), wait until
  ``<marker_dir>/<tag>.release`` exists (or the request is cancelled, or 30 s pass -> error)
* ``zq<letters>``   the request's tag, used for marker files

Voice-prompt cache, as the contract describes it: an EMPTY ``target_text`` only "prepares" the voice
(one response, empty waveform, zero tokens, outcome ``prepared``); every request that carries the reference
audio marks its ``voice_id`` prepared. An id-only request (no reference tensors) for a voice not prepared is
refused with ``[unknown_voice]`` before any audio (outcome ``unknown_voice``), as the pipeline refuses it. The
cache is a directory of marker files (``<marker_dir>/voice_cache/``) because the offline and the streaming model
are separate processes that share one cache, like the real pipeline's; a test removes a marker to make the
stand-in "forget" a voice (an eviction, a restart). Each logged request says whether its voice was already
prepared (``voice_cached``: a cache hit), whether it carried the audio (``carries_audio``) and the tensor bytes
it carried (``request_bytes``, `pipeline_contract.payload_bytes`).

Model parameters: ``chunk_count``, ``chunk_delay_ms``, ``marker_dir``, ``sample_rate`` (default 24000).
Observations go to
``<marker_dir>``: ``requests.jsonl`` (one line per finished request with usage and outcome),
``<tag>.holding`` while holding, ``<tag>.cancelled`` when the request saw ``is_cancelled()`` (made after
its line in ``requests.jsonl``, so a test that saw the marker finds the record). Read the log with
``read_request_log``: it skips a last line still being written.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import re
import time
import zlib
from pathlib import Path
from typing import Any

import numpy as np

import pipeline_contract as contract

SAMPLE_RATE = 24_000
SECONDS_PER_CHAR = 0.02
MIN_SECONDS = 0.25
HOLD_TIMEOUT_S = 30.0


def frequency_for(text: str) -> float:
    """The sine frequency (Hz) of a segment: 200..575 Hz in 25 Hz steps, from a text hash."""
    return 200.0 + (zlib.crc32(text.encode("utf-8")) % 16) * 25.0


def samples_for(text: str, sample_rate: int = SAMPLE_RATE) -> int:
    """Whole speech tokens, as the real pipeline produces (CosyVoice2's are 25 Hz: 960 samples at 24 kHz)."""
    per_token = sample_rate // 25
    tokens = round(max(MIN_SECONDS, SECONDS_PER_CHAR * len(text)) * sample_rate / per_token)
    return tokens * per_token


def waveform_for(text: str, sample_rate: int = SAMPLE_RATE) -> np.ndarray:
    t = np.arange(samples_for(text, sample_rate), dtype=np.float64) / sample_rate
    return (0.5 * np.sin(2 * np.pi * frequency_for(text) * t)).astype(np.float32)


def input_tokens_for(reference_text: str, target_text: str) -> int:
    """Words of what the LLM would read: the transcript (or, in instruct mode, the instruction) + the target."""
    return len(reference_text.split()) + len(target_text.split())


def output_tokens_for(samples: int, sample_rate: int = SAMPLE_RATE) -> int:
    return samples // (sample_rate // 25)


def read_request_log(marker_dir: Path) -> list[dict[str, Any]]:
    """The finished requests logged so far (a last line without its newline is still being written: skipped)."""
    log = marker_dir / "requests.jsonl"
    if not log.exists():
        return []
    complete = log.read_text(encoding="utf-8").rpartition("\n")[0]
    return [json.loads(line) for line in complete.splitlines() if line.strip()]


def voice_cache_entry(marker_dir: Path, voice_id: str) -> Path:
    """The marker file saying the stand-in has "computed" the prompt of ``voice_id``."""
    return marker_dir / "voice_cache" / hashlib.sha256(voice_id.encode("utf-8")).hexdigest()


def _words(text: str) -> set[str]:
    return set(re.findall(r"[a-z]+", text.lower()))


def _outcome_of(violation: str) -> str:
    return "unknown_voice" if violation.startswith(contract.ERROR_UNKNOWN_VOICE) else "failed"


class StandinFailure(Exception):
    pass


class TritonPythonModel:
    def initialize(self, args: dict[str, Any]) -> None:
        global pb_utils  # noqa: PLW0603 - only importable inside the Triton stub
        import triton_python_backend_utils as pb_utils  # noqa: PLC0415

        config = json.loads(args["model_config"])
        self.model_name = config["name"]
        self.decoupled = bool(config.get("model_transaction_policy", {}).get("decoupled", False))
        params = {k: v["string_value"] for k, v in config.get("parameters", {}).items()}
        self.chunk_count = int(params.get("chunk_count", "4"))
        self.chunk_delay_s = int(params.get("chunk_delay_ms", "20")) / 1000
        self.marker_dir = Path(params["marker_dir"])
        # the rate of the waveform, stated in every response's `sample_rate` (a 16 kHz stand-in plays Spark-TTS)
        self.sample_rate = int(params.get("sample_rate", str(SAMPLE_RATE)))
        (self.marker_dir / "voice_cache").mkdir(parents=True, exist_ok=True)

    async def execute(self, requests: list[Any]) -> list[Any] | None:
        if self.decoupled:
            await asyncio.gather(*(self._stream(r) for r in requests))
            return None
        return list(await asyncio.gather(*(self._offline(r) for r in requests)))

    # Request handling --------------------------------------------------------------------------
    def _read(self, request: Any) -> tuple[dict[str, Any], str | None]:
        """(what the request says, for the log; the contract violation to answer with, if any). The request is
        decoded by the contract's own codec, as the pipeline decodes it, so the two cannot drift."""
        arrays: dict[str, np.ndarray | None] = {}
        for spec in contract.INPUTS:
            tensor = pb_utils.get_input_tensor_by_name(request, spec.name)
            arrays[spec.name] = None if tensor is None else tensor.as_numpy()
        reference = arrays[contract.REFERENCE_WAV.name]
        wav = np.zeros(0, np.float32) if reference is None else np.asarray(reference).reshape(-1)
        wav_len = arrays[contract.REFERENCE_WAV_LEN.name]
        raw = {  # as sent, so that tests see what the gateway sent (not what decoding made of it)
            "model": self.model_name,
            "reference_samples": int(wav.size),
            "reference_wav_len": 0 if wav_len is None else int(np.asarray(wav_len).reshape(-1)[0]),
            "reference_rms": float(np.sqrt(np.mean(wav.astype(np.float64) ** 2))) if wav.size else 0.0,
            "request_bytes": contract.payload_bytes({k: v for k, v in arrays.items() if v is not None}),
        }
        try:
            speech = contract.decode_request(arrays)
        except contract.ContractViolation as exc:
            info = {**raw, "tag": None, "words": set(), "target_text": "", "reference_text": "", "voice_id": "",
                    "voice_cached": False, "carries_audio": False, "seed": None, "instruction_text": None}  # fmt: skip
            return info, f"{contract.ERROR_INVALID_INPUT} {exc}"
        words = _words(speech.target_text)
        cache_entry = voice_cache_entry(self.marker_dir, speech.voice_id)
        voice_cached = cache_entry.exists()
        if speech.carries_audio:
            cache_entry.touch()  # a miss computes the prompt and caches it
        info = {
            **raw,
            "tag": next((w for w in sorted(words) if w.startswith("zq")), None),
            "words": words,
            "target_text": speech.target_text,
            "reference_text": speech.reference_text,
            "voice_id": speech.voice_id,
            "voice_cached": voice_cached,
            "carries_audio": speech.carries_audio,
            "seed": speech.seed,
            "instruction_text": speech.instruction or None,
        }
        if not speech.carries_audio and not voice_cached:
            return info, (f"{contract.ERROR_UNKNOWN_VOICE} voice {speech.voice_id!r} is not held here; send the "
                          "request again with its reference audio")  # fmt: skip
        return info, self._segment_violation(info)

    @staticmethod
    def _prompt_text(info: dict[str, Any]) -> str:
        """An instruction replaces the transcript in what the LLM reads (CosyVoice2's instruct mode)."""
        return info["instruction_text"] or info["reference_text"]

    @staticmethod
    def _segment_violation(info: dict[str, Any]) -> str | None:
        """The pipeline's segment limit without its tokenizer: each whitespace-separated word is at least one
        token, so more words than the limit are surely too many."""
        words = len(info["target_text"].split())
        if words > contract.MAX_SEGMENT_TOKENS:
            return (f"{contract.ERROR_INVALID_INPUT} target_text has at least {words} tokens; "
                    f"at most {contract.MAX_SEGMENT_TOKENS} per segment")  # fmt: skip
        return None

    @staticmethod
    def _error_message(words: set[str]) -> str | None:
        if "invalidinput" in words:
            return "[invalid_input] the stand-in was asked to reject this text"
        if "overloaded" in words:
            return "[overloaded] the stand-in was asked to be overloaded"
        if "unknownvoice" in words:
            return f"{contract.ERROR_UNKNOWN_VOICE} the stand-in was asked not to hold this voice, audio or not"
        if "failstart" in words:
            return "stand-in failure at start"
        return None

    def _response(self, chunk: np.ndarray, reference_text: str, target_text: str, samples_so_far: int) -> Any:
        tensors = contract.encode_response(
            contract.SpeechChunk(
                chunk,
                input_tokens_for(reference_text, target_text),
                output_tokens_for(samples_so_far, self.sample_rate),
                final=False,
                sample_rate=self.sample_rate,
            )
        )
        return pb_utils.InferenceResponse(output_tensors=[pb_utils.Tensor(k, v) for k, v in tensors.items()])

    def _prepared(self, info: dict[str, Any]) -> Any:
        """The contract's answer to an empty target_text: the voice is cached, nothing is spoken."""
        self._log(info, "prepared", 0)
        return self._response(np.zeros(0, np.float32), "", "", 0)

    async def _offline(self, request: Any) -> Any:
        info, violation = self._read(request)
        if violation:
            self._log(info, _outcome_of(violation), 0)
            return pb_utils.InferenceResponse(error=pb_utils.TritonError(violation))
        if not info["target_text"]:
            return self._prepared(info)
        error = self._error_message(info["words"]) or ("stand-in failure" if "failmid" in info["words"] else None)
        if error:
            self._log(info, "failed", 0)
            return pb_utils.InferenceResponse(error=pb_utils.TritonError(error))
        await asyncio.sleep(self.chunk_delay_s)
        if "holdstream" in info["words"]:
            try:
                await self._hold(request, info["tag"])
            except asyncio.CancelledError:
                self._log(info, "cancelled", 0)
                self._mark(info["tag"], "cancelled")  # after the record: whoever sees the marker finds it
                return pb_utils.InferenceResponse(error=pb_utils.TritonError("cancelled"))
            except StandinFailure as exc:
                self._log(info, "failed", 0)
                return pb_utils.InferenceResponse(error=pb_utils.TritonError(str(exc)))
        wave = waveform_for(info["target_text"], self.sample_rate)
        self._log(info, "done", wave.size)
        return self._response(wave, self._prompt_text(info), info["target_text"], wave.size)

    async def _stream(self, request: Any) -> None:
        sender = request.get_response_sender()
        final = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL
        info, violation = self._read(request)
        if violation:
            self._log(info, _outcome_of(violation), 0)
            sender.send(pb_utils.InferenceResponse(error=pb_utils.TritonError(violation)), flags=final)
            return
        if not info["target_text"]:
            sender.send(self._prepared(info), flags=final)
            return
        error = self._error_message(info["words"])
        if error:
            self._log(info, "failed", 0)
            sender.send(pb_utils.InferenceResponse(error=pb_utils.TritonError(error)), flags=final)
            return
        wave = waveform_for(info["target_text"], self.sample_rate)
        chunks = np.array_split(wave, self.chunk_count)
        sent = 0
        try:
            for index, chunk in enumerate(chunks):
                if index > 0:
                    await asyncio.sleep(self.chunk_delay_s)
                if index == 1:
                    if "failmid" in info["words"]:
                        raise StandinFailure("stand-in failure mid-stream")
                    if "holdstream" in info["words"]:
                        await self._hold(request, info["tag"])
                if request.is_cancelled():
                    raise asyncio.CancelledError
                sent += chunk.size
                response = self._response(chunk, self._prompt_text(info), info["target_text"], sent)
                if index == len(chunks) - 1:
                    self._log(info, "done", sent)  # before the client can see the end
                    sender.send(response, flags=final)
                else:
                    sender.send(response)
        except asyncio.CancelledError:
            self._log(info, "cancelled", sent)
            self._mark(info["tag"], "cancelled")  # after the record: whoever sees the marker finds it
            sender.send(flags=final)
            return
        except StandinFailure as exc:
            self._log(info, "failed", sent)
            sender.send(pb_utils.InferenceResponse(error=pb_utils.TritonError(str(exc))), flags=final)

    async def _hold(self, request: Any, tag: str | None) -> None:
        self._mark(tag, "holding")
        release = self.marker_dir / f"{tag}.release"
        deadline = time.monotonic() + HOLD_TIMEOUT_S
        while not release.exists():
            if request.is_cancelled():
                raise asyncio.CancelledError
            if time.monotonic() > deadline:
                raise StandinFailure("stand-in hold timed out")
            await asyncio.sleep(0.01)

    # Observations ------------------------------------------------------------------------------
    def _mark(self, tag: str | None, what: str) -> None:
        if tag:
            (self.marker_dir / f"{tag}.{what}").touch()

    def _log(self, info: dict[str, Any], outcome: str, samples: int) -> None:
        record = {k: v for k, v in info.items() if k != "words"}
        record.update(
            outcome=outcome,
            samples=samples,
            input_tokens=input_tokens_for(self._prompt_text(info), info["target_text"]) if info["target_text"] else 0,
            output_tokens=output_tokens_for(samples, self.sample_rate),
            pid=os.getpid(),
        )
        # One write(2) of the whole line on an O_APPEND descriptor: the offline and the streaming model (two
        # processes) append to one file while tests read it, so a line must never be split across writes
        # (readers also skip a last line without its newline, which a read racing the write can see).
        line = (json.dumps(record) + "\n").encode("utf-8")
        fd = os.open(self.marker_dir / "requests.jsonl", os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, line)
        finally:
            os.close(fd)
