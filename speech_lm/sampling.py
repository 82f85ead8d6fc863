"""Repetition-aware sampling (RAS, VALL-E 2) over nucleus sampling, as CosyVoice2 decodes speech tokens.

Per step, for one request's log-probs row:
1. nucleus: sort the probabilities descending (stable) and keep a prefix while the cumulative probability *before*
   an entry is < top_p and fewer than top_k entries are kept (so the entry that crosses top_p is included); draw one
   id from the kept, unnormalised probabilities;
2. repetition check: if that id occurs at least ``win_size * tau_r`` times among the last ``win_size`` emitted tokens,
   exclude it (log-prob -inf) and redraw from the full distribution (no top-k/top-p).
Temperature is 1.

Draws are inverse-CDF lookups driven by two uniforms per row, so a whole batch of rows is sampled with a fixed
number of kernels, without host syncs (CUDA-graph capturable), and each row's result depends only on its own
uniforms. The uniforms come from the request's own ``torch.Generator`` (the batched decoder draws a request's
whole sequence up front, ``draw_uniforms``), so a seed reproduces a request's tokens regardless of what else runs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from cosyvoice2.llm import sampling_defaults as defaults


@dataclass(frozen=True)
class SamplingParams:
    """Per-request decoding parameters; defaults are CosyVoice2's (``cosyvoice2.yaml`` / ``Qwen2LM.inference``,
    `sampling_defaults`).

    Length limits, all per request: EOS (6561) cannot be drawn before ``min_tokens`` speech tokens and the request
    stops after ``max_tokens``; unset, they are ``int(len(text) * min/max_token_text_ratio)`` as upstream.
    ``ignore_eos``: no stop id (6561-6563) is ever drawn, so the request runs to ``max_tokens`` (benchmark mode
    for random weights, which stop at random).
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
def _row_tensors(params: SamplingParams, device: torch.device) -> dict[str, torch.Tensor]:
    return {
        "top_p": torch.tensor([params.top_p], device=device),
        "top_k": torch.tensor([params.top_k], device=device),
        "win_size": torch.tensor([params.win_size], device=device),
        "repeat_threshold": torch.tensor([params.win_size * params.tau_r], device=device),
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
    """One RAS draw from the 1-D log-probs ``logp`` given the request's emitted tokens ``history``."""
    device = logp.device
    u = draw_uniforms(1, generator).to(device)
    past = torch.tensor([list(history) or [-1]], dtype=torch.long, device=device)
    length = torch.tensor([len(history)], device=device)
    return int(ras_draw(logp.unsqueeze(0), u, past, length, **_row_tensors(params, device)))
