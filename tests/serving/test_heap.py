"""A serving process's heap (`speech_serving.heap`): frozen out of the collector's walks once loaded, and every
collection counted without taking a lock inside it."""

from __future__ import annotations

import gc
import threading

import pytest

from speech_serving.heap import GC_STATS, GcPauses, freeze_heap
from speech_serving.stats import Stats


@pytest.fixture
def pauses():
    counted = GcPauses(period_s=3600)  # the test flushes itself
    counted.install()
    try:
        yield counted
    finally:
        counted.uninstall()


def test_full_and_young_collections_are_counted_apart(pauses):
    pauses.flush()
    before = pauses.stats.snapshot()
    gc.collect()  # a full collection
    gc.collect(0)
    gc.collect(1)
    pauses.flush()
    after = pauses.stats.snapshot()
    assert after["python_gc_collections_total"] >= before["python_gc_collections_total"] + 3
    assert after["python_gc_full_collections_total"] >= before["python_gc_full_collections_total"] + 1
    assert (after["python_gc_collections_total"] - before["python_gc_collections_total"]
            > after["python_gc_full_collections_total"] - before["python_gc_full_collections_total"])  # fmt: skip
    assert after["python_gc_full_seconds_total"] > before["python_gc_full_seconds_total"]
    assert after["python_gc_seconds_total"] >= after["python_gc_full_seconds_total"]


def test_a_collection_inside_a_stats_update_does_not_wait_for_its_lock(pauses):
    """A collection starts on whichever thread allocates, possibly one that holds the stats' lock: counting it
    there must not take that lock (the thread would wait for itself)."""
    done = threading.Event()

    def collect_holding_the_lock() -> None:
        with pauses.stats._lock:
            gc.collect()
        done.set()

    worker = threading.Thread(target=collect_holding_the_lock, daemon=True)
    worker.start()
    assert done.wait(10), "a collection waited for the stats' lock its own thread held"
    pauses.flush()
    assert pauses.stats.get("python_gc_full_collections_total") >= 1


def test_the_flusher_hands_over_on_its_own():
    counted = GcPauses(period_s=0.01).install()
    try:
        gc.collect()
        for _ in range(500):
            if counted.stats.get("python_gc_full_collections_total"):
                break
            threading.Event().wait(0.01)
        assert counted.stats.get("python_gc_full_collections_total") >= 1
    finally:
        counted.uninstall()
    assert gc.callbacks.count(counted._on_gc) == 0


def test_uninstalled_it_counts_nothing_more(pauses):
    pauses.uninstall()
    pauses.flush()
    before = pauses.stats.get("python_gc_collections_total")
    gc.collect()
    pauses.flush()
    assert pauses.stats.get("python_gc_collections_total") == before


def test_freezing_takes_what_is_loaded_out_of_every_collection():
    stats = Stats(GC_STATS)
    loaded = [[i] for i in range(10_000)]  # containers: tracked by the collector
    try:
        frozen = freeze_heap(stats)
        # other threads of the test process may free frozen objects (by reference counting) at any moment, so the
        # permanent generation can only shrink after the freeze: no equality across time
        assert frozen >= len(loaded) and gc.get_freeze_count() >= len(loaded)
        assert stats.get("python_gc_frozen_objects") == frozen
        tracked = {id(obj) for obj in gc.get_objects()}  # what a full collection walks
        assert not any(id(item) in tracked for item in loaded)
        made_later = [0]
        assert id(made_later) in {id(obj) for obj in gc.get_objects()}
    finally:
        gc.unfreeze()
    assert id(loaded[0]) in {id(obj) for obj in gc.get_objects()}
