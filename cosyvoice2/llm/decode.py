"""Speech-token decoding for CosyVoice2LM: a continuous-batching decoder and a per-request token iterator.

Rules (upstream ``Qwen2LM.inference``):
- input = [SOS, prompt_text ++ text, TASK_ID, prompt speech tokens] (``CosyVoice2LM.embed_prefix``);
- ``min_len = int(len(text) * 2)``, ``max_len = int(len(text) * 20)``, counting *target* text tokens only;
- while fewer than ``min_len`` tokens were emitted, the EOS log-prob (id 6561) is set to -inf before sampling
  (only 6561: upstream masks nothing else);
- any of 6561/6562/6563 stops the request and is never emitted; at ``max_len`` emitted tokens it stops too;
- each emitted token is fed back through ``speech_embedding``.

``BatchedDecoder`` API (what the Triton PyTorch LLM backend drives)::

    decoder = BatchedDecoder(model, num_slots=8, max_seq_len=2048)
    slot = decoder.add(DecodeRequest(text=ids, prompt_text=p_ids, prompt_speech_tokens=toks,
                                     sampling=SamplingParams(seed=7)))   # prefill into a free slot
    while decoder.active_slots:
        for slot, out in decoder.step().items():   # one batched forward over all slots
            if out.token is not None: ...           # new speech token of that request
            if out.finished: ...                    # slot is already free again (out.reason: "stop" | "length")
    decoder.remove(slot)                            # cancel a running request

- ``add`` raises ``NoFreeSlotError`` when all slots are busy, ``ValueError`` when the request cannot fit
  (``prefix_length + max_len > max_seq_len``); ``required_seq_len(request)`` gives the needed length.
- Requests may be added between any two ``step`` calls (continuous batching); each keeps its own sampling state
  and ``torch.Generator`` (seeded by ``SamplingParams.seed``), so its tokens do not depend on its neighbours.
- ``step`` first samples every active slot from its pending log-probs (``decoder.logp[slot]``, the distribution
  for the next token), then runs one forward of shape ``[num_slots, 1]`` at per-slot positions over the static KV
  cache (free slots carry a dummy token at position 0, which a later prefill overwrites). The forward has static
  shapes, so it can be captured in a CUDA graph; sampling is host-driven (one sync per active slot).
- Not thread-safe: drive one decoder from one thread.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterator, Literal, Sequence

import torch

from cosyvoice2.llm.model import CosyVoice2LM
from cosyvoice2.llm.sampling import SamplingParams, make_generator, ras_sample


@dataclass(frozen=True)
class DecodeRequest:
    """One zero-shot request: target text ids, optional prompt text ids and prompt speech tokens."""

    text: Sequence[int]
    prompt_text: Sequence[int] = ()
    prompt_speech_tokens: Sequence[int] = ()
    sampling: SamplingParams = field(default_factory=SamplingParams)

    @property
    def prefix_length(self) -> int:
        return 1 + len(self.prompt_text) + len(self.text) + 1 + len(self.prompt_speech_tokens)


def token_limits(num_text_tokens: int, params: SamplingParams) -> tuple[int, int]:
    """(min_len, max_len) speech tokens for ``num_text_tokens`` target text tokens (prompt text excluded)."""
    return int(num_text_tokens * params.min_token_text_ratio), int(num_text_tokens * params.max_token_text_ratio)


def required_seq_len(request: DecodeRequest) -> int:
    """KV-cache length a request needs: its prefix plus its maximum number of speech tokens."""
    return request.prefix_length + token_limits(len(request.text), request.sampling)[1]


@dataclass(frozen=True)
class SlotOutput:
    """What one ``step`` produced for one slot. ``token`` is None when the request stopped without emitting."""

    token: int | None
    finished: bool
    reason: Literal["stop", "length"] | None = None


class NoFreeSlotError(RuntimeError):
    pass


@dataclass
class _SlotState:
    params: SamplingParams
    generator: torch.Generator
    prefix_length: int
    min_len: int
    max_len: int
    history: list[int] = field(default_factory=list)


class BatchedDecoder:
    """Fixed number of KV-cache slots; one ``step`` advances every active request by one token."""

    def __init__(self, model: CosyVoice2LM, num_slots: int, max_seq_len: int) -> None:
        self.model = model
        self.num_slots = num_slots
        self.max_seq_len = max_seq_len
        self.device = model.llm_decoder.weight.device
        self.cache = model.new_cache(num_slots, max_seq_len)
        self.logp = torch.zeros(num_slots, model.config.num_speech_classes, device=self.device)
        self._slots: dict[int, _SlotState] = {}
        self._eos_id = model.config.eos_id
        self._stop_ids = frozenset(model.config.stop_ids)

    @property
    def active_slots(self) -> list[int]:
        return sorted(self._slots)

    @property
    def free_slots(self) -> list[int]:
        return [s for s in range(self.num_slots) if s not in self._slots]

    @torch.inference_mode()
    def add(self, request: DecodeRequest) -> int:
        """Prefill ``request`` into a free slot and return the slot index."""
        free = self.free_slots
        if not free:
            raise NoFreeSlotError(f"all {self.num_slots} slots are busy")
        needed = required_seq_len(request)
        if needed > self.max_seq_len:
            raise ValueError(f"request needs {needed} cache positions, decoder has {self.max_seq_len}")
        slot = free[0]
        prefix = self.model.embed_prefix(request.text, request.prompt_text, request.prompt_speech_tokens)
        hidden = self.model.hidden(prefix, cache=self.cache, slot=slot)
        self.logp[slot] = self.model.log_probs(hidden[0, -1])
        min_len, max_len = token_limits(len(request.text), request.sampling)
        self._slots[slot] = _SlotState(
            params=request.sampling,
            generator=make_generator(request.sampling.seed, self.device),
            prefix_length=request.prefix_length,
            min_len=min_len,
            max_len=max_len,
        )
        return slot

    def remove(self, slot: int) -> None:
        """Drop a request (e.g. cancelled); its slot becomes free."""
        self._slots.pop(slot, None)

    def _sample(self, slot: int, state: _SlotState) -> SlotOutput:
        if len(state.history) >= state.max_len:
            return SlotOutput(token=None, finished=True, reason="length")
        logp = self.logp[slot].clone()
        if len(state.history) < state.min_len:
            logp[self._eos_id] = float("-inf")
        token = ras_sample(logp, state.history, state.params, state.generator)
        if token in self._stop_ids:
            return SlotOutput(token=None, finished=True, reason="stop")
        state.history.append(token)
        if len(state.history) >= state.max_len:
            return SlotOutput(token=token, finished=True, reason="length")
        return SlotOutput(token=token, finished=False)

    @torch.inference_mode()
    def step(self) -> dict[int, SlotOutput]:
        """Sample one token for every active slot, free finished slots, then feed the new tokens back."""
        outputs = {slot: self._sample(slot, state) for slot, state in sorted(self._slots.items())}
        tokens = [0] * self.num_slots
        positions = [0] * self.num_slots
        for slot, out in outputs.items():
            if out.finished:
                del self._slots[slot]
            else:
                state = self._slots[slot]
                tokens[slot] = out.token
                positions[slot] = state.prefix_length + len(state.history) - 1
        if self._slots:
            token_ids = torch.tensor(tokens, device=self.device).view(-1, 1)
            embeds = self.model.embed_speech(token_ids)
            pos = torch.tensor(positions, device=self.device).view(-1, 1)
            self.logp.copy_(self.model(embeds, pos, self.cache)[:, -1])
        return outputs


def generate_tokens(model: CosyVoice2LM, request: DecodeRequest) -> Iterator[int]:
    """Yield one request's speech tokens as they are decoded (a one-slot ``BatchedDecoder``)."""
    decoder = BatchedDecoder(model, num_slots=1, max_seq_len=required_seq_len(request))
    slot = decoder.add(request)
    while True:
        out = decoder.step()[slot]
        if out.token is not None:
            yield out.token
        if out.finished:
            return
