"""Which Triton replica serves a request when the gateway balances by load (``TTS_TRITON_BALANCE=least-busy``).

gRPC's round robin spreads requests by count, but a speech stream lasts as long as its audio: the replicas that
drew the longer streams fall behind while others idle. Here each request goes to the replica with the fewest of
this gateway's requests in flight (ties: the one picked longest ago), each replica over a channel of its own. The
replicas are the addresses of an ``ipv4:a,b`` target, or those a ``dns:///name:port`` target resolves to (compose's
network alias, a Kubernetes headless Service), looked up again every ``refresh_s``. A replica that could not be
reached sits out ``cooldown_s`` unless every replica does.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import socket
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from gateway.errors import BackendUnavailable
import pipeline_contract as contract

logger = logging.getLogger(__name__)

#: Balancing policies of the gateway's Triton requests (settings: ``triton_balance``).
BALANCES = ("round-robin", "least-busy")

Resolver = Callable[[str, int], Awaitable[list[str]]]


async def resolve_addresses(host: str, port: int) -> list[str]:
    """The ``ip:port`` addresses ``host`` resolves to (IPv6 bracketed), sorted, without duplicates."""
    infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
    addresses = {f"[{info[4][0]}]:{port}" if info[0] == socket.AF_INET6 else f"{info[4][0]}:{port}" for info in infos}
    return sorted(addresses)


def dns_name(target: str) -> tuple[str, int] | None:
    """(host, port) of a ``dns:///host:port`` (or ``dns://authority/host:port``) target; None for other targets."""
    if not target.startswith("dns:"):
        return None
    name = target.split("/")[-1]
    host, _, port = name.rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"a dns target needs host:port, got {target!r}")
    return host, int(port)


@dataclass(eq=False)
class Replica:
    """One Triton instance: its channel and the gateway's requests in flight there."""

    address: str
    client: Any  # tritonclient.grpc.aio.InferenceServerClient
    in_flight: int = 0
    picked: int = 0  # when it was last picked (the balancer's clock)
    down_until: float = 0.0  # monotonic time before which it is not picked unless all are down
    gone: bool = field(default=False)  # no longer resolved: closed once its requests end


class Replicas:
    """The replicas of one Triton target and the least-busy pick among them. Used from one event loop."""

    def __init__(
        self,
        target: str,
        client_factory: Callable[[str], Any],
        *,
        refresh_s: float = 10.0,
        cooldown_s: float = 2.0,
        resolve: Resolver = resolve_addresses,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._dns = dns_name(target)
        self._factory = client_factory
        self._resolve = resolve
        self._refresh_s = refresh_s
        self._cooldown_s = cooldown_s
        self._clock = clock
        self._turn = itertools.count(1)
        self._replicas: dict[str, Replica] = {}
        self._resolved_at: float | None = None
        self._refreshing: asyncio.Lock | None = None
        if self._dns is None:
            addresses = contract.target_addresses(target)
            if not addresses:
                raise ValueError(f"least-busy balancing needs an ipv4:a,b, host:port or dns:///name:port target, "
                                 f"got {target!r}")
            self._update(addresses)

    @property
    def addresses(self) -> list[str]:
        return sorted(self._replicas)

    def _update(self, addresses: list[str]) -> None:
        for address in addresses:
            if address not in self._replicas:
                self._replicas[address] = Replica(address, self._factory(address))
        for address in set(self._replicas) - set(addresses):
            replica = self._replicas.pop(address)
            replica.gone = True
            if replica.in_flight == 0:
                self._close_later(replica)

    def _close_later(self, replica: Replica) -> None:
        task = asyncio.get_running_loop().create_task(replica.client.close())
        task.add_done_callback(lambda t: t.exception())  # closing a dead channel may fail: nothing to do about it

    async def refresh(self) -> None:
        """Look the replicas up again (a dns target, when the last lookup is older than ``refresh_s``). A failed
        lookup keeps the replicas known; with none known it raises BackendUnavailable."""
        if self._dns is None:
            return
        now = self._clock()
        if self._resolved_at is not None and now - self._resolved_at < self._refresh_s:
            return
        self._refreshing = self._refreshing or asyncio.Lock()
        async with self._refreshing:
            if self._resolved_at is not None and self._clock() - self._resolved_at < self._refresh_s:
                return  # another request looked them up meanwhile
            try:
                addresses = await self._resolve(*self._dns)
            except OSError as exc:
                addresses = []
                logger.warning("resolving %s:%d failed: %s", *self._dns, exc)
            self._resolved_at = self._clock()
            if addresses:
                self._update(addresses)
        if not self._replicas:
            raise BackendUnavailable("The speech backend is unavailable; retry later.", retry_after=1)

    async def pick(self, avoid: Replica | None = None) -> Replica:
        """The replica for the next request (counted in flight until `done`): the fewest in flight among those not
        sitting out, then the one picked longest ago; `avoid` only when it is the only one."""
        await self.refresh()
        now = self._clock()
        candidates = [r for r in self._replicas.values() if r is not avoid] or list(self._replicas.values())
        candidates = [r for r in candidates if r.down_until <= now] or candidates
        replica = min(candidates, key=lambda r: (r.in_flight, r.picked))
        replica.picked = next(self._turn)
        replica.in_flight += 1
        return replica

    def done(self, replica: Replica) -> None:
        replica.in_flight -= 1
        if replica.gone and replica.in_flight == 0:
            self._close_later(replica)

    def mark_down(self, replica: Replica) -> None:
        """`replica` could not be reached: it sits out ``cooldown_s``."""
        replica.down_until = self._clock() + self._cooldown_s
        logger.warning("Triton replica %s unreachable: not picked for %.0f s", replica.address, self._cooldown_s)

    async def any_client(self) -> Any:
        """A replica's client for the readiness checks (None: none known)."""
        await self.refresh()
        replicas = sorted(self._replicas.values(), key=lambda r: (r.down_until, r.address))
        return replicas[0].client if replicas else None

    def clients(self) -> list[Any]:
        return [r.client for r in self._replicas.values()]

    async def close(self) -> None:
        for replica in list(self._replicas.values()):
            await replica.client.close()
        self._replicas.clear()
