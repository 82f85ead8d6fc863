"""The sticky least-loaded router that keeps each token2wav stream on the replica holding its caches."""

from __future__ import annotations

import pytest

from speech_serving.replicas import StickyRouter

REPLICAS = ("t2w_a", "t2w_b", "t2w_c")


def test_every_call_of_a_request_reaches_the_replica_of_its_first_call():
    router = StickyRouter(REPLICAS)
    first = {rid: router.route(rid) for rid in ("1", "2", "3", "4", "5")}
    for _ in range(3):  # later chunks, interleaved with new requests
        router.route(f"new-{_}")
        assert {rid: router.route(rid) for rid in first} == first
        assert {rid: router.owner(rid) for rid in first} == first


def test_new_requests_go_to_the_least_loaded_replica_and_ties_take_turns():
    router = StickyRouter(REPLICAS)
    assert [router.route(str(i)) for i in range(6)] == list(REPLICAS) * 2  # equal loads: in turn
    assert router.load() == dict.fromkeys(REPLICAS, 2)
    for rid in ("1", "4"):  # both on t2w_b: it now has none open
        router.release(rid)
    assert router.load()["t2w_b"] == 0
    assert router.route("new") == "t2w_b"  # the emptiest, not the next in turn
    assert router.owner("1") is None
    assert router.route("1") == "t2w_b"  # a released id is routed afresh (b still has the fewest: 1 of 2, 2, 2)
    assert router.load() == dict.fromkeys(REPLICAS, 2)


def test_release_of_an_unknown_id_changes_nothing_and_bad_replica_lists_are_refused():
    router = StickyRouter(REPLICAS)
    router.route("x")
    router.release("never-routed")
    assert sum(router.load().values()) == 1
    with pytest.raises(ValueError):
        StickyRouter(())
    with pytest.raises(ValueError):
        StickyRouter(("a", "a"))


def test_a_start_offset_moves_the_first_tie_only():
    router = StickyRouter(REPLICAS, start=4)  # 4 mod 3: the second replica
    assert [router.route(str(i)) for i in range(4)] == ["t2w_b", "t2w_c", "t2w_a", "t2w_b"]
