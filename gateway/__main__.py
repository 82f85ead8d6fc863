"""``python -m gateway`` (``make run``): serve the gateway with uvicorn using the TTS_* settings.

SIGTERM or SIGINT drains: the process keeps listening but answers new ``/v1/*`` requests (and
``/ready``) with 503 + ``Retry-After``, lets the requests in flight finish for up to
``TTS_DRAIN_GRACE_S``, then exits. A second signal exits at once.
"""

from __future__ import annotations

import logging
from types import FrameType

import uvicorn

from gateway.app import create_app
from gateway.guard import Drain
from gateway.settings import Settings

logger = logging.getLogger("gateway")

#: After draining, how long uvicorn may still spend closing connections (a request past the grace
#: period is cut off here).
CLOSE_TIMEOUT_S = 3


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


def main() -> None:
    settings = Settings()
    logging.basicConfig(level=settings.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    app = create_app(settings)
    config = uvicorn.Config(
        app,
        host=settings.host,
        port=settings.port,
        log_level=settings.log_level,
        timeout_graceful_shutdown=CLOSE_TIMEOUT_S,
    )
    DrainingServer(config, app.state.drain, settings.drain_grace_s).run()


if __name__ == "__main__":
    main()
