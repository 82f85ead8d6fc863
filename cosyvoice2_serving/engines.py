"""Adapters from the engine (`cosyvoice2`) to the serving interfaces. The only torch code in this package.

* `build_decode_request` - the flat LLM inputs (TensorRT-LLM layout) -> the engine's `DecodeRequest`,
  so the PyTorch LLM model takes the same tensors as the TensorRT-LLM model.
* `disable_stop_tokens` - benchmark mode for random weights (fixed generated lengths).
* `BatchedToken2Wav` - `Token2WavEngine` over `cosyvoice2.streaming`: the flow of jobs with equal shapes
  runs as one batched forward; HiFT, its caches and its noise stay per stream (so a seeded request
  sounds the same whether or not it was batched).
* `speech_tokens`, `speaker_xvector`, `prompt_tensors` - the prompt features from 16 kHz audio.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, replace
from typing import Sequence

import numpy as np
import torch

from cosyvoice2.config import EngineConfig
from cosyvoice2.frontend.audio import resample
from cosyvoice2.frontend.features import MEL_SAMPLE_RATE, matcha_mel, speaker_fbank, whisper_log_mel
from cosyvoice2.frontend.onnx_models import SpeakerEncoder, SpeechTokenizer
from cosyvoice2.frontend.prompt import align_tokens_and_mel
from cosyvoice2.llm import CosyVoice2LM, DecodeRequest, SamplingParams
from cosyvoice2.streaming import ChunkSchedule, FlowPrompt, Token2Wav, Token2WavStream
from cosyvoice2_serving.errors import InvalidInput
from cosyvoice2.vocab import SpeechVocabLayout
from cosyvoice2_serving.orchestrator import PromptTensors
from cosyvoice2_serving.token2wav import Work
from triton_repo.contract import REFERENCE_SAMPLE_RATE


# -- LLM -------------------------------------------------------------------------------------------
def build_decode_request(
    input_ids: np.ndarray,
    vocab: SpeechVocabLayout,
    min_tokens: int,
    max_tokens: int,
    seed: int | None,
    top_k: int,
    top_p: float,
) -> DecodeRequest:
    """[SOS, text ids, TASK_ID, prompt speech ids + offset] -> DecodeRequest with exactly these limits."""
    ids = np.asarray(input_ids, dtype=np.int64).reshape(-1)
    if ids.size < 2 or ids[0] != vocab.sos_id:
        raise InvalidInput("LLM input_ids must start with <|sos|>")
    task_positions = np.flatnonzero(ids == vocab.task_id_id)
    if task_positions.size != 1:
        raise InvalidInput("LLM input_ids must hold exactly one <|task_id|>")
    split = int(task_positions[0])
    text, speech = ids[1:split], ids[split + 1 :] - vocab.speech_offset
    if text.size == 0 or (text >= vocab.text_vocab_size).any() or (text < 0).any():
        raise InvalidInput("LLM input_ids: the text part must be non-empty text ids")
    if ((speech < 0) | (speech >= vocab.speech_token_size)).any():
        raise InvalidInput("LLM input_ids: after <|task_id|> only speech token ids may follow")
    if not 0 <= min_tokens <= max_tokens or max_tokens < 1:
        raise InvalidInput(f"LLM token limits must satisfy 0 <= min ({min_tokens}) <= max ({max_tokens}), max >= 1")
    # The decoder derives its limits as int(len(text) * ratio); +0.5 makes that exactly the requested count.
    n = text.size
    sampling = replace(
        SamplingParams(),
        top_k=top_k,
        top_p=top_p,
        seed=seed,
        min_token_text_ratio=(min_tokens + 0.5) / n if min_tokens else 0.0,
        max_token_text_ratio=(max_tokens + 0.5) / n,
    )
    return DecodeRequest(text=text.tolist(), prompt_speech_tokens=speech.tolist(), sampling=sampling)


@torch.no_grad()
def disable_stop_tokens(llm: CosyVoice2LM) -> None:
    """Benchmark mode of a whole deployment: the stop ids are never sampled (-inf head bias), so every sequence
    runs to the length limit its request sets. Random weights would otherwise stop at random."""
    llm.llm_decoder.bias[list(llm.config.stop_ids)] = float("-inf")


# -- token2wav -------------------------------------------------------------------------------------
@dataclass
class StreamState:
    prompt: FlowPrompt
    stream: Token2WavStream


class _BatchedMelToken2Wav(Token2Wav):
    """`Token2Wav` whose flow results can be precomputed in a batch for the next `mel()` calls."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.precomputed: dict[tuple[int, int, int, bool], torch.Tensor] = {}

    def mel(self, tokens, prompt: FlowPrompt, start: int, final: bool) -> torch.Tensor:
        cached = self.precomputed.pop((id(prompt), len(tokens), start, final), None)
        return cached if cached is not None else super().mel(tokens, prompt, start, final)

    @torch.inference_mode()
    def mel_batch(self, calls: Sequence[tuple[Sequence[int], FlowPrompt]], start: int, final: bool) -> None:
        """One flow forward for several (tokens, prompt) of equal lengths; results wait in `precomputed`."""
        token = torch.tensor([list(t) for t, _ in calls], dtype=torch.long, device=self.flow_device)
        prompts = [p for _, p in calls]
        mel = self.flow.inference(
            token,
            torch.cat([p.tokens for p in prompts]),
            torch.cat([p.mel for p in prompts]),
            torch.cat([p.xvector for p in prompts]),
            streaming=not final,
            finalize=final,
        )
        mel = mel[:, :, start * self.config.flow.token_mel_ratio :].to(self.hift_device, torch.float32)
        for i, (tokens, prompt) in enumerate(calls):
            self.precomputed[(id(prompt), len(tokens), start, final)] = mel[i : i + 1]


class BatchedToken2Wav:
    """`Token2WavEngine` for `Token2WavService`."""

    def __init__(self, flow: torch.nn.Module, hift: torch.nn.Module, config: EngineConfig, schedule: ChunkSchedule):
        self.engine = _BatchedMelToken2Wav(flow, hift, config)
        self.schedule = schedule  # prompt_tokens is set per stream

    def open(self, prompt: PromptTensors, seed: int | None) -> StreamState:
        engine = self.engine

        def tensor(array: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
            return torch.as_tensor(array).to(engine.flow_device, dtype).unsqueeze(0)

        flow_prompt = FlowPrompt(
            tensor(prompt.speech_tokens, torch.long),
            tensor(prompt.mel, engine.flow_dtype),
            tensor(prompt.embedding, engine.flow_dtype),
        )
        schedule = replace(self.schedule, prompt_tokens=flow_prompt.num_tokens)
        return StreamState(flow_prompt, Token2WavStream(engine, flow_prompt, schedule, engine.new_generator(seed)))

    def run(self, work: Sequence[Work[StreamState]]) -> list[np.ndarray | Exception]:
        self._precompute_flow(work)
        try:
            return [self._run_one(item) for item in work]
        finally:
            self.engine.precomputed.clear()

    def _precompute_flow(self, work: Sequence[Work[StreamState]]) -> None:
        """Batch the flow calls that have one shape; a failure here just leaves them to run one by one."""
        groups: dict[tuple, list[tuple[list[int], FlowPrompt]]] = defaultdict(list)
        for item in work:
            tokens = self._flow_tokens(item)
            start = 0 if item.chunk is None else item.chunk.start
            final = item.chunk is None or item.chunk.final
            if tokens:
                groups[(item.state.prompt.num_tokens, len(tokens), start, final)].append((tokens, item.state.prompt))
        for (_, _, start, final), calls in groups.items():
            if len(calls) > 1:
                try:
                    self.engine.mel_batch(calls, start, final)
                except Exception:  # noqa: BLE001 - the per-stream path reports the real error
                    pass

    @staticmethod
    def _flow_tokens(item: Work[StreamState]) -> list[int]:
        if item.chunk is None:
            return item.tokens.tolist()
        return (item.state.stream.tokens + item.tokens.tolist())[: item.chunk.feed]

    def _run_one(self, item: Work[StreamState]) -> np.ndarray | Exception:
        state = item.state
        try:
            if item.chunk is None:
                return self.engine.offline(item.tokens.tolist(), state.prompt, state.stream.generator)
            pieces = state.stream.push(item.tokens.tolist())
            if item.chunk.final:
                pieces.append(state.stream.finish())
            if len(pieces) != 1 and not item.chunk.final:
                raise RuntimeError(f"expected one chunk for {item.chunk}, the stream ran {len(pieces)}")
            return np.concatenate(pieces) if pieces else np.zeros(0, dtype=np.float32)
        except Exception as exc:  # noqa: BLE001 - returned per job, the others still succeed
            return exc


# -- prompt frontend -------------------------------------------------------------------------------
@torch.inference_mode()
def speech_tokens(tokenizer: SpeechTokenizer, wav_16k: np.ndarray) -> np.ndarray:
    """(T_tok,) int32 speech tokens of 16 kHz audio."""
    return tokenizer(whisper_log_mel(torch.as_tensor(wav_16k, dtype=torch.float32)).numpy())


@torch.inference_mode()
def speaker_xvector(encoder: SpeakerEncoder, wav_16k: np.ndarray) -> np.ndarray:
    """(192,) float32 CAM++ x-vector of 16 kHz audio."""
    return encoder(speaker_fbank(torch.as_tensor(wav_16k, dtype=torch.float32)).numpy()).astype(np.float32)


@torch.inference_mode()
def prompt_tensors(tokens: np.ndarray, xvector: np.ndarray, wav_16k: np.ndarray) -> PromptTensors:
    """Tokens + x-vector + the 24 kHz mel of the same audio -> 1:2-aligned prompt tensors (spec §1.7-1.8)."""
    wav_24k = resample(torch.as_tensor(wav_16k, dtype=torch.float32), REFERENCE_SAMPLE_RATE, MEL_SAMPLE_RATE)
    tokens, mel = align_tokens_and_mel(np.asarray(tokens, dtype=np.int32).reshape(-1), matcha_mel(wav_24k).numpy())
    if tokens.size == 0:
        raise InvalidInput("reference audio is too short to give any speech token")
    return PromptTensors(
        np.ascontiguousarray(tokens, dtype=np.int32),
        np.ascontiguousarray(mel, dtype=np.float32),
        np.asarray(xvector, dtype=np.float32).reshape(-1),
    )
