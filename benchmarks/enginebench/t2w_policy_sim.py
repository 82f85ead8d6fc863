"""Token2wav's call order under open-loop arrivals, simulated: stalls and first chunks per policy setting, no GPU.

    python -m enginebench.t2w_policy_sim [--rates 8 12 16 20 24] [--seconds 60] [--starving-calls 1 2]

A discrete-event model of one colocated engine: Poisson arrivals of streams (`--tokens` speech tokens each), an
LLM that decodes every active stream by one token per step (a step takes `--step-ms` + `--step-ms-per-stream` x
active streams; a new stream's prefill holds the LLM `--prefill-ms`), the served chunk schedule (a stream that
starts beside fewer than 24 others: the first hop unpadded; else padded to the 25-token grid for a random prompt
length; hops grow x2 to 100, 3 lookahead tokens), and one token2wav worker whose calls are formed by the real
`SchedulePolicy` with the service's running mean of call times. A call takes `--call-ms` plus per row
`--row-ms` + `--token-ms` x its new tokens (fitted to one H200's token2wav alone: 1, 8 and 16 first chunks in 40,
72 and 107 ms, 16 second chunks in 136 ms, 16 mixed first and fourth chunks in 199 ms), scaled by `--t2w-scale` for
the stack's contention. A listener plays from its first audio on; a chunk that arrives after the audio before it has
played is a stall (`ttsbench.playback`).

It is a model: use it to compare policy settings with each other under the same arrivals, and measure the one that
wins in the served stack (`stack-bench --open-loop ... --variant starving_calls=2`).
"""

from __future__ import annotations

import argparse
import random
import statistics
from dataclasses import dataclass, field

from cosyvoice2.streaming import ChunkSchedule
from speech_serving.token2wav import CALL_MEAN_WEIGHT, INITIAL_CALL_S
from speech_serving.token2wav_policy import PendingJob, SchedulePolicy
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

    def call_s(self, new_tokens: list[int]) -> float:
        ms = self.call_ms + sum(self.row_ms + self.token_ms * n for n in new_tokens)
        return self.t2w_scale * ms / 1000.0


def simulate(rate: float, seconds: float, tokens: int, policy: SchedulePolicy, model: Model, seed: int = 0
             ) -> dict[str, float]:
    rng = random.Random(seed)
    arrivals, t = [], 0.0
    while (t := t + rng.expovariate(rate)) < seconds:
        arrivals.append(t)
    streams: list[Stream] = []
    llm_free, worker_free, call_mean = 0.0, 0.0, INITIAL_CALL_S
    queue: list[tuple[float, int, int]] = []  # (ready time, stream, chunk index): token2wav jobs
    active: list[int] = []
    next_arrival = 0
    now = 0.0
    # The LLM: steps in a loop; between steps it admits arrived streams (one prefill each).
    while next_arrival < len(arrivals) or active:
        while next_arrival < len(arrivals) and arrivals[next_arrival] <= max(now, llm_free):
            index = next_arrival
            running = len(active) + 1
            prompt = rng.randrange(100, 250)
            base = ChunkSchedule(prompt_tokens=prompt)
            schedule = base if running >= BUSY_STREAMS else ChunkSchedule(prompt_tokens=prompt, grid=1)
            streams.append(Stream(arrivals[index], schedule, tokens, chunks=[
                (c.start, c.stop, c.final) for c in schedule.chunks(tokens)]))
            llm_free = max(llm_free, arrivals[index]) + model.prefill_ms / 1000.0
            active.append(index)
            next_arrival += 1
        if not active:
            now = llm_free = arrivals[next_arrival]
            continue
        llm_free += (model.step_ms + model.step_ms_per_stream * len(active)) / 1000.0
        now = llm_free
        for index in list(active):
            stream = streams[index]
            stream.decoded += 1
            while stream.next_chunk < len(stream.chunks):
                start, stop, final = stream.chunks[stream.next_chunk]
                need = stream.tokens if final else min(stream.tokens, stop + stream.schedule.lookahead)
                if stream.decoded < need:
                    break
                queue.append((now, index, stream.next_chunk))
                stream.next_chunk += 1
            if stream.decoded >= stream.tokens:
                active.remove(index)
    # Token2wav: one worker, calls formed by the policy from each stream's oldest ready job.
    queue.sort()
    pending: list[tuple[float, int, int]] = []
    cursor = 0
    answered: dict[int, float] = {}  # stream -> when its audio runs dry (service view)
    firsts: list[float] = []
    llm_late = 0
    while cursor < len(queue) or pending:
        if not pending:
            worker_free = max(worker_free, queue[cursor][0])
        while cursor < len(queue) and queue[cursor][0] <= worker_free:
            pending.append(queue[cursor])
            cursor += 1
        heads: dict[int, tuple[float, int, int]] = {}
        for job in pending:
            heads.setdefault(job[1], job)
        jobs = list(heads.values())
        views = [PendingJob(job[0], job[2] == 0, answered.get(job[1])) for job in jobs]
        chosen = [jobs[i] for i in policy.next_call(views, worker_free, call_mean)]
        new_tokens = [streams[j[1]].chunks[j[2]][1] - streams[j[1]].chunks[j[2]][0] for j in chosen]
        took = model.call_s(new_tokens)
        worker_free += took
        call_mean = (1.0 - CALL_MEAN_WEIGHT) * call_mean + CALL_MEAN_WEIGHT * took
        for job in chosen:
            pending.remove(job)
            runs_dry = answered.get(job[1])
            if runs_dry is not None and worker_free > runs_dry and runs_dry - job[0] < took:
                llm_late += 1  # its tokens came with less audio left than this call took: no order saves it
            stream = streams[job[1]]
            start, stop, final = stream.chunks[job[2]]
            audio = (stop - start + (HIFT_HOLD if job[2] > 0 else 0) - (0 if final else HIFT_HOLD)) * TOKEN_S
            stream.arrivals.append(worker_free)
            stream.durations.append(max(audio, 0.0))
            if job[2] == 0:
                firsts.append(worker_free - stream.arrival)
                answered[job[1]] = worker_free
            answered[job[1]] = answered.get(job[1], worker_free) + max(audio, 0.0)
    stalls = [stream_stalls(s.arrivals, s.durations) for s in streams if s.arrivals]
    firsts.sort()
    return {"streams": len(streams), "stalled": sum(1 for s in stalls if s.count),
            "first_p50_ms": 1000 * statistics.median(firsts), "first_p95_ms": 1000 * firsts[int(0.95 * (len(firsts) - 1))],
            "late_second": sum(1 for s in stalls if 2 in s.late_pieces), "llm_late": llm_late}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rates", type=float, nargs="+", default=[8, 12, 16, 20, 24])
    parser.add_argument("--seconds", type=float, default=60.0, help="arrivals offered per rate")
    parser.add_argument("--tokens", type=int, default=125, help="speech tokens per stream (5 s of audio)")
    parser.add_argument("--starving-calls", type=float, nargs="+", default=[1.0, 2.0])
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--step-ms", type=float, default=3.5)
    parser.add_argument("--step-ms-per-stream", type=float, default=0.03)
    parser.add_argument("--prefill-ms", type=float, default=12.0)
    parser.add_argument("--call-ms", type=float, default=36.0)
    parser.add_argument("--row-ms", type=float, default=2.5)
    parser.add_argument("--token-ms", type=float, default=0.07)
    parser.add_argument("--t2w-scale", type=float, default=1.3, help="token2wav in the stack against alone")
    args = parser.parse_args()
    model = Model(args.step_ms, args.step_ms_per_stream, args.prefill_ms, args.call_ms, args.row_ms, args.token_ms,
                  args.t2w_scale)
    print("| rate (req/s) | starving_calls | streams | stalled streams | of them at chunk 2 | late chunks whose tokens "
          "came too late | first chunk p50 (ms) | first chunk p95 (ms) |\n|---|---|---|---|---|---|---|---|")
    for rate in args.rates:
        for calls in args.starving_calls:
            runs = [simulate(rate, args.seconds, args.tokens, SchedulePolicy(max_rows=16, starving_calls=calls), model,
                             seed) for seed in range(args.seeds)]
            cells = [" / ".join(f"{run[key]:.0f}" for run in runs)
                     for key in ("streams", "stalled", "late_second", "llm_late", "first_p50_ms", "first_p95_ms")]
            print(f"| {rate:g} | {calls:g} | " + " | ".join(cells) + " |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
