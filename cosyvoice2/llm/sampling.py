"""Repetition-aware sampling (RAS, VALL-E 2) over nucleus sampling, as CosyVoice2 decodes speech tokens.

Per step, for one request's log-probs row:
1. nucleus: sort the probabilities descending (stable) and keep a prefix while the cumulative probability *before*
   an entry is < top_p and fewer than top_k entries are kept (so the entry that crosses top_p is included); draw one
   id from the kept, unnormalised probabilities;
2. repetition check: if that id occurs at least ``win_size * tau_r`` times among the last ``win_size`` emitted tokens,
   exclude it (log-prob -inf) and redraw from the full distribution (no top-k/top-p).
Temperature is 1. Every draw uses the request's own ``torch.Generator``, so a seed reproduces a request's tokens
regardless of what else runs (upstream uses the global generator).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch


@dataclass(frozen=True)
class SamplingParams:
    """Per-request decoding parameters; defaults are CosyVoice2's (``cosyvoice2.yaml`` / ``Qwen2LM.inference``)."""

    top_p: float = 0.8
    top_k: int = 25
    win_size: int = 10
    tau_r: float = 0.1
    min_token_text_ratio: float = 2.0
    max_token_text_ratio: float = 20.0
    seed: int | None = None


def make_generator(seed: int | None, device: torch.device | str) -> torch.Generator:
    generator = torch.Generator(device=device)
    if seed is None:
        generator.seed()
    else:
        generator.manual_seed(seed)
    return generator


def nucleus_sample(logp: torch.Tensor, top_p: float, top_k: int, generator: torch.Generator) -> int:
    """Draw one id from the top-p/top-k nucleus of the 1-D log-probs ``logp``."""
    probs, order = logp.softmax(dim=0).sort(descending=True, stable=True)
    mass_before = probs.cumsum(dim=0) - probs
    ranks = torch.arange(probs.numel(), device=probs.device)
    kept = torch.where((mass_before < top_p) & (ranks < top_k), probs, torch.zeros_like(probs))
    return int(order[torch.multinomial(kept, 1, generator=generator)])


def full_sample(logp: torch.Tensor, generator: torch.Generator) -> int:
    return int(torch.multinomial(logp.softmax(dim=0), 1, generator=generator))


def ras_sample(
    logp: torch.Tensor, history: Sequence[int], params: SamplingParams, generator: torch.Generator
) -> int:
    """One RAS draw from the 1-D log-probs ``logp`` given the request's emitted tokens ``history``."""
    token = nucleus_sample(logp, params.top_p, params.top_k, generator)
    repeats = list(history[-params.win_size :]).count(token) if params.win_size > 0 else 0
    if params.win_size > 0 and repeats >= params.win_size * params.tau_r:
        excluded = logp.clone()
        excluded[token] = float("-inf")
        token = full_sample(excluded, generator)
    return token
