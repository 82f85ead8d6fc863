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
from contextlib import nullcontext
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING, Optional, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from cosyvoice2.host_copies import to_device

from .config import DiTEstimatorConfig, DiTFlowConfig
from .encoder import EncoderCache, UpsampleConformerEncoderV2
from .estimator import DiT

if TYPE_CHECKING:
    from .graphs import DiTStepGraphs


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

    def time_steps(self, device: torch.device, dtype: torch.dtype) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(t, dt) of each Euler step, with the reference's bookkeeping (t advanced by dt, dt re-derived from the
        grid), as 0-d tensors: every solver path uses these very values."""
        grid = time_grid(self.solver.n_timesteps, device, dtype)
        t, dt = grid[0], grid[1] - grid[0]
        out = []
        for step in range(1, len(grid)):
            out.append((t, dt))
            t = t + dt
            if step < len(grid) - 1:
                dt = grid[step + 1] - t
        return out

    def _euler(self, x: torch.Tensor, step_fn) -> torch.Tensor:
        for step, (t, dt) in enumerate(self.time_steps(x.device, x.dtype)):
            x = x + dt * step_fn(step, x, t)
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
                     caches: Sequence[EstimatorCache],
                     graphs: Optional["DiTStepGraphs"] = None) -> list[tuple[torch.Tensor, EstimatorCache]]:
        """One chunk of each of several streams in one estimator batch per ODE step.

        noises[i], mus[i]: (1, 80, C_i); spks (B, 80); caches[i] the stream's cache (C_i and cache lengths may
        differ). Rows are right-padded and masked: a padded chunk frame is never a key, a padded cache frame
        never attended, and each row's conv context ends at its own last frame, so every stream gets what
        `solve_chunk` gives it alone (up to float rounding). Conditional rows first, then unconditional.

        `graphs`: when the call fits one of their buckets, each step is padded to it and replayed from a CUDA
        graph (or, emulated, run on their static buffers); otherwise the call runs eagerly at its own size.
        """
        padded = self.pad_chunks(noises, mus, spks, caches, graphs)
        if padded.graphs is None and len(noises) == 1:
            return [self.solve_chunk(noises[0], mus[0], spks, torch.zeros_like(mus[0]), caches[0])]
        with padded.locked():
            return self._solve_padded(padded)

    def pad_chunks(self, noises: Sequence[torch.Tensor], mus: Sequence[torch.Tensor], spks: torch.Tensor,
                   caches: Sequence[EstimatorCache], graphs: Optional["DiTStepGraphs"]) -> "PaddedChunks":
        """The chunks' step-invariant inputs, padded to the bucket of `graphs` they fit (then replayed), else to
        their own largest sizes (then run eagerly)."""
        frames, cached = max(n.shape[2] for n in noises), max(c.frames for c in caches)
        shape = None if graphs is None else graphs.bucket(len(noises), frames, cached, noises[0])
        return PaddedChunks.build(noises, mus, spks, caches, shape or (len(noises), frames, cached),
                                  graphs if shape is not None else None)

    def step_padded(self, padded: "PaddedChunks", steps: Sequence[int], x: torch.Tensor, t: torch.Tensor,
                    dt: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """One Euler step of padded chunks, stream i at Euler step steps[i] (its caches of that step): replayed,
        or eagerly on fresh buffers. t, dt: 0-d (every row) or one per stream. The outputs of a replay are valid
        until the next one: the caller holds `padded.locked()` and copies them out."""
        if padded.graphs is not None:
            return padded.graphs.run(padded.shape, padded, steps, x, t, dt)
        inputs = StepInputs.zeros(self.estimator.config, padded.shape, x)
        return self.padded_step(*padded.fill(inputs, steps, x, t, dt).args())

    def _solve_padded(self, padded: "PaddedChunks") -> list[tuple[torch.Tensor, EstimatorCache]]:
        """The Euler loop over padded chunks in lock step; each step's outputs are copied out at once (a graph's
        outputs and static buffers are overwritten by its next replay)."""
        x = padded.noise
        convs: list[torch.Tensor] = []
        kvs: list[list[torch.Tensor]] = [[] for _ in padded.caches]
        for step, (t, dt) in enumerate(self.time_steps(x.device, x.dtype)):
            x, conv, own = self.step_padded(padded, [step] * len(padded.caches), x, t, dt)
            convs.append(conv.clone())
            for i, cache in enumerate(padded.caches):
                rows = padded.rows_of(i)
                kvs[i].append(torch.cat([own[:, rows, :, : padded.frames[i]], cache.kv[step]], dim=3))
        out = []
        for i, kv in enumerate(kvs):
            conv = torch.stack([c[:, padded.rows_of(i)] for c in convs])
            out.append((x[i : i + 1, :, : padded.frames[i]].clone(), EstimatorCache(conv, torch.stack(kv))))
        return out

    def padded_step(self, x: torch.Tensor, t: torch.Tensor, dt: torch.Tensor, mu: torch.Tensor, spks: torch.Tensor,
                    conv: torch.Tensor, kv_slots: torch.Tensor, key_mask: torch.Tensor,
                    lengths: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """One Euler step of a padded batch of chunks: what a CUDA graph captures (static shapes, no host syncs).

        x, mu (Bp, 80, Cp); t, dt (Bp,) per row; spks (Bp, 80); this step's caches, conditional rows then
        unconditional: conv (depth, 2 Bp, 2 C, k - 1) and kv_slots (depth, 2 Bp, H, Cp + Tp, 2 D) (the K/V behind
        Cp free frames, `DiT.forward_chunk`); key_mask (2 Bp, 1, 1, Cp + Tp); lengths (2 Bp,) real chunk frames
        -> x after the step, the new conv caches, the chunk's keys/values (a view of kv_slots)."""
        rows = x.shape[0]
        mu2 = torch.cat([mu, torch.zeros_like(mu)])
        velocity, new_conv, own = self.estimator.forward_chunk(
            torch.cat([x, x]), mu2, torch.cat([t, t]), torch.cat([spks, torch.zeros_like(spks)]),
            torch.zeros_like(mu2), conv, None, key_mask, lengths, kv_slots)
        return x + dt[:, None, None] * self._guided(velocity, rows), new_conv, own


@dataclass(eq=False)
class StepInputs:
    """The inputs of one `ConditionalCFM.padded_step` (a graph's static buffers, or fresh ones for an eager step)."""

    x: torch.Tensor  # (Bp, 80, Cp)
    t: torch.Tensor  # (Bp,)
    dt: torch.Tensor  # (Bp,)
    mu: torch.Tensor  # (Bp, 80, Cp)
    spks: torch.Tensor  # (Bp, 80)
    conv: torch.Tensor  # (depth, 2 Bp, 2 C, k - 1)
    kv: torch.Tensor  # (depth, 2 Bp, H, Cp + Tp, 2 D): chunk slots, then the cache
    key_mask: torch.Tensor  # (2 Bp, 1, 1, Cp + Tp) bool
    lengths: torch.Tensor  # (2 Bp,) int64

    def args(self) -> tuple[torch.Tensor, ...]:
        return (self.x, self.t, self.dt, self.mu, self.spks, self.conv, self.kv, self.key_mask, self.lengths)

    @classmethod
    def zeros(cls, config: DiTEstimatorConfig, shape: tuple[int, int, int], like: torch.Tensor,
              conv: Optional[torch.Tensor] = None, kv: Optional[torch.Tensor] = None) -> "StepInputs":
        """Zeroed inputs of a (rows, chunk frames, cache frames) shape, with every chunk frame real (a step over
        them is finite: a capture's warm-up runs on these); conv and kv: given buffers (views) to use instead."""
        rows, frames, cached = shape
        mel, depth, heads = config.out_channels, config.depth, config.num_heads
        if conv is None:
            conv = like.new_zeros(depth, 2 * rows, 2 * config.hidden_size, config.conv_kernel - 1)
        if kv is None:
            kv = like.new_zeros(depth, 2 * rows, heads, frames + cached, 2 * config.head_dim)
        return cls(like.new_zeros(rows, mel, frames), like.new_zeros(rows), like.new_zeros(rows),
                   like.new_zeros(rows, mel, frames), like.new_zeros(rows, mel), conv, kv,
                   torch.ones(2 * rows, 1, 1, frames + cached, dtype=torch.bool, device=like.device),
                   torch.full((2 * rows,), frames, dtype=torch.long, device=like.device))


@dataclass(eq=False)
class PaddedChunks:
    """The step-invariant padded inputs of a set of chunks (one `solve_chunks` call) at their (rows, chunk frames,
    cache frames) shape.

    Padded rows have every chunk frame real and no cache (finite, and never read back); padded frames of real
    rows are zeros and masked as keys; a row's conv context is taken at its own last frame (`lengths`)."""

    shape: tuple[int, int, int]
    graphs: Optional["DiTStepGraphs"]  # the step graphs `shape` is a bucket of, or None (eager)
    frames: list[int]
    caches: Sequence[EstimatorCache]
    noise: torch.Tensor  # (Bp, 80, Cp) the ODE's start
    mu: torch.Tensor  # (Bp, 80, Cp)
    spks: torch.Tensor  # (Bp, 80)
    key_mask: torch.Tensor  # (2 Bp, 1, 1, Cp + Tp)
    lengths: torch.Tensor  # (2 Bp,)

    @classmethod
    def build(cls, noises: Sequence[torch.Tensor], mus: Sequence[torch.Tensor], spks: torch.Tensor,
              caches: Sequence[EstimatorCache], shape: tuple[int, int, int],
              graphs: Optional["DiTStepGraphs"] = None) -> "PaddedChunks":
        rows_p, frames_p, cached_p = shape
        batch, device = len(noises), noises[0].device
        frames = [n.shape[2] for n in noises]
        padded = partial(_padded, rows=rows_p, frames=frames_p)
        lengths = frames + [frames_p] * (rows_p - batch)
        cached = [c.frames for c in caches] + [0] * (rows_p - batch)
        lengths_t = to_device(lengths + lengths, device)
        cached_t = to_device(cached + cached, device)
        chunk_real = torch.arange(frames_p, device=device)[None, :] < lengths_t[:, None]
        cache_real = torch.arange(cached_p, device=device)[None, :] < cached_t[:, None]
        key_mask = torch.cat([chunk_real, cache_real], dim=1)[:, None, None, :]
        return cls(shape, graphs, frames, caches, padded(noises), padded(mus),
                   F.pad(spks, (0, 0, 0, rows_p - batch)), key_mask, lengths_t)

    def stack(self, items: Sequence[torch.Tensor]) -> torch.Tensor:
        """Per stream (1, 80, C_i) -> (Bp, 80, Cp), zero-padded."""
        return _padded(items, rows=self.shape[0], frames=self.shape[1])

    def locked(self):
        """The context a step's fill, replay and copy-out run in: the graphs' lock (static buffers)."""
        return self.graphs.lock if self.graphs is not None else nullcontext()

    def rows_of(self, index: int) -> slice:
        """Stream `index`'s conditional and unconditional rows (index and Bp + index) as one strided slice."""
        return slice(index, index + self.shape[0] + 1, self.shape[0])

    def fill(self, inputs: StepInputs, steps: Sequence[int], x: torch.Tensor, t: torch.Tensor,
             dt: torch.Tensor) -> StepInputs:
        """Write a step's inputs into `inputs`: the ODE state x (Bp, 80, Cp), t and dt (0-d, or one per stream),
        each stream's caches of its Euler step steps[i]; the frames and rows behind the real ones keep whatever
        they hold (masked, never read back)."""
        rows_p, frames_p = self.shape[:2]
        inputs.x.copy_(x)
        inputs.t.copy_(t.expand(rows_p) if t.dim() == 0 else F.pad(t, (0, rows_p - t.shape[0])))
        inputs.dt.copy_(dt.expand(rows_p) if dt.dim() == 0 else F.pad(dt, (0, rows_p - dt.shape[0])))
        inputs.mu.copy_(self.mu)
        inputs.spks.copy_(self.spks)
        inputs.key_mask.copy_(self.key_mask)
        inputs.lengths.copy_(self.lengths)
        for i, cache in enumerate(self.caches):
            rows = self.rows_of(i)
            inputs.conv[:, rows].copy_(cache.conv[steps[i]])
            inputs.kv[:, rows, :, frames_p : frames_p + cache.frames].copy_(cache.kv[steps[i]])
        return inputs


def _padded(items: Sequence[torch.Tensor], rows: int, frames: int) -> torch.Tensor:
    """(1, C, T_i) per stream -> (rows, C, frames): zeros after each item and in the rows behind them."""
    stacked = torch.cat([F.pad(item, (0, frames - item.shape[2])) for item in items])
    return F.pad(stacked, (0, 0, 0, 0, 0, rows - len(items)))


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
    def chunks(self, tokens: Sequence[torch.Tensor], states: Sequence[FlowState], lasts: Sequence[bool],
               graphs: Optional["DiTStepGraphs"] = None) -> list[tuple[torch.Tensor, torch.Tensor, FlowState]]:
        """`chunk` for several streams: the encoder runs per stream (it is small and its rows are ragged in
        both chunk and cache length), the ODE for all of them in one estimator batch per step (replayed from
        `graphs` when the call fits one of their buckets)."""
        encoded, noises = self._encode(tokens, states, lasts)
        solved = self.decoder.solve_chunks(noises, [mu.transpose(1, 2) for mu, _ in encoded],
                                           torch.cat([state.prompt.spks for state in states]),
                                           [state.estimator for state in states], graphs)
        out = []
        for state, (mu, encoder_cache), (mel, estimator_cache) in zip(states, encoded, solved):
            out.append((mu, mel, self._next_state(state, encoder_cache, estimator_cache)))
        return out

    def _encode(self, tokens: Sequence[torch.Tensor], states: Sequence[FlowState], lasts: Sequence[bool],
                ) -> tuple[list[tuple[torch.Tensor, EncoderCache]], list[torch.Tensor]]:
        """Each chunk's encoder pass (mu (1, C, 80), next encoder cache) and its ODE start: the fixed noise at the
        offset equal to the stream's cached K/V length."""
        encoded = []
        for chunk_tokens, state, last in zip(tokens, states, lasts):
            h, encoder_cache = self.encoder.forward_chunk(self._embed(chunk_tokens), state.encoder, last)
            encoded.append((self.encoder_proj(h), encoder_cache))
        noises = [self.noise(state.estimator.frames, mu.shape[1]).to(mu) for state, (mu, _) in zip(states, encoded)]
        return encoded, noises

    def _next_state(self, state: FlowState, encoder: EncoderCache, estimator: EstimatorCache) -> FlowState:
        window = estimator.trimmed(state.prompt.prompt_frames, self.config.solver.window_extra_frames)
        return FlowState(state.prompt, encoder, window)
