"""Token2wav's call order under open-loop arrivals, simulated: stalls and first chunks per policy setting, no GPU.

    python -m enginebench.t2w_policy_sim [--rates 8 12 16 20 24 | --closed 16 32 64] [--seconds 60] [--starving-calls 1 2]

A discrete-event model of one colocated engine: Poisson arrivals of streams (`--tokens` speech tokens each), an
LLM that decodes every active stream by one token per step (a step takes `--step-ms` + `--step-ms-per-stream` x
active streams; a new stream's prefill holds the LLM `--prefill-ms`), the served chunk schedule (a stream that
starts beside fewer than 24 others: the first hop unpadded; else padded to the 25-token grid for a random prompt
length; hops grow x2 to 100, 3 lookahead tokens), and one token2wav worker whose calls are formed by the real
`SchedulePolicy` with the service's expected call time (`CallTimes`, by the rows pending). A
call takes `--call-ms` plus per row `--row-ms` + `--token-ms` x its new tokens (fitted to one H200's token2wav
alone: 1, 8 and 16 first chunks in 40, 72 and 107 ms, 16 second chunks in 136 ms, 16 mixed first and fourth chunks
in 199 ms), scaled by `--t2w-scale` for the stack's contention. A listener plays from its first audio on; a chunk that arrives after the audio before it has
played is a stall (`ttsbench.playback`).

It is a model: use it to compare policy settings with each other under the same arrivals, and measure the one that
wins in the served stack (`stack-bench --open-loop ...` against the render of the setting it suggests).
"""

from __future__ import annotations

import argparse
import random
import statistics
from dataclasses import dataclass, field

from cosyvoice2.streaming import ChunkSchedule
from speech_serving.token2wav import CALL_MEAN_WEIGHT, INITIAL_CALL_S
from speech_serving.token2wav_policy import CallTimes, PendingJob, SchedulePolicy
from ttsbench.playback import stream_stalls

TOKEN_S = 0.04  # one speech token is 40 ms of audio
HIFT_HOLD = 4  # tokens of a chunk's audio held back until the next chunk (the HiFT cache)
BUSY_STREAMS = 24


@dataclass
class Stream:
    arrival: float
    schedule: ChunkSchedule
    tokens: int
    decoded: int = 0
    chunks: list[tuple[int, int, bool]] = field(default_factory=list)  # (start, stop, final), in order
    next_chunk: int = 0  # index of the next chunk to queue
    arrivals: list[float] = field(default_factory=list)  # when each answered chunk reached the listener
    durations: list[float] = field(default_factory=list)


@dataclass
class Model:
    step_ms: float
    step_ms_per_stream: float
    prefill_ms: float
    call_ms: float
    row_ms: float
    token_ms: float
    t2w_scale: float
    step_beside: float = 1.0  # an LLM step during a token2wav call against one alone

    def call_s(self, new_tokens: list[int]) -> float:
        """A call's seconds in the stack (its time alone x `t2w_scale`)."""
        ms = self.call_ms + sum(self.row_ms + self.token_ms * n for n in new_tokens)
        return self.t2w_scale * ms / 1000.0


def simulate(load: float, seconds: float, tokens: int, policy: SchedulePolicy, model: Model, seed: int = 0,
             closed: bool = False, ramp_s: float = 1.0,
             per_client: int = 0) -> dict[str, float]:
    """One run: open loop, `load` Poisson arrivals per second for `seconds`; closed loop (`closed`), `load` clients
    that each start a new stream when their last one's final chunk is answered, until `seconds` (the clients'
    first streams start within `ramp_s`; 0: all at once, as tts-bench's levels start; `per_client` > 0: each client
    runs that many streams, as a tts-bench level of `--requests`, and the run ends with them). The LLM and the
    token2wav worker each keep their own clock; whichever is behind moves next. An LLM step
    during a call takes `step_beside` times its time alone."""
    rng = random.Random(seed)
    arrivals: list[float] = []  # open loop: all of them now; closed loop: appended as streams end
    if closed:
        arrivals = sorted(rng.uniform(0.0, ramp_s) for _ in range(int(load)))
    else:
        t = 0.0
        while (t := t + rng.expovariate(load)) < seconds:
            arrivals.append(t)
    streams: list[Stream] = []
    active: list[int] = []
    queue: list[tuple[float, int, int]] = []  # (ready time, stream, chunk index): jobs not yet in a call
    answered: dict[int, float] = {}  # stream -> when its audio runs dry (the service's view)
    firsts: list[float] = []
    llm_t = worker_t = 0.0
    call_times = CallTimes(INITIAL_CALL_S, CALL_MEAN_WEIGHT)
    admitted = llm_late = 0
    calls: list[tuple[float, float]] = []  # (start, end) of every call, in order
    seen_call = 0  # calls[:seen_call] ended before the LLM's clock

    def call_at(t: float) -> tuple[float, float] | None:
        nonlocal seen_call
        while seen_call < len(calls) and calls[seen_call][1] <= t:
            seen_call += 1
        return calls[seen_call] if seen_call < len(calls) and calls[seen_call][0] <= t else None

    def llm_step() -> None:
        nonlocal llm_t, admitted
        while admitted < len(arrivals) and arrivals[admitted] <= llm_t:  # admit arrived streams: a prefill each
            prompt = rng.randrange(100, 250)
            padded = len(active) + 1 >= BUSY_STREAMS
            schedule = ChunkSchedule(prompt_tokens=prompt, grid=25 if padded else 1)
            length = rng.randint(int(0.4 * tokens), int(1.6 * tokens))  # sentences of 0.4-1.6x the mean length
            streams.append(Stream(arrivals[admitted], schedule, length,
                                  chunks=[(c.start, c.stop, c.final) for c in schedule.chunks(length)]))
            active.append(len(streams) - 1)
            llm_t += model.prefill_ms / 1000.0
            admitted += 1
        if not active:
            llm_t = max(llm_t, arrivals[admitted])
            return
        beside = model.step_beside if call_at(llm_t) is not None else 1.0
        llm_t += beside * (model.step_ms + model.step_ms_per_stream * len(active)) / 1000.0
        for index in list(active):
            stream = streams[index]
            stream.decoded += 1
            while stream.next_chunk < len(stream.chunks):
                _, stop, final = stream.chunks[stream.next_chunk]
                if stream.decoded < (stream.tokens if final else min(stream.tokens, stop + stream.schedule.lookahead)):
                    break
                queue.append((llm_t, index, stream.next_chunk))
                stream.next_chunk += 1
            if stream.decoded >= stream.tokens:
                active.remove(index)

    def token2wav_call() -> None:
        nonlocal worker_t, llm_late
        worker_t = max(worker_t, min(job[0] for job in queue))
        heads: dict[int, tuple[float, int, int]] = {}
        for job in queue:
            if job[0] <= worker_t:
                heads.setdefault(job[1], job)
        jobs = list(heads.values())
        views = [PendingJob(job[0], job[2] == 0, answered.get(job[1])) for job in jobs]
        chosen = [jobs[i] for i in policy.next_call(views, worker_t, call_times.expected(policy.call_rows(len(jobs))))]
        new_tokens = [streams[j[1]].chunks[j[2]][1] - streams[j[1]].chunks[j[2]][0] for j in chosen]
        took = model.call_s(new_tokens)
        calls.append((worker_t, worker_t + took))
        worker_t += took
        call_times.observe(len(chosen), took)
        for job in chosen:
            queue.remove(job)
            stream, runs_dry = streams[job[1]], answered.get(job[1])
            if runs_dry is not None and worker_t > runs_dry and runs_dry - job[0] < took:
                llm_late += 1  # its tokens came with less audio left than this call took: no order saves it
            start, stop, final = stream.chunks[job[2]]
            audio = max(0.0, (stop - start + (HIFT_HOLD if job[2] > 0 else 0) - (0 if final else HIFT_HOLD)) * TOKEN_S)
            stream.arrivals.append(worker_t)
            stream.durations.append(audio)
            if job[2] == 0:
                firsts.append(worker_t - stream.arrival)
            answered[job[1]] = answered.get(job[1], worker_t) + audio
            more = len(arrivals) < per_client * int(load) if per_client else worker_t < seconds
            if final and closed and more:  # the client's next request
                arrivals.append(worker_t)
                arrivals.sort()

    while True:
        llm_has_work = bool(active) or admitted < len(arrivals)
        if llm_has_work and (llm_t <= worker_t or not queue):
            llm_step()
        elif queue:
            token2wav_call()
        else:
            break
    stalls = [stream_stalls(s.arrivals, s.durations) for s in streams if s.arrivals]
    firsts.sort()
    return {"streams": len(streams), "stalled": sum(1 for s in stalls if s.count),
            "first_p50_ms": 1000 * statistics.median(firsts),
            "first_p90_ms": 1000 * firsts[int(0.90 * (len(firsts) - 1))],
            "first_p95_ms": 1000 * firsts[int(0.95 * (len(firsts) - 1))],
            "late_second": sum(1 for s in stalls if 2 in s.late_pieces), "llm_late": llm_late}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rates", type=float, nargs="+", default=[8, 12, 16, 20, 24],
                        help="open loop: Poisson arrivals per second")
    parser.add_argument("--closed", type=int, nargs="+", metavar="CLIENTS",
                        help="closed loop instead: this many clients, each starting a stream when its last one ends")
    parser.add_argument("--seconds", type=float, default=60.0, help="arrivals offered per rate")
    parser.add_argument("--tokens", type=int, default=125,
                        help="mean speech tokens per stream (5 s of audio; each 0.4-1.6x that)")
    parser.add_argument("--starving-calls", type=float, nargs="+", default=[1.0, 2.0])
    parser.add_argument("--step-beside", type=float, default=1.0,
                        help="an LLM step during a token2wav call against alone (H200, c=32: 4.9 / 3.05 ms)")
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--ramp", type=float, default=1.0,
                        help="closed loop: the clients' first streams start within this many seconds (0: at once)")
    parser.add_argument("--max-rows", type=int, default=32,
                        help="jobs per token2wav call at most (the row cap; the engine's default is 32)")
    parser.add_argument("--per-client", type=int, default=0,
                        help="closed loop: streams per client, then the run ends (stack-bench's levels: 2); "
                             "0: until --seconds")
    parser.add_argument("--step-ms", type=float, default=3.5)
    parser.add_argument("--step-ms-per-stream", type=float, default=0.03)
    parser.add_argument("--prefill-ms", type=float, default=12.0)
    parser.add_argument("--call-ms", type=float, default=36.0)
    parser.add_argument("--row-ms", type=float, default=2.5)
    parser.add_argument("--token-ms", type=float, default=0.07)
    parser.add_argument("--t2w-scale", type=float, default=1.3, help="token2wav in the stack against alone")
    args = parser.parse_args()
    model = Model(args.step_ms, args.step_ms_per_stream, args.prefill_ms, args.call_ms, args.row_ms, args.token_ms,
                  args.t2w_scale, args.step_beside)
    closed = args.closed is not None
    print(f"| {'clients' if closed else 'rate (req/s)'} | starving_calls | streams "
          "| stalled streams | of them at chunk 2 | late chunks whose tokens came too late | first chunk p50 (ms) | p90 "
          "| p95 |\n|---|---|---|---|---|---|---|---|---|")
    for load in args.closed if closed else args.rates:
        for calls in args.starving_calls:
            runs = [simulate(load, args.seconds, args.tokens, SchedulePolicy(max_rows=args.max_rows,
                                                                            starving_calls=calls),
                             model, seed, closed, ramp_s=args.ramp, per_client=args.per_client)
                    for seed in range(args.seeds)]
            cells = [" / ".join(f"{run[key]:.0f}" for run in runs) for key in
                     ("streams", "stalled", "late_second", "llm_late", "first_p50_ms", "first_p90_ms",
                      "first_p95_ms")]
            print(f"| {load:g} | {calls:g} | " + " | ".join(cells) + " |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
