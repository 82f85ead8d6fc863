"""CUDA graphs of the DiT estimator's streaming step, in padded shape buckets.

Eagerly, one estimator evaluation of the DiT (16 blocks) is several hundred small kernel launches, and a chunk
runs ten of them: at a few streams the GPU mostly waits for the host. A streaming call (`ConditionalCFM.solve_chunks`)
is therefore padded to a bucket of (rows, chunk frames, cached K/V frames) and each Euler step replays the graph
of `ConditionalCFM.padded_step` captured for that bucket.

Why one graph per Euler step, replayed ten times, and not one graph of the whole ten-step solve: a graph reads its
inputs from fixed addresses, so every stream's caches must be copied into static buffers either way, and the copy
volume is the same (each step's K/V once). A whole-solve graph would need all ten steps' K/V in static buffers at
once - ten times the memory (at the released size in fp32 about 1.25 MiB per cached frame per stream, ~37 GiB for
16 streams with a 30 s prompt) - to save nine replays and a few small copies per step, which cost tens of
microseconds against a step's milliseconds.

Padding is exact: padded chunk frames and cache frames are masked as attention keys, every other layer is per
frame or causal (a padded frame lies after every real one), each row's conv context is taken at its own last real
frame, and padded rows never mix with real ones. Stale values in the static buffers are likewise masked or never
read back, so they are not cleared between calls.

The buckets cover the steady state of a chunk schedule (`DiTGraphBuckets.covering`): rows 1/2/4/8/16, per chunk
index the largest chunk (final or not) rounded up, and cached frames in steps up to the longest voice prompt plus
the K/V window (`DiTSolverConfig.window_extra_frames`). A call outside every bucket runs eagerly.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Iterable, Optional, Sequence

import torch

from speech_lm.graph_buckets import SolverStepGraphs, attention_cost, costliest_first, fit, round_up
from ..streaming import HopSchedule
from .flow import ConditionalCFM, PaddedChunks, StepInputs

if TYPE_CHECKING:
    from .config import DiTFlowConfig

Shape = tuple[int, int, int]  # (rows, chunk frames, cached K/V frames)

#: the largest number of chunks (streams) one replay serves; a larger call runs eagerly
ROW_BUCKETS = (1, 2, 4, 8, 16)
CHUNK_FRAME_STEP = 16  # chunk-frame buckets are multiples of this
CACHE_FRAME_STEP = 128  # cached-frame buckets: every this many frames


def chunk_frame_limits(schedule: HopSchedule, token_mel_ratio: int, max_chunks: int = 64) -> list[int]:
    """Per chunk index, the most mel frames a chunk there can have, until the hop stops changing.

    A non-final chunk of hop h yields ratio x h frames; a final chunk is what is left when fewer than
    h + lookahead tokens remain, so at most ratio x (h + lookahead - 1) frames - the larger of the two."""
    limits, previous = [], None
    for index in range(max_chunks):
        hop = schedule.hop(index)
        if index >= 2 and hop == previous:
            break
        limits.append(token_mel_ratio * (hop + schedule.lookahead - 1))
        previous = hop
    return limits


def max_prompt_frames() -> int:
    """Mel frames of the longest voice prompt the frontend accepts (a prompt cache holds this many K/V frames).

    Imported here, not at module level: the prompt frontend pulls in onnxruntime, which the flow itself never
    needs."""
    from ..frontend.features import MEL_HOP, MEL_SAMPLE_RATE
    from ..frontend.prompt import MAX_PROMPT_SECONDS

    return int(MAX_PROMPT_SECONDS * MEL_SAMPLE_RATE) // MEL_HOP


@dataclass(frozen=True)
class DiTGraphBuckets:
    rows: tuple[int, ...] = ROW_BUCKETS
    chunk_frames: tuple[int, ...] = ()
    cache_frames: tuple[int, ...] = ()

    @classmethod
    def covering(cls, schedules: Iterable[HopSchedule], config: "DiTFlowConfig", prompt_frames: int,
                 rows: Sequence[int] = ROW_BUCKETS) -> "DiTGraphBuckets":
        """Buckets for every chunk the schedules produce, with caches of prompts up to `prompt_frames` frames.

        A stream's cache holds its prompt's P frames, then P + the frames of its chunks so far, trimmed back to
        P + `window_extra_frames` once longer: a call never starts with more than that."""
        # one bucket per chunk index, for its largest chunk over all the schedules (e.g. the first hop of each
        # prompt length), not one per schedule: fewer graphs, at the price of padding the smaller first chunks
        per_index: dict[int, int] = {}
        for schedule in schedules:
            for index, limit in enumerate(chunk_frame_limits(schedule, config.token_mel_ratio)):
                per_index[index] = max(per_index.get(index, 0), limit)
        chunks = sorted({round_up(limit, CHUNK_FRAME_STEP) for limit in per_index.values()})
        longest_cache = prompt_frames + config.solver.window_extra_frames
        caches = tuple(range(CACHE_FRAME_STEP, round_up(longest_cache, CACHE_FRAME_STEP) + 1, CACHE_FRAME_STEP))
        return cls(tuple(sorted(rows)), tuple(chunks), caches)

    def fit(self, rows: int, frames: int, cached: int) -> Optional[Shape]:
        """The bucket a call is padded to, or None (it runs eagerly)."""
        return fit((rows, frames, cached), (self.rows, self.chunk_frames, self.cache_frames))  # type: ignore[return-value]

    def shapes(self) -> list[Shape]:
        """Every bucket, the costliest first (`costliest_first`)."""
        shapes = costliest_first((self.rows, self.chunk_frames, self.cache_frames), attention_cost)
        return shapes  # type: ignore[return-value]


_StepOutputs = tuple[torch.Tensor, torch.Tensor, torch.Tensor]


class DiTStepGraphs(SolverStepGraphs[StepInputs, _StepOutputs, tuple[torch.Tensor, torch.Tensor]]):
    """The captured step graphs of one `ConditionalCFM`, per bucket, and their static buffers.

    The K/V slots (depth, 2 x max rows, heads, max chunk + max cache frames, 2 x head dim) and the conv contexts
    are allocated once, for the largest bucket, and every bucket's inputs are views of them; all graphs share one
    memory pool. `lock` is held by a whole `solve_chunks` call (static buffers, and graph outputs that the next
    replay overwrites). `emulate` (tests): pad to the buckets and fill the static buffers on any device, running
    each step eagerly instead of replaying."""

    buckets: DiTGraphBuckets

    def __init__(self, cfm: ConditionalCFM, buckets: DiTGraphBuckets) -> None:
        super().__init__(buckets)
        self._cfm = [cfm]  # a list, so the module is not registered as a child

    def static_bytes(self) -> int:
        """Bytes of the shared static buffers (0 before the first capture or emulated call)."""
        return sum(t.numel() * t.element_size() for t in self._buffers or ())

    def run(self, shape: Shape, padded: PaddedChunks, steps: Sequence[int], x: torch.Tensor, t: torch.Tensor,
            dt: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """One step of a padded call in `shape` (stream i at Euler step steps[i]): fill the static inputs, replay
        (outputs valid until the next replay; the caller holds `lock` and copies them out at once)."""
        with self.lock:
            entry = self._entry(shape, x.device, x.dtype, capture_graph=False)
            padded.fill(entry.inputs, steps, x, t, dt)
            return self._replay(entry)

    # -- buffers and capture ------------------------------------------------------------------------------
    def _allocate(self, device: torch.device, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """The K/V slots and the conv contexts."""
        config = self._cfm[0].estimator.config
        rows = 2 * max(self.buckets.rows)
        frames = max(self.buckets.chunk_frames) + max(self.buckets.cache_frames)
        return (torch.zeros(config.depth, rows, config.num_heads, frames, 2 * config.head_dim,
                            device=device, dtype=dtype),
                torch.zeros(config.depth, rows, 2 * config.hidden_size, config.conv_kernel - 1,
                            device=device, dtype=dtype))

    def _placement(self, buffers: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.device, torch.dtype]:
        return buffers[0].device, buffers[0].dtype

    def _static(self, shape: Shape, buffers: tuple[torch.Tensor, torch.Tensor]) -> tuple[StepInputs, None]:
        """Views of the K/V slots and conv contexts, and the bucket's own small tensors; the outputs are the
        captured step's."""
        kv, conv = buffers
        rows, frames, cached = shape
        config = self._cfm[0].estimator.config
        return StepInputs.zeros(config, shape, kv.new_empty(0), conv=conv[:, : 2 * rows],
                                kv=kv[:, : 2 * rows, :, : frames + cached]), None

    def _pass(self, inputs: StepInputs, outputs: Optional[_StepOutputs]) -> Callable[[], _StepOutputs]:
        cfm = self._cfm[0]
        return lambda: cfm.padded_step(*inputs.args())
