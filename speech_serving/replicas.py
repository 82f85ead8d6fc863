"""Sticky least-loaded routing of per-request streams over equivalent replicas (the token2wav models).

A streaming request's token2wav state (flow and HiFT caches) lives in the one process that served its first chunk,
so every later chunk and its close must reach that same replica. Triton would spread the requests of one model
over its instances as they come, so replicas are separate models and the caller picks one per request here:
the replica with the fewest requests this process has open on it (ties in turn), kept until the request ends.
"""

from __future__ import annotations

import threading
from typing import Sequence


class StickyRouter:
    """Maps request ids to replicas: a new id goes to the least-loaded replica, a known id to its own."""

    def __init__(self, replicas: Sequence[str], start: int = 0) -> None:
        """`start`: the replica the first tie goes to (several routing processes are best started apart)."""
        if not replicas or len(set(replicas)) != len(replicas):
            raise ValueError(f"replicas must be distinct and at least one, got {list(replicas)}")
        self.replicas = tuple(replicas)
        self._load = dict.fromkeys(self.replicas, 0)
        self._owner: dict[str, str] = {}
        self._next = start % len(self.replicas)  # where the next tie-break starts, so equal loads take turns
        self._lock = threading.Lock()

    def route(self, request_id: str) -> str:
        """The replica of `request_id`, chosen on its first call and the same on every call until `release`."""
        with self._lock:
            owner = self._owner.get(request_id)
            if owner is None:
                n = len(self.replicas)
                order = [self.replicas[(self._next + i) % n] for i in range(n)]
                owner = min(order, key=self._load.__getitem__)
                self._next = (self.replicas.index(owner) + 1) % n
                self._owner[request_id] = owner
                self._load[owner] += 1
            return owner

    def release(self, request_id: str) -> None:
        """`request_id` holds nothing on its replica any more (its final chunk, offline call or close is done)."""
        with self._lock:
            owner = self._owner.pop(request_id, None)
            if owner is not None:
                self._load[owner] -= 1

    def owner(self, request_id: str) -> str | None:
        with self._lock:
            return self._owner.get(request_id)

    def load(self) -> dict[str, int]:
        """Open requests per replica."""
        with self._lock:
            return dict(self._load)
