"""Least-busy balancing over Triton replicas (`TTS_TRITON_BALANCE=least-busy`): the pick and the replica list on
their own, then the gateway in front of two real tritonservers of the stand-in pipeline."""

from __future__ import annotations

import asyncio
import socket

import pytest

import pipeline_contract as contract
from gateway.errors import BackendUnavailable
from gateway.replicas import Replicas, dns_name
from tests.gateway.conftest import async_wait_for, start_standin_backend


class FakeClient:
    def __init__(self, address: str) -> None:
        self.address = address
        self.closed = False

    async def close(self) -> None:
        self.closed = True


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


async def test_the_replica_with_fewest_in_flight_is_picked_then_the_one_picked_longest_ago():
    replicas = Replicas("ipv4:a:1,b:1,c:1", FakeClient)
    first = [await replicas.pick() for _ in range(3)]
    assert [r.address for r in first] == ["a:1", "b:1", "c:1"]  # a tie: in turn
    replicas.done(first[1])
    assert (await replicas.pick()).address == "b:1"  # the only one with nothing in flight
    replicas.done(first[0])
    replicas.done(first[2])
    assert (await replicas.pick()).address == "a:1"  # a and c tie; a was picked longer ago
    assert (await replicas.pick(avoid=first[2])).address == "b:1"  # c is idle but avoided; b waited longer than a


async def test_an_unreachable_replica_sits_out_its_cooldown_unless_every_one_does():
    clock = Clock()
    replicas = Replicas("ipv4:a:1,b:1", FakeClient, cooldown_s=2.0, clock=clock)
    a = await replicas.pick()
    replicas.done(a)
    replicas.mark_down(a)
    assert [(await replicas.pick()).address for _ in range(3)] == ["b:1"] * 3  # though b has more in flight
    clock.now += 2.5
    assert (await replicas.pick()).address == "a:1"  # back after the cooldown
    replicas.mark_down(replicas._replicas["a:1"])
    replicas.mark_down(replicas._replicas["b:1"])
    assert (await replicas.pick()).address == "a:1"  # every one sits out: the least busy still serves


async def test_a_dns_target_is_looked_up_again_after_the_refresh_period():
    clock = Clock()
    answers = [["10.0.0.1:8001", "10.0.0.2:8001"], ["10.0.0.2:8001", "10.0.0.3:8001"], OSError("no such host")]
    asked = []

    async def resolve(host: str, port: int) -> list[str]:
        asked.append((host, port))
        answer = answers.pop(0)
        if isinstance(answer, Exception):
            raise answer
        return answer

    replicas = Replicas("dns:///triton-replicas:8001", FakeClient, refresh_s=10.0, resolve=resolve, clock=clock)
    held = await replicas.pick()
    assert replicas.addresses == ["10.0.0.1:8001", "10.0.0.2:8001"] and held.address == "10.0.0.1:8001"
    await replicas.pick()
    assert len(asked) == 1  # within the refresh period: no second lookup
    clock.now += 11
    await replicas.pick()
    assert replicas.addresses == ["10.0.0.2:8001", "10.0.0.3:8001"]
    assert not held.client.closed  # gone from the answer, but a request still runs there
    replicas.done(held)
    await asyncio.sleep(0)
    assert held.client.closed  # closed once its last request ended
    clock.now += 11
    await replicas.pick()  # a failed lookup keeps the replicas known
    assert asked == [("triton-replicas", 8001)] * 3 and replicas.addresses == ["10.0.0.2:8001", "10.0.0.3:8001"]


async def test_a_dns_target_that_resolves_to_nothing_is_unavailable():
    async def resolve(host: str, port: int) -> list[str]:
        raise OSError("no such host")

    with pytest.raises(BackendUnavailable):
        await Replicas("dns:///nowhere:8001", FakeClient, resolve=resolve).pick()


def test_targets_name_their_replicas():
    assert dns_name("dns:///triton:8001") == ("triton", 8001)
    assert dns_name("dns://10.0.0.53/triton.svc:8001") == ("triton.svc", 8001)
    assert dns_name("ipv4:1.2.3.4:1") is None
    with pytest.raises(ValueError, match="host:port"):
        dns_name("dns:///triton")
    assert Replicas("127.0.0.1:8001", FakeClient).addresses == ["127.0.0.1:8001"]


# -- the gateway in front of two tritonservers ----------------------------------------------------------------
@pytest.fixture(scope="module")
def two_backends(triton_server_factory, tmp_path_factory):
    return [start_standin_backend(triton_server_factory, tmp_path_factory.mktemp(f"replica{i}")) for i in range(2)]


def _served(backend) -> dict[str, bool]:
    """tag -> whether the request carried the voice's audio, of every tagged request `backend` served."""
    return {r["tag"]: r["carries_audio"] for r in backend.requests() if r.get("tag")}


@pytest.mark.triton
async def test_a_request_goes_to_the_replica_with_fewer_streams_in_flight(two_backends, gateway_factory):
    gateway = gateway_factory(contract.grpc_target([b.server.grpc_url for b in two_backends]),
                              triton_balance="least-busy")
    client = gateway.async_client()
    async with client.audio.speech.with_streaming_response.create(
        model="tts-1", input="zqbalheld holdstream a long enough sentence to hold.", voice="alloy",
        response_format="pcm",
    ) as held:
        body = held.iter_bytes()  # keep it referenced: a collected iterator closes the response
        assert await body.__anext__()
        assert await async_wait_for(lambda: any(b.marker("zqbalheld", "holding").exists() for b in two_backends),
                                    timeout=10)  # fmt: skip
        busy = next(b for b in two_backends if b.marker("zqbalheld", "holding").exists())
        for tag in ("zqbalone", "zqbaltwo"):  # round robin would send one of them to the busy replica
            audio = await client.audio.speech.create(model="tts-1", input=f"{tag} Hello.", voice="alloy")
            assert len(audio.content) > 0
        busy.release("zqbalheld")
        async for _ in body:
            pass
    idle = next(b for b in two_backends if b is not busy)
    assert _served(busy).keys() == {"zqbalheld"}
    # each replica is sent a voice's audio once, then its id: the idle one had not seen alloy's voice yet
    assert {t: a for t, a in _served(idle).items() if t.startswith("zqbal")} == {"zqbalone": True, "zqbaltwo": False}


@pytest.mark.triton
def test_a_replica_that_cannot_be_reached_is_passed_over(two_backends, gateway_factory):
    with socket.socket() as closed:  # a port nothing listens on
        closed.bind(("127.0.0.1", 0))
        dead = f"127.0.0.1:{closed.getsockname()[1]}"
    gateway = gateway_factory(contract.grpc_target([dead, two_backends[0].server.grpc_url]),
                              triton_balance="least-busy")
    with gateway.http() as http:
        assert http.get("/ready").status_code == 200  # one replica is enough
    for tag in ("zqdeadone", "zqdeadtwo", "zqdeadthree"):
        audio = gateway.client().audio.speech.create(model="tts-1", input=f"{tag} Hello.", voice="alloy")
        assert len(audio.content) > 0
    assert {"zqdeadone", "zqdeadtwo", "zqdeadthree"} <= _served(two_backends[0]).keys()


@pytest.mark.triton
def test_a_dns_target_is_balanced_over_what_it_resolves_to(two_backends, gateway_factory):
    gateway = gateway_factory(f"dns:///{two_backends[1].server.grpc_url}", triton_balance="least-busy")
    audio = gateway.client().audio.speech.create(model="tts-1", input="zqdnsbalanced Hello.", voice="alloy")
    assert len(audio.content) > 0
    assert "zqdnsbalanced" in _served(two_backends[1])
