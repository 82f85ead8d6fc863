"""The first-chunk breakdown as Triton metrics (docs/PERFORMANCE.md#what-is-measured), in a real tritonserver
(tiny random model, colocated layout): concurrent streaming requests are each counted once in every layer, and the
layers' stages, laid end to end, fit inside the orchestrator's measured first-chunk time."""

from __future__ import annotations

import asyncio

import pytest
import tritonclient.grpc.aio as aio

import pipeline_contract as contract
import stackbench.cli as sb
from speech_serving import llm_scheduler, orchestrator, token2wav
from tests.triton.conftest import settled_metrics, stream, synthesis_inputs, wait_metrics

pytestmark = pytest.mark.triton

STREAMS = 3


def deltas(before: dict, after: dict) -> dict[str, float]:
    """stat -> its change, summed over models (as stack-bench reads them)."""
    out: dict[str, float] = {}
    for (name, _), value in after.items():
        out[name] = out.get(name, 0.0) + value
    for (name, _), value in before.items():
        out[name] = out.get(name, 0.0) - value
    return out


async def test_streaming_requests_are_counted_once_per_layer_and_their_stages_fit_the_first_chunk(pipeline):
    before = await settled_metrics(pipeline)
    texts = [f"Stream {i} is spoken in several chunks, one after the other, to the end." for i in range(STREAMS)]
    async with aio.InferenceServerClient(pipeline.server.grpc_url) as client:
        streams = await asyncio.gather(*(stream(client, synthesis_inputs(t, seed=40 + i)) for i, t in enumerate(texts)))
        await client.infer(contract.OFFLINE_MODEL, synthesis_inputs("An offline request has no first chunk.", seed=9))
    assert all(chunks[-1][3] for chunks in streams)
    count_names = [names[0] for names in (orchestrator.FIRST_CHUNK_STATS, llm_scheduler.FIRST_CHUNK_STATS,
                                          token2wav.FIRST_CHUNK_STATS)]

    def counted(metrics) -> list[float]:
        return [deltas(before, metrics).get(name, 0.0) for name in count_names]

    # every model has published (a loaded machine can delay a publisher thread), then nothing changes any more
    await wait_metrics(pipeline, lambda m: counted(m) == [STREAMS] * 3, timeout=60)
    d = deltas(before, await settled_metrics(pipeline))
    assert [d[name] for name in count_names] == [STREAMS] * 3  # one per stream in every layer; none for offline

    def seconds(stat: str) -> float:
        return d[stat]

    prompt, tokens, audio, send = (seconds(f"orchestrator_first_chunk_{stage}_seconds_total")
                                   for stage in ("prompt", "tokens", "audio", "send"))
    llm = [seconds(f"llm_first_chunk_{stage}_seconds_total") for stage in ("wait", "prefill", "decode")]
    t2w = [seconds(f"token2wav_first_chunk_{stage}_seconds_total") for stage in ("wait", "call")]
    assert min(prompt, tokens, audio, send) > 0
    assert llm[0] >= 0 and llm[1] > 0 and llm[2] > 0 and t2w[0] >= 0 and t2w[1] > 0
    assert d["llm_first_chunk_steps_total"] >= STREAMS and d["token2wav_first_chunk_rows_total"] >= STREAMS
    # each layer's stages lie inside the orchestrator's stage that waits for that layer ...
    assert sum(llm) <= tokens and sum(t2w) <= audio
    # ... so laid end to end they do not exceed the orchestrator's first-chunk time
    first_chunk = prompt + tokens + audio + send
    assert prompt + sum(llm) + sum(t2w) + send <= first_chunk

    # the benchmark's breakdown of the same deltas: means per first chunk that add up to the first chunk
    breakdown = sb.first_chunk_breakdown(d)
    assert breakdown["first_chunks"] == STREAMS
    assert breakdown["first_chunk_ms"] == pytest.approx(1000 * first_chunk / STREAMS)
    stages = [breakdown[f"first_chunk_{key}_ms"] for key in ("prompt", "llm_queue", "llm_prefill", "llm_decode",
                                                              "token2wav_queue", "token2wav_call", "send", "other")]
    assert sum(stages) == pytest.approx(breakdown["first_chunk_ms"]) and breakdown["first_chunk_other_ms"] >= 0
