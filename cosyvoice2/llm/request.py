"""CosyVoice2's LLM requests on the shared decoder (`speech_lm.decode`): its prefix layout and its sampling rules.

Rules (upstream ``Qwen2LM.inference``):
- input = [SOS, prompt_text ++ text, TASK_ID, prompt speech tokens] (`CosyVoice2Prefix`, embedded by
  ``CosyVoice2LM.embed_prefix``);
- ``min_len = int(len(text) * 2)``, ``max_len = int(len(text) * 20)``, counting *target* text tokens only
  (``CosyVoice2Sampling.min_tokens`` / ``max_tokens`` set them directly, per request);
- while fewer than ``min_len`` tokens were emitted, the EOS log-prob (id 6561) is set to -inf before sampling
  (only 6561: upstream masks nothing else; ``LLMConfig.vocabulary``);
- any of 6561/6562/6563 stops the request and is never emitted; at ``max_len`` emitted tokens it stops too;
- sampling is repetition-aware (RAS) over a top-p 0.8 / top-k 25 nucleus, window 10, tau 0.1;
- each emitted token is fed back through ``speech_embedding``.

CosyVoice3 shares these rules (with its own prefix and vocabulary), so it builds its requests with
`CosyVoice2Sampling` and `decode_request` too.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from cosyvoice2.llm import sampling_defaults as defaults
from speech_lm.decode import DecodeRequest, Prefix
from speech_lm.sampling import RepetitionAwareSampling, SamplingParams


@dataclass(frozen=True)
class CosyVoice2Prefix:
    """One request's LLM input ids: target text ids, optional prompt text ids and prompt speech tokens."""

    text: tuple[int, ...]
    prompt_text: tuple[int, ...] = ()
    prompt_speech_tokens: tuple[int, ...] = ()

    def __len__(self) -> int:
        """Positions: SOS, the prompt text and the text, TASK_ID, the prompt speech tokens."""
        return 1 + len(self.prompt_text) + len(self.text) + 1 + len(self.prompt_speech_tokens)

    @classmethod
    def of(cls, text: Sequence[int], prompt_text: Sequence[int] = (),
           prompt_speech_tokens: Sequence[int] = ()) -> "CosyVoice2Prefix":
        return cls(tuple(int(i) for i in text), tuple(int(i) for i in prompt_text),
                   tuple(int(i) for i in prompt_speech_tokens))


@dataclass(frozen=True)
class CosyVoice2Sampling:
    """Per-request decoding parameters; defaults are CosyVoice2's (``cosyvoice2.yaml`` / ``Qwen2LM.inference``,
    `sampling_defaults`).

    Length limits, all per request: EOS cannot be drawn before ``min_tokens`` speech tokens and the request
    stops after ``max_tokens``; unset, they are ``int(len(text) * min/max_token_text_ratio)`` as upstream.
    ``ignore_eos``: no stop id is ever drawn, so the request runs to ``max_tokens`` (benchmark mode for random
    weights, which stop at random). ``win_size`` 0 turns repetition-aware sampling off.
    """

    top_p: float = defaults.TOP_P
    top_k: int = defaults.TOP_K
    win_size: int = defaults.WIN_SIZE
    tau_r: float = defaults.TAU_R
    min_token_text_ratio: float = defaults.MIN_TOKEN_TEXT_RATIO
    max_token_text_ratio: float = defaults.MAX_TOKEN_TEXT_RATIO
    seed: int | None = None
    min_tokens: int | None = None
    max_tokens: int | None = None
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        for name in ("min_tokens", "max_tokens"):
            value = getattr(self, name)
            if value is not None and value < 0:
                raise ValueError(f"{name} must be >= 0, got {value}")

    def params(self) -> SamplingParams:
        """The decoder's sampling parameters: RAS on (unless ``win_size`` is 0) over the nucleus."""
        repetition = RepetitionAwareSampling(self.win_size, self.tau_r) if self.win_size > 0 else None
        return SamplingParams(top_p=self.top_p, top_k=self.top_k, repetition=repetition, seed=self.seed)

    def token_limits(self, num_text_tokens: int) -> tuple[int, int]:
        """(min_len, max_len) speech tokens: the explicit limits, else the ratios times ``num_text_tokens`` target
        text tokens (prompt text excluded)."""
        min_len = self.min_tokens
        if min_len is None:
            min_len = int(num_text_tokens * self.min_token_text_ratio)
        max_len = self.max_tokens
        if max_len is None:
            max_len = int(num_text_tokens * self.max_token_text_ratio)
        return min_len, max_len


def decode_request(prefix: Prefix, num_text_tokens: int, sampling: CosyVoice2Sampling) -> DecodeRequest:
    """The decoder's request for ``prefix`` whose target text has ``num_text_tokens`` ids (the length limits
    scale with it)."""
    min_tokens, max_tokens = sampling.token_limits(num_text_tokens)
    return DecodeRequest(prefix, sampling.params(), max_tokens=max_tokens, min_tokens=min_tokens,
                         ignore_eos=sampling.ignore_eos)


def cosyvoice2_request(text: Sequence[int], prompt_text: Sequence[int] = (), prompt_speech_tokens: Sequence[int] = (),
                       sampling: CosyVoice2Sampling = CosyVoice2Sampling()) -> DecodeRequest:
    """A CosyVoice2 request: [SOS, prompt_text ++ text, TASK_ID, prompt speech tokens] under ``sampling``."""
    return decode_request(CosyVoice2Prefix.of(text, prompt_text, prompt_speech_tokens), len(text), sampling)
