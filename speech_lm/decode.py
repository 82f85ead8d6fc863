"""Token decoding for any ``SpeechLM``: a continuous-batching decoder and a per-request token iterator.

A request (``DecodeRequest``) is model-neutral: the model's package builds its ``prefix`` (whatever the model's
``embed_prefix`` turns into input embeddings: token ids, several id segments, ...) and chooses its sampling
parameters and length limits; the stop ids are the model's (``SpeechLM.vocabulary``). Rules:
- the prefix is embedded by ``model.embed_prefix`` and prefilled; each emitted token is fed back through
  ``model.embed_speech``;
- while fewer than ``min_tokens`` tokens were emitted, the log-prob of ``vocabulary.masked_below_min`` is set to
  -inf before sampling (only that stop id);
- any stop id ends the request and is never emitted; at ``max_tokens`` emitted tokens it ends too
  (``ignore_eos``: no stop id is ever drawn, the request runs to ``max_tokens``; benchmark mode for random weights).

``BatchedDecoder`` API (what the Triton PyTorch LLM backends drive)::

    decoder = BatchedDecoder(model, num_slots=8, max_seq_len=2048)
    slot = decoder.add(DecodeRequest(prefix, SamplingParams(top_p=0.8, seed=7), max_tokens=500))   # prefill
    slots = decoder.add_many([request_a, request_b])   # several prefills in one forward, slots in request order
    while decoder.active_slots:
        for slot, out in decoder.step().items():   # one batched forward over all slots
            if out.token is not None: ...           # new token of that request
            if out.finished: ...                    # slot is already free again (out.reason: "stop" | "length")
    decoder.remove(slot)                            # cancel a running request

- ``add`` raises ``NoFreeSlotError`` when all slots are busy, ``ValueError`` when the request cannot fit
  (``len(prefix) + max_tokens > max_seq_len``); ``required_seq_len(request)`` gives the needed length. ``add_many``
  raises the same errors before prefilling anything (all or nothing). Its prefixes are right-padded to the longest
  and run as one causal forward; each row's log-probs and cache entries equal a solo prefill's up to float
  rounding (GEMM and attention blocking differ with the batch shape).
- Requests may be added between any two ``step`` calls (continuous batching); each keeps its own sampling state
  and ``torch.Generator`` (seeded by ``SamplingParams.seed``), so its tokens do not depend on its neighbours.
- ``step`` samples every active slot from its pending log-probs (``decoder.logp[slot]``, the distribution for the
  next token) and feeds the new tokens back: one forward of shape ``[rows, 1]`` at per-slot positions over the
  static KV cache, where ``rows`` is the smallest batch bucket covering the highest active slot (free rows in
  between carry junk that a later prefill overwrites) and attention reads the smallest length bucket of the cache
  covering the longest sequence. Sampling runs on the device for all rows at once (``ras_draw``; the per-slot
  state lives in ``_SlotTable``), so a step costs one host sync, to read the tokens.
- On CUDA the whole step (sampling + forward) is captured once per (batch bucket, length bucket) in a CUDA graph
  at construction (``cuda_graphs=None`` means "on CUDA only"); replays launch it as one unit. The eager path runs
  the same code.
- With the graphs, a prefill is captured too, per (requests, prefix length) bucket (``PREFILL_ROWS`` x
  ``PREFILL_BUCKETS``, at most ``PREFILL_TOKENS`` positions a graph but always one request of any bucket):
  ``add_many`` replays one graph per group of requests, each prefix right-padded to the group's length bucket and
  the group to its row bucket (``padded_prefill``; a prefix's pad writes keys/values past the prefix, where every
  step's mask hides them until the step's own token overwrites them; padding rows write to a spare cache row that
  no request owns). Eagerly a prefill is launch-bound: ~330 kernels of ~1.4 ms GPU time took 16-19 ms of host time
  (released size, an H100 and an H200); replayed, 2.3 ms for one request, but one replay per request made 8
  waiting requests 14.7 ms against one batched eager pass's 13.4 (H200). A prefix longer than every bucket
  prefills eagerly.
- Not thread-safe: drive one decoder from one thread.
"""

from __future__ import annotations

import threading
import time
import weakref
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable, Iterator, Literal, Protocol, Sequence

import torch
from torch.nn.utils.rnn import pad_sequence

from speech_lm.config import OutputVocabulary
from speech_lm.graph_buckets import LLM_GRAPHS, capture_stream, on_device
from speech_lm.qwen2 import SpeechLM
from speech_lm.sampling import SamplingParams, draw_uniforms, make_generator, ras_draw, row_settings

BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64)
LENGTH_BUCKETS = (256, 512, 1024, 2048, 4096)
#: Prefix lengths of the prefill graphs. A CosyVoice2 prefix is its prompt transcript and target text plus the
#: prompt's speech tokens (25 per second of reference audio): ~200 for a 6 s voice, ~800 for 30 s.
PREFILL_BUCKETS = (64, 128, 192, 256, 320, 384, 448, 512, 640, 768, 896, 1024, 1280, 1536, 2048)
#: Requests per prefill graph: the requests waiting when the scheduler admits (a burst of new streams) prefill
#: together, a group padded up to the next count.
PREFILL_ROWS = (1, 2, 4, 8)
#: Positions (requests x prefix length bucket) of a multi-request prefill graph at most: bounds the activations the
#: graphs' memory pool holds (8 x 512, 4 x 1024, 2 x 2048).
PREFILL_TOKENS = 4096


class Prefix(Protocol):
    """A request's LLM input as its model's package builds it; only the model's ``embed_prefix`` reads it, the
    decoder needs its length in positions."""

    def __len__(self) -> int: ...


@dataclass(frozen=True)
class DecodeRequest:
    """One request: the model's prefix, how to sample, and its length limits in generated tokens.

    ``min_tokens``: the model's ``vocabulary.masked_below_min`` cannot be drawn before that many tokens.
    ``max_tokens``: the request ends after that many. ``ignore_eos``: no stop id is ever drawn (the request runs
    to ``max_tokens``; benchmark mode for random weights, which stop at random).
    """

    prefix: Prefix
    sampling: SamplingParams
    max_tokens: int
    min_tokens: int = 0
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        for name in ("min_tokens", "max_tokens"):
            value = getattr(self, name)
            if value < 0:
                raise ValueError(f"{name} must be >= 0, got {value}")

    @property
    def prefix_length(self) -> int:
        return len(self.prefix)


def required_seq_len(request: DecodeRequest) -> int:
    """KV-cache length a request needs: its prefix plus its maximum number of generated tokens."""
    return request.prefix_length + request.max_tokens


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
    """Host-side bookkeeping of one running request (what ``step`` reports needs no device reads)."""

    prefix_length: int
    max_len: int
    emitted: int = 0

    @property
    def next_position(self) -> int:
        return self.prefix_length + self.emitted


class _SlotTable:
    """Per-slot sampling state on the device, one row per slot, read by the batched step without host syncs.

    ``uniforms[slot, i]`` are the two uniforms of the slot's i-th draw, drawn at ``add`` from the request's
    generator; ``history[slot, :emitted]`` are its emitted ids (the RAS window reads them);
    ``stop_bias[slot, 0 or 1]`` is added to the log-probs of the stop ids before / after ``min_tokens`` tokens.
    """

    def __init__(self, num_slots: int, max_seq_len: int, vocabulary: OutputVocabulary, device: torch.device) -> None:
        self.vocabulary = vocabulary
        self._ints = torch.zeros(num_slots, 5, dtype=torch.long, device=device)
        self._floats = torch.zeros(num_slots, 2, device=device)
        self.emitted, self.prefix_len, self.min_len, self.top_k, self.win_size = self._ints.unbind(1)
        self.top_p, self.repeat_threshold = self._floats.unbind(1)
        self.history = torch.zeros(num_slots, max_seq_len, dtype=torch.long, device=device)
        self.uniforms = torch.zeros(num_slots, max_seq_len, 2, device=device)
        self.stop_bias = torch.zeros(num_slots, 2, len(vocabulary.stop_ids), device=device)

    def reset(self, slot: int, request: DecodeRequest, uniforms: torch.Tensor) -> None:
        vocabulary = self.vocabulary
        top_p, top_k, win_size, repeat_threshold = row_settings(request.sampling, vocabulary.size)
        self._ints[slot] = torch.tensor([0, request.prefix_length, request.min_tokens, top_k, win_size])
        self._floats[slot] = torch.tensor([top_p, repeat_threshold])
        self.uniforms[slot, : uniforms.shape[0]] = uniforms
        after_min = torch.full((self.stop_bias.shape[-1],), float("-inf") if request.ignore_eos else 0.0)
        before_min = after_min.clone()
        before_min[vocabulary.masked_below_min - vocabulary.stop_ids[0]] = float("-inf")
        self.stop_bias[slot] = torch.stack([before_min, after_min])


Shape = tuple[int, ...]  # decode step: (rows, kv_len); prefill: (prefix length bucket,)


class _Graphs:
    """One CUDA graph of a pass per shape, all sharing one memory pool (the decoder's passes run one at a time on
    one thread, so replays never overlap). Captured the largest shape first: a smaller one reuses its blocks."""

    def __init__(self, run: Callable[..., None], shapes: Sequence[Shape], device: torch.device, pool: object) -> None:
        self._graphs: dict[Shape, torch.cuda.CUDAGraph] = {}
        shapes = sorted(shapes, reverse=True)
        with on_device(device):  # the decoder's GPU, whichever is current (a model instance on GPU 1)
            side = torch.cuda.Stream(device)
            side.wait_stream(torch.cuda.current_stream(device))
            with torch.cuda.stream(side):  # warm-up outside capture: lazy inits (cuBLAS handles, attention plans)
                for shape in shapes:
                    run(*shape)
            torch.cuda.current_stream(device).wait_stream(side)
            for shape in shapes:
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool, stream=capture_stream(device, LLM_GRAPHS),
                                      capture_error_mode="thread_local"):
                    run(*shape)
                self._graphs[shape] = graph

    def replay(self, shape: Shape) -> None:
        self._graphs[shape].replay()


@dataclass(frozen=True)
class _PrefillInputs:
    """The static inputs of a padded prefill: per row a prefix's embeddings (right-padded), its slot and its last
    position; the rows past a group's requests (padding) write to the spare slot."""

    embeds: torch.Tensor  # [most rows, longest bucket, hidden]
    slots: torch.Tensor  # [most rows] long
    last: torch.Tensor  # [most rows] long
    spare: int  # the cache row that padding rows write to (no request's)


class BatchedDecoder:
    """Fixed number of KV-cache slots; one ``step`` advances every active request by one token."""

    def __init__(
        self,
        model: SpeechLM,
        num_slots: int,
        max_seq_len: int,
        cuda_graphs: bool | None = None,
        batch_buckets: Sequence[int] = BATCH_BUCKETS,
        length_buckets: Sequence[int] = LENGTH_BUCKETS,
        prefill_buckets: Sequence[int] = PREFILL_BUCKETS,
        padded_prefill: bool | None = None,
        prefill_rows: Sequence[int] = PREFILL_ROWS,
        prefill_tokens: int = PREFILL_TOKENS,
    ) -> None:
        """``padded_prefill``: prefill groups of requests padded to ``prefill_rows`` x ``prefill_buckets`` buckets
        (None: with the CUDA graphs, which capture it; True without them runs the same padded pass eagerly, e.g. to
        test it); a bucket of several rows holds at most ``prefill_tokens`` positions."""
        self.model = model
        self.num_slots = num_slots
        self.max_seq_len = max_seq_len
        self.device = model.llm_decoder.weight.device
        if cuda_graphs is None:
            cuda_graphs = self.device.type == "cuda"
        if padded_prefill is None:
            padded_prefill = cuda_graphs
        # a padded prefill's padding rows need a cache row (and a log-prob row) that no request owns
        spare_rows = 1 if padded_prefill else 0
        self.cache = model.new_cache(num_slots + spare_rows, max_seq_len)
        vocabulary = model.vocabulary
        self.logp = torch.zeros(num_slots + spare_rows, vocabulary.size, device=self.device)
        self.buckets = sorted({b for b in batch_buckets if b < num_slots} | {num_slots})
        self.length_buckets = sorted({b for b in length_buckets if b < max_seq_len} | {max_seq_len})
        self._stop_ids = vocabulary.stop_ids
        self._table = _SlotTable(num_slots, max_seq_len, vocabulary, self.device)
        self._tokens = torch.zeros(num_slots, dtype=torch.long, device=self.device)
        self._slots: dict[int, _SlotState] = {}
        #: of the last `step`, the host's wait for its tokens (the device's work its launch did not cover)
        self.last_step_sync_seconds = 0.0
        #: of the last `step`, its span on the device: CUDA events on the step's stream just before and after its
        #: launch, so the launch and the kernels count, with any slowdown by other streams' kernels, and earlier work
        #: of its own stream does not (0.0 off CUDA). Against `last_step_sync_seconds` and the microbenchmark's step
        #: it says whether the device ran the step slowly or began it late.
        self.last_step_device_seconds = 0.0
        self._step_events = ((torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
                             if self.device.type == "cuda" else None)
        self.prefill_buckets = sorted({min(b, max_seq_len) for b in prefill_buckets})  # no prefix is longer
        self.prefill_rows = sorted(set(prefill_rows) | {1})
        #: the (requests, prefix length) buckets of a padded prefill
        self.prefill_shapes = {(rows, n) for rows in self.prefill_rows for n in self.prefill_buckets
                               if rows == 1 or rows * n <= prefill_tokens}
        self._prefill: _PrefillInputs | None = None
        if padded_prefill:
            hidden = model.llm_decoder.weight.shape[-1]
            most = max(rows for rows, _ in self.prefill_shapes)
            self._prefill = _PrefillInputs(
                embeds=torch.zeros(most, self.prefill_buckets[-1], hidden, device=self.device,
                                   dtype=model.llm_decoder.weight.dtype),
                slots=torch.zeros(most, dtype=torch.long, device=self.device),
                last=torch.zeros(most, dtype=torch.long, device=self.device),
                spare=num_slots)
        self._graphs: _Graphs | None = None
        self._prefill_graphs: _Graphs | None = None
        if cuda_graphs:
            pool = torch.cuda.graph_pool_handle()
            with torch.inference_mode():
                self._graphs = _Graphs(self._advance, [(rows, kv_len) for rows in self.buckets
                                                       for kv_len in self.length_buckets], self.device, pool)
                if self._prefill is not None:
                    self._prefill_graphs = _Graphs(self._prefill_padded, sorted(self.prefill_shapes), self.device,
                                                   pool)

    @property
    def active_slots(self) -> list[int]:
        return sorted(self._slots)

    @property
    def free_slots(self) -> list[int]:
        return [s for s in range(self.num_slots) if s not in self._slots]

    def add(self, request: DecodeRequest) -> int:
        """Prefill ``request`` into a free slot and return the slot index."""
        return self.add_many([request])[0]

    @torch.inference_mode()
    def add_many(self, requests: Sequence[DecodeRequest]) -> list[int]:
        """Prefill several requests in one forward (prefixes right-padded to the longest) into free slots, lowest
        first; returns their slots in request order. All or nothing: raises before prefilling any request."""
        free = self.free_slots
        if len(requests) > len(free):
            raise NoFreeSlotError(f"{len(requests)} requests, {len(free)} of {self.num_slots} slots free")
        for request in requests:
            needed = required_seq_len(request)
            if needed > self.max_seq_len:
                raise ValueError(f"request needs {needed} cache positions, decoder has {self.max_seq_len}")
        if not requests:
            return []
        slots = free[: len(requests)]
        if self._prefill is not None and max(r.prefix_length for r in requests) <= self.prefill_buckets[-1]:
            start = 0
            while start < len(requests):
                count, shape = self._prefill_group(requests[start:])
                self._prefill_rows(slots[start : start + count], requests[start : start + count], shape)
                start += count
        else:
            prefixes = [self.model.embed_prefix(r.prefix)[0] for r in requests]
            hidden = self.model.hidden(pad_sequence(prefixes, batch_first=True), cache=self.cache, slots=slots)
            last = torch.tensor([r.prefix_length - 1 for r in requests], device=self.device)
            rows = torch.tensor(slots, device=self.device)
            self.logp[rows] = self.model.log_probs(hidden[torch.arange(len(requests), device=self.device), last])
        for slot, request in zip(slots, requests):
            # one uniform pair per possible draw, from the request's own generator (CPU: same numbers on any device)
            uniforms = draw_uniforms(request.max_tokens, make_generator(request.sampling.seed, "cpu"))
            self._table.reset(slot, request, uniforms.to(self.device))
            self._slots[slot] = _SlotState(prefix_length=request.prefix_length, max_len=request.max_tokens)
        return slots

    def _prefill_group(self, requests: Sequence[DecodeRequest]) -> tuple[int, Shape]:
        """How many of the first ``requests`` prefill together, and their (rows, prefix length) bucket: the most
        that one bucket holds (in order: each request keeps the slot ``add_many`` gave it)."""
        count = min(len(requests), self.prefill_rows[-1])
        while True:
            rows = self._bucket(self.prefill_rows, count)
            shape = (rows, self._bucket(self.prefill_buckets, max(r.prefix_length for r in requests[:count])))
            if shape in self.prefill_shapes:
                return count, shape
            count = self.prefill_rows[self.prefill_rows.index(rows) - 1]  # a smaller group (one always fits)

    def _prefill_rows(self, slots: Sequence[int], requests: Sequence[DecodeRequest], shape: Shape) -> None:
        """Prefill ``requests`` into ``slots`` through the static inputs: the bucket's graph, or the same pass
        eagerly. Small fills, no host syncs."""
        p = self._prefill
        assert p is not None
        rows, _ = shape
        for row, (slot, request) in enumerate(zip(slots, requests)):
            embeds = self.model.embed_prefix(request.prefix)[0]
            p.embeds[row, : embeds.shape[0]].copy_(embeds)
            p.slots[row].fill_(slot)
            p.last[row].fill_(embeds.shape[0] - 1)
        if rows > len(requests):  # padding rows: whatever embeddings earlier prefixes left (finite), the spare slot
            p.slots[len(requests) : rows].fill_(p.spare)
            p.last[len(requests) : rows].fill_(0)
        if self._prefill_graphs is not None:
            self._prefill_graphs.replay(shape)
        else:
            self._prefill_padded(*shape)

    def _prefill_padded(self, rows: int, length: int) -> None:
        """The prefill of the first ``rows`` rows of the static inputs over their first ``length`` positions: their
        keys/values into their cache slots, the log-probs at their last positions into ``logp``. Static shapes, no
        host syncs: what the prefill graphs capture. Positions past a prefix hold what earlier prefixes left
        (finite): causal attention keeps them out of the prefix's own positions."""
        p = self._prefill
        assert p is not None
        hidden = self.model.hidden(p.embeds[:rows, :length], cache=self.cache, slots=p.slots[:rows])
        last = p.last[:rows].view(rows, 1, 1).expand(rows, 1, hidden.shape[-1])
        self.logp.index_copy_(0, p.slots[:rows], self.model.log_probs(hidden.gather(1, last)[:, 0]))

    def remove(self, slot: int) -> None:
        """Drop a request (e.g. cancelled); its slot becomes free."""
        self._slots.pop(slot, None)

    def _advance(self, rows: int, kv_len: int) -> None:
        """Sample rows ``[0, rows)`` from ``logp``, record the tokens, feed them back (attending to the first
        ``kv_len`` cache positions) and refresh ``logp``.

        Static shapes and no host syncs: this is what the CUDA graphs capture.
        """
        t, r = self._table, slice(0, rows)
        emitted, last = t.emitted[r], self.max_seq_len - 1
        logp = self.logp[r].clone()
        # below the minimum length one stop id cannot be drawn; with ignore_eos none can (the ids are contiguous)
        below_min = (emitted < t.min_len[r]).unsqueeze(1)
        logp[:, self._stop_ids[0] : self._stop_ids[-1] + 1] += torch.where(below_min, *t.stop_bias[r].unbind(1))
        draw = emitted.clamp(max=last).view(rows, 1, 1).expand(rows, 1, 2)
        uniforms = t.uniforms[r].gather(1, draw).squeeze(1)
        tokens = ras_draw(logp, uniforms, t.history[r], emitted, t.top_p[r], t.top_k[r], t.win_size[r],
                          t.repeat_threshold[r])
        t.history[r].scatter_(1, emitted.clamp(max=last).unsqueeze(1), tokens.unsqueeze(1))
        positions = (t.prefix_len[r] + emitted).clamp(max=kv_len - 1)  # the new token's (free rows: junk)
        emitted.add_(1)
        self._tokens[r] = tokens
        embeds = self.model.embed_speech(tokens.unsqueeze(1))
        self.logp[r] = self.model(embeds, positions.unsqueeze(1), self.cache, kv_len=kv_len)[:, -1]

    @staticmethod
    def _bucket(buckets: Sequence[int], size: int) -> int:
        return next(b for b in buckets if b >= size)

    @torch.inference_mode()
    def step(self) -> dict[int, SlotOutput]:
        """Sample one token for every active slot, free finished slots, then feed the new tokens back."""
        outputs: dict[int, SlotOutput] = {}
        self.last_step_sync_seconds = self.last_step_device_seconds = 0.0  # a step that only frees slots: none
        for slot, state in list(self._slots.items()):
            if state.emitted >= state.max_len:  # max_len 0: finished before drawing anything
                outputs[slot] = SlotOutput(token=None, finished=True, reason="length")
                del self._slots[slot]
        if self._slots:
            rows = self._bucket(self.buckets, max(self._slots) + 1)
            kv_len = self._bucket(self.length_buckets, max(s.next_position for s in self._slots.values()) + 1)
            if self._step_events is not None:  # on the model's GPU's current stream, whichever GPU is current
                step_stream = torch.cuda.current_stream(self.device)
                self._step_events[0].record(step_stream)
            if self._graphs is not None:
                self._graphs.replay((rows, kv_len))
            else:
                self._advance(rows, kv_len)
            if self._step_events is not None:
                self._step_events[1].record(step_stream)
            launched = time.perf_counter()
            tokens = self._tokens[:rows].tolist()  # the step's one host sync
            self.last_step_sync_seconds = time.perf_counter() - launched
            if self._step_events is not None:  # both have run: the tokens are read after the step's last kernel
                self.last_step_device_seconds = self._step_events[0].elapsed_time(self._step_events[1]) / 1000.0
            for slot, state in list(self._slots.items()):
                outputs[slot] = self._report(slot, state, tokens[slot])
        return dict(sorted(outputs.items()))

    def _report(self, slot: int, state: _SlotState, token: int) -> SlotOutput:
        if token in self._stop_ids:
            del self._slots[slot]
            return SlotOutput(token=None, finished=True, reason="stop")
        state.emitted += 1
        if state.emitted >= state.max_len:
            del self._slots[slot]
            return SlotOutput(token=token, finished=True, reason="length")
        return SlotOutput(token=token, finished=False)


class _SoloDecoders:
    """Reusable one-slot decoders per model and cache size, so ``generate_tokens`` does not re-allocate the
    cache (and re-capture CUDA graphs) for every request. Thread-safe; a decoder is lent to one request at a time."""

    MIN_SEQ_LEN = 512

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._free: weakref.WeakKeyDictionary[SpeechLM, dict[int, list[BatchedDecoder]]] = (
            weakref.WeakKeyDictionary()
        )

    @contextmanager
    def lend(self, model: SpeechLM, needed: int) -> Iterator[BatchedDecoder]:
        capacity = max(self.MIN_SEQ_LEN, 1 << (needed - 1).bit_length())
        with self._lock:
            free = self._free.setdefault(model, {}).setdefault(capacity, [])
            decoder = free.pop() if free else None
        if decoder is None:
            decoder = BatchedDecoder(model, num_slots=1, max_seq_len=capacity)
        try:
            yield decoder
        finally:
            for slot in decoder.active_slots:
                decoder.remove(slot)
            with self._lock:
                self._free.setdefault(model, {}).setdefault(capacity, []).append(decoder)


_SOLO_DECODERS = _SoloDecoders()


def generate_tokens(model: SpeechLM, request: DecodeRequest) -> Iterator[int]:
    """Yield one request's speech tokens as they are decoded (a one-slot ``BatchedDecoder``)."""
    with _SOLO_DECODERS.lend(model, required_seq_len(request)) as decoder:
        slot = decoder.add(request)
        while True:
            out = decoder.step()[slot]
            if out.token is not None:
                yield out.token
            if out.finished:
                return
