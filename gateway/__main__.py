"""``python -m gateway`` (``make run``): serve the gateway with uvicorn using the TTS_* settings.

SIGTERM or SIGINT drains: the process keeps listening but answers new ``/v1/*`` requests (and
``/ready``) with 503 + ``Retry-After``, lets the requests in flight finish for up to
``TTS_DRAIN_GRACE_S``, then exits. A second signal exits at once.

A gateway that cannot start (settings that do not validate, its port in use, an application start-up that
fails) says why and exits with ``EXIT_CANNOT_START``: starting it again would fail the same way, so a
supervisor (the local stack) stops instead of restarting it. ``python -m gateway --check`` runs the same
checks without serving (the stack runs it before it starts tritonserver).
"""

from __future__ import annotations

import argparse
import errno
import gc
import logging
import socket
import sys
from collections.abc import Sequence
from types import FrameType

import uvicorn
from pydantic import ValidationError

from gateway.guard import Drain
from gateway.settings import Settings

logger = logging.getLogger("gateway")

#: After draining, how long uvicorn may still spend closing connections (a request past the grace
#: period is cut off here).
CLOSE_TIMEOUT_S = 3
#: The exit status of a gateway that never started serving (uvicorn's own for a start-up failure).
EXIT_CANNOT_START = 3


class CannotStart(Exception):
    """A start-up problem that a restart cannot fix; the message says what to change."""


class DrainingServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, drain: Drain, grace_s: float) -> None:
        super().__init__(config)
        self._drain = drain
        self._grace_s = grace_s

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if self._drain.draining:  # the second signal: stop now
            super().handle_exit(sig, frame)
            return
        logger.info(
            "signal %d: draining (%d requests in flight, grace %.0f s)", sig, self._drain.in_flight, self._grace_s
        )
        self._drain.begin()

    async def on_tick(self, counter: int) -> bool:
        if self._drain.finished(self._grace_s):
            logger.info("drained (%d requests still in flight); exiting", self._drain.in_flight)
            return True
        return await super().on_tick(counter)


def load_settings() -> Settings:
    """The settings, or CannotStart naming each variable that is wrong."""
    try:
        return Settings()
    except ValidationError as exc:
        problems = []
        for error in exc.errors():
            field = "_".join(str(part) for part in error.get("loc", ()) if not isinstance(part, int))
            problems.append(f"TTS_{field.upper()}: {error.get('msg', 'invalid')} (got {error.get('input')!r})")
        raise CannotStart("invalid settings:\n  " + "\n  ".join(problems)) from None


def check_port(host: str, port: int) -> None:
    """CannotStart if the gateway could not listen on ``host:port`` (in use, or not an address of this host).
    Binds as the server will (SO_REUSEADDR, as asyncio does) and lets go at once."""
    if port == 0:
        return  # any free port
    try:
        addresses = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        raise CannotStart(f"TTS_HOST={host!r} is not an address this machine can listen on ({exc})") from None
    for family, kind, proto, _, address in addresses:
        with socket.socket(family, kind, proto) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                probe.bind(address)
            except OSError as exc:
                if exc.errno == errno.EADDRINUSE:
                    raise CannotStart(
                        f"port {port} on {host} is already in use (TTS_PORT={port}): another program listens there, "
                        f"perhaps a gateway or stack started earlier. Choose a free port with TTS_PORT (e.g. "
                        f"`TTS_PORT={port + 1} make demo`), or stop that program."
                    ) from None
                raise CannotStart(f"cannot listen on {host}:{port} (TTS_HOST, TTS_PORT): {exc.strerror}") from None


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m gateway", description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--check", action="store_true", help="check the settings and the port, print host:port and exit (0: ok)"
    )
    args = parser.parse_args(argv)
    try:
        settings = load_settings()
        check_port(settings.host, settings.port)
    except CannotStart as exc:
        print(f"[gateway] cannot start: {exc}", file=sys.stderr, flush=True)
        return EXIT_CANNOT_START
    if args.check:
        print(f"{settings.host}:{settings.port}", flush=True)  # where it would listen (the stack names its files so)
        return 0
    logging.basicConfig(level=settings.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from gateway.app import create_app  # noqa: PLC0415 - after the checks: they answer fast

    try:
        app = create_app(settings)
    except Exception:
        logger.exception("the gateway could not be set up")
        return EXIT_CANNOT_START
    config = uvicorn.Config(
        app,
        host=settings.host,
        port=settings.port,
        log_level=settings.log_level,
        timeout_graceful_shutdown=CLOSE_TIMEOUT_S,
    )
    server = DrainingServer(config, app.state.drain, settings.drain_grace_s)
    # Everything imported and built so far lives as long as the process: out of the collector's reach, a full
    # collection (which stops the loop that forwards every stream's chunks) walks only what serving made since
    gc.collect()
    gc.freeze()
    try:
        server.run()
    except SystemExit:
        # uvicorn exits this way when the application's start-up fails or the port was taken after the check
        # (it logged why); anything else propagates as before.
        if server.started:
            raise
    return 0 if server.started else EXIT_CANNOT_START


if __name__ == "__main__":
    sys.exit(main())
