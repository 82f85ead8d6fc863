"""tts-bench's least-busy balancing over several Triton instances (the gateway's pick, `gateway.replicas`, tested
there): two real tritonservers of the stand-in pipeline behind one ``ipv4:a,b`` target."""

from __future__ import annotations

import asyncio

import pytest

import pipeline_contract as contract
from tests.gateway.conftest import start_standin_backend, wait_for
from tests.gateway.standin_model.standin import read_request_log
from ttsbench.targets import TritonTarget


def test_target_addresses_are_what_grpc_target_listed():
    addresses = ["127.0.0.1:8001", "127.0.0.1:8002", "10.0.0.7:8001"]
    assert contract.target_addresses(contract.grpc_target(addresses)) == addresses
    assert contract.target_addresses(contract.grpc_target(addresses[:1])) == addresses[:1]
    assert contract.target_addresses("dns:///triton-replicas:8001") == []  # gRPC resolves it, not us


def test_an_unknown_balance_is_refused():
    with pytest.raises(ValueError, match="balance must be one of"):
        TritonTarget("127.0.0.1:8001", streaming=True, balance="random")


@pytest.mark.triton
async def test_a_request_goes_to_the_instance_with_fewer_streams_in_flight(triton_server_factory, tmp_path):
    """One stream held open on one server: the next two requests both go to the other one (round robin would
    send one of them to the busy server), and each server is sent the voice's audio once, then its id."""
    from ttsbench.inputs import default_requests
    from tests.bench.wavfiles import write_wav

    backends = [start_standin_backend(triton_server_factory, tmp_path / f"standin{i}") for i in range(2)]
    voices = tmp_path / "voices"
    voices.mkdir()
    write_wav(voices / "cleo.wav", 0.8, freq=260.0)
    (voices / "cleo.txt").write_text("Cleo speaks.", encoding="utf-8")
    held, first, second = default_requests(voices, ["Held zqheld holdstream.", "One zqfirst.", "Two zqsecond."])
    target = TritonTarget(contract.grpc_target([b.server.grpc_url for b in backends]), streaming=True,
                          balance="least-busy")
    try:
        holding = asyncio.create_task(_drain(target, held))
        assert await asyncio.to_thread(wait_for, lambda: any(b.marker("zqheld", "holding").exists()
                                                             for b in backends), 20.0)
        busy = next(b for b in backends if b.marker("zqheld", "holding").exists())
        for request in (first, second):
            assert await _drain(target, request)
        busy.release("zqheld")
        assert await holding
    finally:
        await target.aclose()
    idle = next(b for b in backends if b is not busy)
    served = {id(b): {e["tag"]: e["carries_audio"] for e in read_request_log(b.marker_dir) if e.get("tag")}
              for b in backends}  # fmt: skip
    assert served[id(busy)] == {"zqheld": True}
    assert served[id(idle)] == {"zqfirst": True, "zqsecond": False}


async def _drain(target: TritonTarget, request) -> int:
    return sum(piece.size for piece in [p async for p in target.synthesize(request)])
