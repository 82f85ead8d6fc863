"""Nucleus (top-p/top-k) sampling with optional repetition-aware resampling (RAS, VALL-E 2), for the batched
decoder.

Per step, for one request's log-probs row:
1. nucleus: sort the probabilities descending (stable) and keep a prefix while the cumulative probability *before*
   an entry is < top_p and fewer than top_k entries are kept (so the entry that crosses top_p is included); draw one
   id from the kept, unnormalised probabilities;
2. repetition check, only with ``SamplingParams.repetition`` set: if that id occurs at least ``win_size * tau_r``
   times among the last ``win_size`` emitted tokens, exclude it (log-prob -inf) and redraw from the full
   distribution (no top-k/top-p).
Sampling draws from the model's ``log_probs`` as they are: a model that samples at another temperature (or cuts the
distribution otherwise) does so in its ``log_probs``.

Draws are inverse-CDF lookups driven by two uniforms per row, so a whole batch of rows is sampled with a fixed
number of kernels, without host syncs (CUDA-graph capturable), and each row's result depends only on its own
uniforms. The uniforms come from the request's own ``torch.Generator`` (the batched decoder draws a request's
whole sequence up front, ``draw_uniforms``), so a seed reproduces a request's tokens regardless of what else runs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch


@dataclass(frozen=True)
class RepetitionAwareSampling:
    """RAS: a nucleus pick seen at least ``win_size * tau_r`` times among the last ``win_size`` emitted tokens is
    redrawn from the whole distribution without it."""

    win_size: int
    tau_r: float

    def __post_init__(self) -> None:
        if self.win_size < 1 or self.tau_r < 0:
            raise ValueError(f"repetition-aware sampling needs win_size >= 1 and tau_r >= 0, got {self}")

    @property
    def threshold(self) -> float:
        return self.win_size * self.tau_r


@dataclass(frozen=True)
class SamplingParams:
    """One request's sampling: the nucleus (``top_k`` None: no top-k cut), repetition-aware resampling (off unless
    set) and the seed of the request's generator (None: a random one). Each model's package sets its own values."""

    top_p: float = 1.0
    top_k: int | None = None
    repetition: RepetitionAwareSampling | None = None
    seed: int | None = None

    def __post_init__(self) -> None:
        if not 0 < self.top_p <= 1 or (self.top_k is not None and self.top_k < 1):
            raise ValueError(f"sampling needs 0 < top_p <= 1 and top_k >= 1 (or None), got {self}")


def make_generator(seed: int | None, device: torch.device | str) -> torch.Generator:
    generator = torch.Generator(device=device)
    if seed is None:
        generator.seed()
    else:
        generator.manual_seed(seed)
    return generator


def draw_uniforms(steps: int, generator: torch.Generator) -> torch.Tensor:
    """``[steps, 2]`` float32 uniforms in [0, 1): per decoding step, the nucleus draw and the RAS fallback draw."""
    return torch.rand(steps, 2, generator=generator, device=generator.device)


# ---- batched sampling -----------------------------------------------------------------------------------------
def _inverse_cdf(weights: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """Per row, the index i with cumsum[i-1] <= u * total < cumsum[i] over non-negative ``weights [B, V]``."""
    cumulative = weights.cumsum(dim=-1)
    total = cumulative[:, -1:]
    # u * total can round up to total; keep the target below it so a positive-weight index is always found
    target = torch.minimum(uniforms.unsqueeze(-1) * total, torch.nextafter(total, torch.zeros_like(total)))
    index = torch.searchsorted(cumulative, target, right=True).squeeze(-1)
    return index.clamp(max=weights.size(-1) - 1)


def nucleus_draw(probs: torch.Tensor, top_p: torch.Tensor, top_k: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """One id per row from the top-p/top-k nucleus of ``probs [B, V]``; top_p/top_k/uniforms are ``[B]``."""
    sorted_probs, order = probs.sort(dim=-1, descending=True, stable=True)
    mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
    ranks = torch.arange(probs.size(-1), device=probs.device)
    keep = (mass_before < top_p.unsqueeze(-1)) & (ranks < top_k.unsqueeze(-1))
    kept = torch.where(keep, sorted_probs, torch.zeros_like(sorted_probs))
    return order.gather(-1, _inverse_cdf(kept, uniforms).unsqueeze(-1)).squeeze(-1)


def ras_draw(
    logp: torch.Tensor,
    uniforms: torch.Tensor,
    history: torch.Tensor,
    history_len: torch.Tensor,
    top_p: torch.Tensor,
    top_k: torch.Tensor,
    win_size: torch.Tensor,
    repeat_threshold: torch.Tensor,
) -> torch.Tensor:
    """RAS for a batch of rows; returns ``[B]`` int64 ids.

    logp ``[B, V]``; uniforms ``[B, 2]`` (nucleus draw, fallback draw); history ``[B, H]`` emitted ids of which the
    first ``history_len[b]`` are valid; win_size ``[B]``; repeat_threshold ``[B]`` = win_size * tau_r (float).
    """
    probs = logp.softmax(dim=-1)
    token = nucleus_draw(probs, top_p, top_k, uniforms[:, 0])
    positions = torch.arange(history.size(-1), device=history.device)
    in_window = (positions >= (history_len - win_size).unsqueeze(-1)) & (positions < history_len.unsqueeze(-1))
    repeats = ((history == token.unsqueeze(-1)) & in_window).sum(dim=-1)
    repeated = (win_size > 0) & (repeats >= repeat_threshold)
    excluded = probs.scatter(-1, token.unsqueeze(-1), 0.0)  # the repeated id gets log-prob -inf
    fallback = _inverse_cdf(excluded, uniforms[:, 1])
    return torch.where(repeated, fallback, token)


# ---- single-row helpers -----------------------------------------------------------------------------------------
def row_settings(params: SamplingParams, vocab_size: int) -> tuple[float, int, int, float]:
    """``(top_p, top_k, win_size, repeat_threshold)`` of ``ras_draw`` for one request: no top-k cut keeps the whole
    vocabulary, RAS off is a window of 0 (the draw then never redraws)."""
    top_k = vocab_size if params.top_k is None else params.top_k
    ras = params.repetition
    return params.top_p, top_k, (ras.win_size if ras else 0), (ras.threshold if ras else 0.0)


def _row_tensors(params: SamplingParams, vocab_size: int, device: torch.device) -> dict[str, torch.Tensor]:
    top_p, top_k, win_size, threshold = row_settings(params, vocab_size)
    return {
        "top_p": torch.tensor([top_p], device=device),
        "top_k": torch.tensor([top_k], device=device),
        "win_size": torch.tensor([win_size], device=device),
        "repeat_threshold": torch.tensor([threshold], device=device),
    }


def nucleus_sample(logp: torch.Tensor, top_p: float, top_k: int, generator: torch.Generator) -> int:
    """Draw one id from the top-p/top-k nucleus of the 1-D log-probs ``logp``."""
    u = torch.rand(1, generator=generator, device=generator.device).to(logp.device)
    top_p_t = torch.tensor([top_p], device=logp.device)
    top_k_t = torch.tensor([top_k], device=logp.device)
    return int(nucleus_draw(logp.softmax(dim=0).unsqueeze(0), top_p_t, top_k_t, u))


def ras_sample(
    logp: torch.Tensor, history: Sequence[int], params: SamplingParams, generator: torch.Generator
) -> int:
    """One draw from the 1-D log-probs ``logp`` given the request's emitted tokens ``history`` (RAS if ``params``
    enable it)."""
    device = logp.device
    u = draw_uniforms(1, generator).to(device)
    past = torch.tensor([list(history) or [-1]], dtype=torch.long, device=device)
    length = torch.tensor([len(history)], device=device)
    return int(ras_draw(logp.unsqueeze(0), u, past, length, **_row_tensors(params, logp.shape[-1], device)))
