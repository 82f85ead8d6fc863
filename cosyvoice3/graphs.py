"""CUDA graphs of CosyVoice3's batched flow step (`cosyvoice3.token2wav.batched_solve`), in padded shape buckets.

Eagerly, one estimator pass of the DiT (22 blocks) is several hundred small kernel launches and a chunk runs ten
of them, so a call of a few streaming rows mostly waits for the host. A call is therefore padded to a bucket of
(rows, new frames, history frames), with the conv position embedding's context always its full receptive field,
and each of its ten Euler steps replays the one graph captured for that bucket: the step's inputs (the ODE state
with its context frames, t, and the rows' cached keys/values of that step) are copied into the bucket's static
buffers first, and the Euler update itself runs eagerly on the graph's velocity (with the step's float dt, as the
eager path computes it).

One graph per bucket replayed ten times, not one graph of the whole solve: a graph reads fixed addresses, so every
row's cached keys/values are copied into static buffers either way; a whole-solve graph would hold all ten steps'
at once (ten times the memory) to save nine replays.

Padding is exact (what `batched_solve` already guarantees for rows of different sizes): padded history frames are
masked as keys, padded new frames are never keys of a real frame, the conv reads zeros on a row's left padding
(`valid`), and a padded row (every frame real, no history, full attention) never mixes with real ones. Stale values
in the static buffers are masked or never read back, so they are not cleared between calls (they are always finite:
they come from earlier calls' real computations or zeros).

Every bucket's static tensors are views of buffers all buckets share (one solve holds the lock at a time): the
keys/values the rows' histories are staged into, one buffer sized for the most rows and the longest history, depth
x 2 x 2 rows x heads x history x head dim, i.e. 22 x 2 x 2 x 1024 values per row and history frame at the released
size (176 KiB in bf16: 16 rows x 2048 frames take 5.5 GiB); and the float inputs (window, mu, cond) and outputs
(velocity, the new frames' keys/values) as prefix views of one flat buffer each, sized for the largest bucket (the
new keys/values of 16 rows x 864 frames: 2.3 GiB in bf16). Outputs owned by each graph would instead stay alive
for every bucket: 40.6 GiB in bf16 over the 120 served buckets. `StaticPlan` computes these sizes from the
configuration alone (the engine logs it at start-up). Calls outside every bucket (more rows, longer chunks or
histories: the final chunks and offline jobs, whole calls, mostly) run eagerly.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Iterable, Optional, Sequence

import torch

from cosyvoice2.dit.graphs import HopSchedule
from speech_lm.graph_buckets import SolverStepGraphs, attention_cost, costliest_first, fit, round_up

from .config import DiTConfig
from .dit import DiT

Shape = tuple[int, int, int]  # (rows, new frames, history frames)

#: the most rows (chunks) one replay serves; a call of more runs eagerly
ROW_BUCKETS = (1, 2, 4, 8, 16)
FRAME_STEP = 16  # new-frame buckets are multiples of this
#: history buckets (frames of cached keys/values: the prompt and the stream's complete chunks). Geometric: padding
#: the history costs only attention, so coarse buckets keep the number of graphs small.
HISTORY_BUCKETS = (256, 512, 1024, 2048)
MAX_FRAMES = 1024  # the longest chunk (new frames) a bucket is made for


def chunk_frame_limits(schedule: HopSchedule, token_mel_ratio: int, chunk: int, max_frames: int = MAX_FRAMES,
                       max_chunks: int = 64, final_chunks: bool = False) -> list[int]:
    """Per chunk index, the most new frames a non-final cached chunk there solves (with `final_chunks`, a final
    one too), while at most `max_frames`.

    A chunk of hop h adds ratio x h frames to the stream and starts at its cache's last complete `chunk`-frame
    boundary, at most chunk - 1 frames before its earlier frames' end; the first chunk also computes the frames of
    the prompt's last `lookahead` tokens (the voice's cache stops before them: their features read the stream's
    first tokens). A final chunk holds the tokens left when the stream ends, fewer than a non-final chunk there
    would need (h + lookahead): up to lookahead - 1 tokens more than h."""
    limits = []
    extra = schedule.lookahead - 1 if final_chunks else 0
    for index in range(max_chunks):
        hop = schedule.hop(index)
        limit = token_mel_ratio * (hop + extra + (schedule.lookahead if index == 0 else 0)) + chunk - 1
        if limit > max_frames or (index >= 2 and hop == schedule.hop(index - 1)):
            break
        limits.append(limit)
    return limits


@dataclass(frozen=True)
class FlowGraphBuckets:
    rows: tuple[int, ...] = ROW_BUCKETS
    frames: tuple[int, ...] = ()
    history: tuple[int, ...] = HISTORY_BUCKETS

    @classmethod
    def covering(cls, schedules: Iterable[HopSchedule], token_mel_ratio: int, chunk: int,
                 rows: Sequence[int] = ROW_BUCKETS, history: Sequence[int] = HISTORY_BUCKETS,
                 max_frames: int = MAX_FRAMES, final_chunks: bool = False) -> "FlowGraphBuckets":
        """Buckets for every non-final chunk the schedules form (with `final_chunks`, every final chunk that
        continues a flow cache too), up to `max_frames` new frames: per chunk index the largest chunk over the
        schedules, rounded up (fewer graphs, at the price of padding smaller chunks)."""
        per_index: dict[int, int] = {}
        for schedule in schedules:
            for index, limit in enumerate(chunk_frame_limits(schedule, token_mel_ratio, chunk, max_frames,
                                                             final_chunks=final_chunks)):
                per_index[index] = max(per_index.get(index, 0), limit)
        frames = sorted({round_up(limit, FRAME_STEP) for limit in per_index.values()})
        return cls(tuple(sorted(rows)), tuple(frames), tuple(sorted(history)))

    def fit(self, rows: int, frames: int, history: int) -> Optional[Shape]:
        """The bucket a call is padded to, or None (it runs eagerly)."""
        return fit((rows, frames, history), (self.rows, self.frames, self.history))  # type: ignore[return-value]

    def shapes(self) -> list[Shape]:
        """Every bucket, the costliest first (`costliest_first`)."""
        return costliest_first((self.rows, self.frames, self.history), attention_cost)  # type: ignore[return-value]


def row_masks(start: torch.Tensor, count: torch.Tensor, streaming: torch.Tensor, context: int, frames: int,
              history: int, chunk: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per row its history length `start`, real new frames `count` and attention mode `streaming` (each (B,))
    -> valid (B, R + N, 1) bool: the row's context frames (right-aligned in the R) and real new frames, where the
    conv position embedding reads (zeros elsewhere, as an unpadded row's conv reads its zero padding); positions
    (B, N): the new frames' absolute positions (rotary angles); visible (B, 1, N, P + N) bool: which past keys
    (those below the row's history) and new keys (its real frames, and with the chunk mask those before the end of
    the querying frame's `chunk`-frame chunk, counted from the first prompt frame) each new frame sees. A padded
    query frame sees every real frame: an all-masked softmax row would give NaN, which reaches real frames through
    the padded frames' keys and values."""
    device = start.device
    steps = torch.arange(frames, device=device)
    positions = start[:, None] + steps[None, :]
    index = torch.arange(context + frames, device=device)[None, :]
    first = context - start.clamp(max=context)
    valid = (index >= first[:, None]) & (index < (context + count)[:, None])
    past_keys = torch.arange(history, device=device)[None, None, :] < start[:, None, None]  # (B, 1, P)
    real = steps[None, None, :] < count[:, None, None]  # (B, 1, N) the row's real frames
    chunk_end = (positions // chunk + 1) * chunk
    new_keys = real & (~streaming[:, None, None] | (positions[:, None, :] < chunk_end[:, :, None])
                       | ~real.transpose(1, 2))
    visible = torch.cat([past_keys.expand(-1, frames, -1), new_keys], dim=2)[:, None]
    return valid.unsqueeze(-1), positions, visible


def shared_shapes(config: DiTConfig, shape: Shape, context: int) -> dict[str, tuple[int, ...]]:
    """A bucket's float static tensors that all buckets share (each a prefix view of one flat buffer per name,
    `_SharedBuffers`): the inputs window, mu and cond, and the outputs velocity and keys/values."""
    rows, frames, _ = shape
    width = context + frames
    return {"window": (rows, config.mel_dim, width), "mu": (2 * rows, config.mu_dim, width),
            "cond": (2 * rows, config.mel_dim, width), "velocity": (2 * rows, config.mel_dim, frames),
            "keys_values": (config.depth, 2, 2 * rows, config.heads, frames, config.dim_head)}


_OUTPUTS = ("velocity", "keys_values")


def shared_sizes(config: DiTConfig, buckets: FlowGraphBuckets, context: int) -> dict[str, int]:
    """Elements of each shared flat buffer: its tensor of the largest bucket."""
    sizes: dict[str, int] = {}
    for shape in buckets.shapes():
        for name, dims in shared_shapes(config, shape, context).items():
            sizes[name] = max(sizes.get(name, 0), math.prod(dims))
    return sizes


def past_shape(config: DiTConfig, buckets: FlowGraphBuckets) -> tuple[int, ...]:
    """The shared buffer the rows' cached keys/values are staged into: depth x 2 x 2 rows x heads x history x dim_head
    for the most rows and the longest history (a bucket's is a slice of it)."""
    return (config.depth, 2, 2 * max(buckets.rows), config.heads, max(buckets.history), config.dim_head)


@dataclass(frozen=True)
class StaticPlan:
    """Bytes a set of step graphs holds outside its CUDA graph pool once every bucket is captured; computed from
    the configuration alone (the buffers are allocated from the same shapes). The pool adds one pass's
    intermediates: buckets are captured costliest first, so about the largest bucket's."""

    past: int  # the staged history keys/values
    inputs: int  # the shared window, mu and cond
    outputs: int  # the shared velocity and new keys/values

    @classmethod
    def of(cls, config: DiTConfig, buckets: FlowGraphBuckets, context: int, dtype: torch.dtype) -> "StaticPlan":
        sizes = shared_sizes(config, buckets, context)
        size = dtype.itemsize
        return cls(past=math.prod(past_shape(config, buckets)) * size,
                   inputs=sum(n for name, n in sizes.items() if name not in _OUTPUTS) * size,
                   outputs=sum(sizes[name] for name in _OUTPUTS) * size)

    @property
    def total(self) -> int:
        return self.past + self.inputs + self.outputs

    def describe(self) -> str:
        gib = 2**30
        return (f"{self.total / gib:.2f} GiB (history keys/values {self.past / gib:.2f}, outputs "
                f"{self.outputs / gib:.2f}, inputs {self.inputs / gib:.2f})")


class _SharedBuffers:
    """The static tensors every bucket of one device and dtype shares: the history keys/values (`past`, sliced per
    bucket) and one flat buffer per float input and output, each bucket's tensor a prefix view of it. Sharing is
    safe because one solve holds the lock at a time, fills every input it reads, and copies a replay's outputs out
    before the next replay; the tiny per-row tensors (t, speaker, history lengths, counts, modes) stay per bucket."""

    def __init__(self, config: DiTConfig, buckets: FlowGraphBuckets, context: int, device: torch.device,
                 dtype: torch.dtype) -> None:
        self.device, self.dtype = device, dtype
        self.past = torch.zeros(past_shape(config, buckets), device=device, dtype=dtype)
        self.flat = {name: torch.zeros(size, device=device, dtype=dtype)
                     for name, size in shared_sizes(config, buckets, context).items()}

    def view(self, name: str, shape: Sequence[int]) -> torch.Tensor:
        return self.flat[name][:math.prod(shape)].view(*shape)

    def nbytes(self) -> int:
        return sum(tensor.nbytes for tensor in (self.past, *self.flat.values()))


@dataclass(eq=False)
class StepInputs:
    """The inputs of one estimator pass over a padded batch of B rows (N new frames, R context frames, P history
    frames): a graph's static buffers, or a call's own tensors when it runs eagerly. Conditional rows first, then
    unconditional ones (the stacked CFG batch). Per row only its history length, real new frames and attention
    mode are given: the pass derives validity, positions and masks from them (`row_masks`; no mask buffers)."""

    window: torch.Tensor  # (B, 80, R + N) the ODE state: each row's context frames (right-aligned), then its new ones
    t: torch.Tensor  # (2B,)
    mu: torch.Tensor  # (2B, 80, R + N)
    cond: torch.Tensor  # (2B, 80, R + N)
    spks: torch.Tensor  # (2B, 80)
    start: torch.Tensor  # (2B,) int64: the row's history frames (its first new frame's position)
    count: torch.Tensor  # (2B,) int64: the row's real new frames
    streaming: torch.Tensor  # (2B,) bool: the chunk mask (else full attention)
    past: Optional[torch.Tensor]  # (depth, 2, 2B, H, P, dim_head): per block keys then values; None when P = 0
    context: int  # R
    history: int  # P

    @classmethod
    def static(cls, config: DiTConfig, shape: Shape, context: int, buffers: _SharedBuffers) -> "StepInputs":
        """A bucket's static inputs on the shared buffers, zeroed: every new frame real, no history, full attention
        (a capture's warm-up on them is finite)."""
        rows, frames, history = shape
        views = shared_shapes(config, shape, context)
        window, mu, cond = (buffers.view(name, views[name]).zero_() for name in ("window", "mu", "cond"))
        past = buffers.past[:, :, :2 * rows, :, :history] if history else None
        device, dtype = buffers.device, buffers.dtype
        start = torch.zeros(2 * rows, dtype=torch.long, device=device)
        return cls(window, torch.zeros(2 * rows, device=device, dtype=dtype), mu, cond,
                   torch.zeros(2 * rows, config.spk_dim, device=device, dtype=dtype), start, start + frames,
                   torch.zeros(2 * rows, dtype=torch.bool, device=device), past, context, history)

    def run(self, estimator: DiT, out: Optional[tuple[torch.Tensor, torch.Tensor]] = None
            ) -> tuple[torch.Tensor, torch.Tensor]:
        """One estimator pass (static shapes, no host syncs: what a graph captures) -> the velocity (2B, 80, N) and
        the new frames' keys/values (depth, 2, 2B, H, N, dim_head), written into `out` when given (a bucket's
        output views of the shared buffers)."""
        depth = len(estimator.transformer_blocks)
        frames = self.window.shape[2] - self.context
        valid, positions, visible = row_masks(self.start, self.count, self.streaming, self.context, frames,
                                              self.history, estimator.config.static_chunk_size)
        past = ([(self.past[b, 0], self.past[b, 1]) for b in range(depth)] if self.past is not None
                else [None] * depth)
        velocity, keys_values = estimator.forward_rows(torch.cat([self.window, self.window]), self.mu, self.t,
                                                       self.spks, self.cond, valid.to(self.mu.dtype), positions,
                                                       visible, past, None if out is None else out[1])
        if out is None:
            return velocity, keys_values
        out[0].copy_(velocity)
        return out


_StepOutputs = tuple[torch.Tensor, torch.Tensor]  # views of the shared output buffers


class FlowStepGraphs(SolverStepGraphs[StepInputs, _StepOutputs, _SharedBuffers]):
    """The captured estimator passes of one CosyVoice3 flow, per bucket, and their static buffers (shared by all
    buckets: `_SharedBuffers`; what they hold is `plan`).

    `lock` is held by a whole `batched_solve` call (static buffers, and graph outputs that the next replay
    overwrites). `emulate` (tests): pad calls to the buckets and fill the static buffers on any device, running each
    pass eagerly instead of replaying."""

    buckets: FlowGraphBuckets

    def __init__(self, estimator: DiT, buckets: FlowGraphBuckets) -> None:
        super().__init__(buckets)
        self._estimator = [estimator]  # a list, so the module is not registered as a child
        self.context = estimator.input_embed.conv_pos_embed.receptive_field

    def plan(self, dtype: torch.dtype) -> StaticPlan:
        """What the shared static buffers of these buckets hold in `dtype` (allocated at the first capture or
        emulated call)."""
        return StaticPlan.of(self._estimator[0].config, self.buckets, self.context, dtype)

    def static_bytes(self) -> int:
        """Bytes of the shared static buffers (0 before the first capture or emulated call)."""
        return 0 if self._buffers is None else self._buffers.nbytes()

    def inputs(self, shape: Shape, like: torch.Tensor) -> StepInputs:
        """The static inputs of `shape` on `like`'s device and dtype (created when emulating)."""
        return self._entry(shape, like.device, like.dtype, capture_graph=False).inputs

    def run(self, shape: Shape) -> _StepOutputs:
        """One pass on the static inputs of `shape` (filled by the caller, who holds `lock`): replayed, or run eagerly
        when emulating. The outputs are views of buffers every bucket shares: valid until the next pass of any
        bucket."""
        return self._replay(self._captured[shape])

    def _allocate(self, device: torch.device, dtype: torch.dtype) -> _SharedBuffers:
        return _SharedBuffers(self._estimator[0].config, self.buckets, self.context, device, dtype)

    def _placement(self, buffers: _SharedBuffers) -> tuple[torch.device, torch.dtype]:
        return buffers.device, buffers.dtype

    def _static(self, shape: Shape, buffers: _SharedBuffers) -> tuple[StepInputs, _StepOutputs]:
        """The bucket's inputs and outputs, views of the shared buffers (and its own tiny per-row tensors)."""
        config = self._estimator[0].config
        inputs = StepInputs.static(config, shape, self.context, buffers)
        views = shared_shapes(config, shape, self.context)
        return inputs, (buffers.view("velocity", views["velocity"]), buffers.view("keys_values", views["keys_values"]))

    def _pass(self, inputs: StepInputs, outputs: Optional[_StepOutputs]) -> Callable[[], _StepOutputs]:
        estimator = self._estimator[0]
        return lambda: inputs.run(estimator, outputs)
