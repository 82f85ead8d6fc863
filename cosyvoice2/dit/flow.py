"""The DiT flow (released class CausalMaskedDiffWithXvec of Step-Audio-2-mini token2wav): tokens -> mel.

Top-level keys: `input_embedding`, `spk_embed_affine_layer`, `encoder.*`, `encoder_proj`, `decoder.estimator.*`.

Three entry points:
- `inference`: offline, a right-padded batch of whole utterances (prompt tokens + new tokens per row);
- `prefill`: once per voice, the prompt's encoder and estimator caches (`PromptCache`);
- `chunk`: one stream's next chunk from its `FlowState`, returning the mel and the next state.

The ODE (`Solver`): 10 Euler steps on t_k = 1 - cos(pi/2 k/10), classifier-free guidance
v = (1 + w) v(x | mu, spks, cond) - w v(x | 0, 0, 0) with w = 0.7; both rows are one estimator batch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from .config import DiTFlowConfig
from .encoder import EncoderCache, UpsampleConformerEncoderV2
from .estimator import DiT


def time_grid(n_timesteps: int, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """t_k = 1 - cos(pi/2 k/n), k = 0..n (evaluated in the working dtype, as the reference does)."""
    return 1 - torch.cos(torch.linspace(0, 1, n_timesteps + 1, device=device, dtype=dtype) * 0.5 * math.pi)


@dataclass(frozen=True)
class EstimatorCache:
    """Per ODE step, per DiT block, per CFG row (conditional rows first, then unconditional):

    conv: (steps, depth, 2B, 2 C, k - 1) causal-conv left context; kv: (steps, depth, 2B, H, T_c, 2 D) keys ||
    values, newest frames first (the order the reference stores and trims in).
    """

    conv: torch.Tensor
    kv: torch.Tensor

    @property
    def frames(self) -> int:
        return int(self.kv.shape[4])

    def trimmed(self, keep_head: int, keep_tail: int) -> "EstimatorCache":
        """The reference's window after a chunk: when longer than keep_head + keep_tail frames, keep the first
        keep_head (the newest) and the last keep_tail (the oldest) frames."""
        if self.frames <= keep_head + keep_tail:
            return self
        kv = torch.cat([self.kv[:, :, :, :, :keep_head], self.kv[:, :, :, :, self.frames - keep_tail:]], dim=4)
        return EstimatorCache(self.conv, kv)


@dataclass(frozen=True)
class PromptCache:
    """What a voice's prompt leaves for every stream that starts from it (computed once per voice; immutable)."""

    spks: torch.Tensor  # (1, 80) projected speaker embedding
    encoder: EncoderCache
    estimator: EstimatorCache
    prompt_frames: int  # P: mel frames of the prompt (2 x prompt tokens)
    prompt_mel: torch.Tensor  # (1, 80, P) the ODE's output over the prompt (unused for audio; kept for checks)
    prompt_mu: torch.Tensor  # (1, P, 80)


@dataclass(frozen=True)
class FlowState:
    """One stream's flow state between chunks (immutable: each chunk returns a new one)."""

    prompt: PromptCache
    encoder: EncoderCache
    estimator: EstimatorCache

    @classmethod
    def start(cls, prompt: PromptCache) -> "FlowState":
        return cls(prompt, prompt.encoder, prompt.estimator)


class ConditionalCFM(nn.Module):
    """The `decoder` of the released checkpoint: the estimator plus the fixed noise buffer (not in the file)."""

    def __init__(self, config: DiTFlowConfig) -> None:
        super().__init__()
        self.estimator = DiT(config.estimator)
        self.solver = config.solver
        generator = torch.Generator(device="cpu").manual_seed(config.solver.noise_seed)
        with torch.device("cpu"):  # also when the module is built on the meta device
            noise = torch.randn(1, config.output_size, config.solver.noise_frames, generator=generator)
        self.register_buffer("rand_noise", noise, persistent=False)

    def _guided(self, velocity: torch.Tensor, rows: int) -> torch.Tensor:
        w = self.solver.inference_cfg_rate
        conditional, unconditional = velocity[:rows], velocity[rows:]
        return (1.0 + w) * conditional - w * unconditional

    def _euler(self, x: torch.Tensor, step_fn) -> torch.Tensor:
        """Euler steps with the reference's time bookkeeping (t advanced by dt, dt re-derived from the grid)."""
        grid = time_grid(self.solver.n_timesteps, x.device, x.dtype)
        t, dt = grid[0], grid[1] - grid[0]
        for step in range(1, len(grid)):
            x = x + dt * step_fn(step - 1, x, t)
            t = t + dt
            if step < len(grid) - 1:
                dt = grid[step + 1] - t
        return x

    def solve(self, noise: torch.Tensor, mu: torch.Tensor, spks: torch.Tensor, cond: torch.Tensor,
              key_mask: Optional[torch.Tensor]) -> torch.Tensor:
        """Offline: noise, mu, cond (B, 80, T), spks (B, 80), key_mask (B, 1, 1, T) -> mel (B, 80, T)."""
        rows = noise.shape[0]
        mu2 = torch.cat([mu, torch.zeros_like(mu)])
        spks2 = torch.cat([spks, torch.zeros_like(spks)])
        cond2 = torch.cat([cond, torch.zeros_like(cond)])
        mask2 = None if key_mask is None else torch.cat([key_mask, key_mask])

        def velocity(_: int, x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
            v = self.estimator(torch.cat([x, x]), mu2, t.expand(2 * rows), spks2, cond2, mask2)
            return self._guided(v, rows)

        return self._euler(noise, velocity)

    def solve_chunk(self, noise: torch.Tensor, mu: torch.Tensor, spks: torch.Tensor, cond: torch.Tensor,
                    cache: Optional[EstimatorCache]) -> tuple[torch.Tensor, EstimatorCache]:
        """One chunk of one stream: noise, mu, cond (1, 80, C), spks (1, 80); each ODE step continues its own
        cached conv context and K/V (None: nothing cached yet, zero conv context)."""
        rows = noise.shape[0]
        mu2 = torch.cat([mu, torch.zeros_like(mu)])
        spks2 = torch.cat([spks, torch.zeros_like(spks)])
        cond2 = torch.cat([cond, torch.zeros_like(cond)])
        convs: list[torch.Tensor] = []
        kvs: list[torch.Tensor] = []

        def velocity(step: int, x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
            old = None if cache is None else cache.kv[step]
            v, conv, own = self.estimator.forward_chunk(
                torch.cat([x, x]), mu2, t.expand(2 * rows), spks2, cond2,
                None if cache is None else cache.conv[step], old)
            convs.append(conv)
            kvs.append(own if old is None else torch.cat([own, old], dim=3))
            return self._guided(v, rows)

        x = self._euler(noise, velocity)
        return x, EstimatorCache(torch.stack(convs), torch.stack(kvs))

    def solve_chunks(self, noises: Sequence[torch.Tensor], mus: Sequence[torch.Tensor], spks: torch.Tensor,
                     caches: Sequence[EstimatorCache]) -> list[tuple[torch.Tensor, EstimatorCache]]:
        """One chunk of each of several streams in one estimator batch per ODE step.

        noises[i], mus[i]: (1, 80, C_i); spks (B, 80); caches[i] the stream's cache (C_i and cache lengths may
        differ). Rows are right-padded and masked: a padded chunk frame is never a key, a padded cache frame
        never attended, and each row's conv context ends at its own last frame, so every stream gets what
        `solve_chunk` gives it alone (up to float rounding). Conditional rows first, then unconditional.
        """
        if len(noises) == 1:
            return [self.solve_chunk(noises[0], mus[0], spks, torch.zeros_like(mus[0]), caches[0])]
        batch = len(noises)
        frames = [n.shape[2] for n in noises]
        cached = [c.frames for c in caches]
        longest, longest_cache = max(frames), max(cached)
        device = noises[0].device

        def padded(items: Sequence[torch.Tensor]) -> torch.Tensor:
            return torch.cat([F.pad(item, (0, longest - item.shape[2])) for item in items])

        x = padded(noises)
        mu = padded(mus)
        mu2 = torch.cat([mu, torch.zeros_like(mu)])
        spks2 = torch.cat([spks, torch.zeros_like(spks)])
        cond2 = torch.zeros_like(mu2)
        lengths = torch.tensor(frames + frames, device=device)
        cache_lengths = torch.tensor(cached + cached, device=device)
        chunk_real = torch.arange(longest, device=device)[None, :] < lengths[:, None]
        cache_real = torch.arange(longest_cache, device=device)[None, :] < cache_lengths[:, None]
        key_mask = torch.cat([chunk_real, cache_real], dim=1)[:, None, None, :]

        def rows_of(tensor_per_stream: Sequence[torch.Tensor], row_axis: int) -> torch.Tensor:
            """(.., 2, ..) per stream -> (.., 2B, ..): every stream's conditional row, then the unconditional."""
            conditional = [t.narrow(row_axis, 0, 1) for t in tensor_per_stream]
            unconditional = [t.narrow(row_axis, 1, 1) for t in tensor_per_stream]
            return torch.cat(conditional + unconditional, dim=row_axis)

        steps = self.solver.n_timesteps
        conv_in = [rows_of([c.conv[step] for c in caches], 1) for step in range(steps)]
        kv_in = [rows_of([F.pad(c.kv[step], (0, 0, 0, longest_cache - c.frames)) for c in caches], 1)
                 for step in range(steps)]
        convs: list[torch.Tensor] = []
        owns: list[torch.Tensor] = []

        def velocity(step: int, x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
            v, conv, own = self.estimator.forward_chunk(torch.cat([x, x]), mu2, t.expand(2 * batch), spks2, cond2,
                                                        conv_in[step], kv_in[step], key_mask, lengths)
            convs.append(conv)
            owns.append(own)
            return self._guided(v, batch)

        x = self._euler(x, velocity)
        out = []
        for i, cache in enumerate(caches):
            rows = [i, batch + i]
            conv = torch.stack([c[:, rows] for c in convs])
            kv = torch.stack([torch.cat([own[:, rows, :, : frames[i]], cache.kv[step]], dim=3)
                              for step, own in enumerate(owns)])
            out.append((x[i : i + 1, :, : frames[i]], EstimatorCache(conv, kv)))
        return out


class DiTFlow(nn.Module):
    def __init__(self, config: DiTFlowConfig = DiTFlowConfig()) -> None:
        super().__init__()
        self.config = config
        self.input_embedding = nn.Embedding(config.vocab_size, config.input_size)
        self.spk_embed_affine_layer = nn.Linear(config.spk_embed_dim, config.output_size)
        self.encoder = UpsampleConformerEncoderV2(config.encoder)
        self.encoder_proj = nn.Linear(config.encoder.width, config.output_size)
        self.decoder = ConditionalCFM(config)

    # ---- shared pieces --------------------------------------------------------------------------------
    def speaker(self, xvector: torch.Tensor) -> torch.Tensor:
        """(B, 192) x-vector -> (B, 80): L2-normalised, then projected."""
        return self.spk_embed_affine_layer(F.normalize(xvector, dim=1))

    def _embed(self, tokens: torch.Tensor) -> torch.Tensor:
        if tokens.numel() and (int(tokens.min()) < 0 or int(tokens.max()) >= self.config.vocab_size):
            raise ValueError(f"speech tokens must be in 0..{self.config.vocab_size - 1}")
        return self.input_embedding(tokens)

    def noise(self, offset: int, frames: int) -> torch.Tensor:
        end = offset + frames
        if end > self.decoder.rand_noise.shape[2]:
            raise ValueError(f"noise buffer holds {self.decoder.rand_noise.shape[2]} frames, {end} needed")
        return self.decoder.rand_noise[:, :, offset:end]

    # ---- offline --------------------------------------------------------------------------------------
    @torch.inference_mode()
    def inference(self, tokens: torch.Tensor, lengths: torch.Tensor, prompt_mels: Sequence[torch.Tensor],
                  xvectors: torch.Tensor, noise: Optional[torch.Tensor] = None) -> torch.Tensor:
        """tokens (B, T) = prompt tokens ++ new tokens per row, right-padded, `lengths` (B,); prompt_mels[b]
        (P_b, 80); xvectors (B, 192); noise (B, 80, 2T) or None (the fixed buffer's first frames)
        -> mel (B, 80, 2T) covering prompt + new frames (row b real up to 2 lengths[b])."""
        ratio = self.config.token_mel_ratio
        dtype = self.input_embedding.weight.dtype
        spks = self.speaker(xvectors.to(dtype))
        h = self.encoder(self._embed(tokens.clamp(min=0)), lengths)
        mu = self.encoder_proj(h).transpose(1, 2)  # (B, 80, 2T)
        frames = mu.shape[2]
        cond = torch.zeros_like(mu)
        for row, mel in enumerate(prompt_mels):
            cond[row, :, : mel.shape[0]] = mel.transpose(0, 1).to(dtype)
        if noise is None:
            noise = self.noise(0, frames).to(mu).expand(mu.shape[0], -1, -1)
        real = torch.arange(frames, device=mu.device)[None, :] < (lengths * ratio)[:, None]
        return self.decoder.solve(noise.to(mu), mu, spks, cond, real[:, None, None, :])

    # ---- streaming ------------------------------------------------------------------------------------
    @torch.inference_mode()
    def prefill(self, prompt_tokens: torch.Tensor, prompt_mel: torch.Tensor, xvector: torch.Tensor) -> PromptCache:
        """A voice's prompt caches. prompt_tokens (1, P_tok), prompt_mel (1, 2 P_tok, 80), xvector (1, 192).

        The prompt is encoded as a non-final chunk whose lookahead is its own first tokens again (the reference's
        dummy lookahead), and the full ODE runs over the prompt frames with cond = the prompt mel and the first P
        noise frames, only to record each step's estimator caches.
        """
        lookahead = self.config.pre_lookahead_len
        ratio = self.config.token_mel_ratio
        if prompt_tokens.shape[1] < lookahead:
            raise ValueError(f"a prompt needs at least {lookahead} speech tokens")
        if prompt_mel.shape[1] != ratio * prompt_tokens.shape[1]:
            raise ValueError(f"prompt mel has {prompt_mel.shape[1]} frames, expected {ratio} x "
                             f"{prompt_tokens.shape[1]} tokens")
        dtype = self.input_embedding.weight.dtype
        spks = self.speaker(xvector.to(dtype))
        tokens = torch.cat([prompt_tokens, prompt_tokens[:, :lookahead]], dim=1)
        h, encoder_cache = self.encoder.forward_chunk(self._embed(tokens), None, last=False)
        mu = self.encoder_proj(h)
        frames = mu.shape[1]
        mel, estimator_cache = self.decoder.solve_chunk(self.noise(0, frames).to(mu), mu.transpose(1, 2), spks,
                                                        prompt_mel.to(dtype).transpose(1, 2), None)
        return PromptCache(spks, encoder_cache, estimator_cache, frames, mel, mu)

    @torch.inference_mode()
    def chunk(self, tokens: torch.Tensor, state: FlowState, last: bool) -> tuple[torch.Tensor, torch.Tensor,
                                                                                 FlowState]:
        """tokens (1, n): the chunk's tokens (a non-final chunk's last `lookahead` are context only)
        -> mu (1, C, 80), mel (1, 80, C), next state (estimator K/V already trimmed to the window).

        C = 2 (n - lookahead), or 2 n for the last chunk. The noise is the fixed buffer at the offset equal to
        the cached K/V length (the reference's rule; it stops advancing once the window is full).
        """
        return self.chunks([tokens], [state], [last])[0]

    @torch.inference_mode()
    def chunks(self, tokens: Sequence[torch.Tensor], states: Sequence[FlowState],
               lasts: Sequence[bool]) -> list[tuple[torch.Tensor, torch.Tensor, FlowState]]:
        """`chunk` for several streams: the encoder runs per stream (it is small and its rows are ragged in
        both chunk and cache length), the ODE for all of them in one estimator batch per step."""
        encoded = []
        for chunk_tokens, state, last in zip(tokens, states, lasts):
            h, encoder_cache = self.encoder.forward_chunk(self._embed(chunk_tokens), state.encoder, last)
            encoded.append((self.encoder_proj(h), encoder_cache))
        noises = [self.noise(state.estimator.frames, mu.shape[1]).to(mu) for state, (mu, _) in zip(states, encoded)]
        solved = self.decoder.solve_chunks(noises, [mu.transpose(1, 2) for mu, _ in encoded],
                                           torch.cat([state.prompt.spks for state in states]),
                                           [state.estimator for state in states])
        out = []
        for state, (mu, encoder_cache), (mel, estimator_cache) in zip(states, encoded, solved):
            window = estimator_cache.trimmed(state.prompt.prompt_frames, self.config.solver.window_extra_frames)
            out.append((mu, mel, FlowState(state.prompt, encoder_cache, window)))
        return out
