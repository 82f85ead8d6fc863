"""Gauges and counters that every serving component keeps, and a hook to export them.

Components update a `Stats` object; the Triton adapter attaches a listener that mirrors each change
into a Triton custom metric (so `/metrics` shows active requests, streams and cache hits). Tests read
`snapshot()` directly.
"""

from __future__ import annotations

import threading
from typing import Callable, Mapping

Listener = Callable[[str, float], None]


class Stats:
    """Named numeric values. Gauges go up and down; counters only go up (by convention of the name)."""

    def __init__(self, names: tuple[str, ...]) -> None:
        self._values: dict[str, float] = dict.fromkeys(names, 0.0)
        self._lock = threading.Lock()
        self._listeners: list[Listener] = []

    def add_listener(self, listener: Listener) -> None:
        with self._lock:
            self._listeners.append(listener)
            current = dict(self._values)
        for name, value in current.items():
            listener(name, value)

    def declare(self, names: tuple[str, ...]) -> None:
        """Add `names` (at 0) that are not there yet: stats a component keeps only in some set-ups. Before any
        listener: an exporter makes its metrics from the names it sees when it attaches."""
        with self._lock:
            if self._listeners and not self._values.keys() >= set(names):
                raise RuntimeError(f"stats declared after a listener attached: {sorted(names)}")
            for name in names:
                self._values.setdefault(name, 0.0)

    def add(self, name: str, delta: float = 1.0) -> None:
        self._update(name, lambda value: value + delta)

    def add_all(self, deltas: Mapping[str, float]) -> None:
        """Add to several values at once: a snapshot (and so a metrics scrape) sees all of them changed or none,
        e.g. a count and the sums it divides."""
        with self._lock:
            changed = {name: self._values[name] + delta for name, delta in deltas.items()}  # KeyError first
            self._values.update(changed)
            listeners = tuple(self._listeners)
        for listener in listeners:
            for name, value in changed.items():
                listener(name, value)

    def set(self, name: str, value: float) -> None:
        self._update(name, lambda _: value)

    def _update(self, name: str, change: Callable[[float], float]) -> None:
        with self._lock:
            value = change(self._values[name])  # KeyError on a typo is deliberate
            self._values[name] = value
            listeners = tuple(self._listeners)
        for listener in listeners:
            listener(name, value)

    def get(self, name: str) -> float:
        with self._lock:
            return self._values[name]

    def snapshot(self) -> dict[str, float]:
        with self._lock:
            return dict(self._values)
