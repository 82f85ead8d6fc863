"""An async `execute` must still run when tritonserver's python stub files it as a background future.

The stub hands the coroutine to its event loop (`asyncio.run_coroutine_threadsafe`) and only then adds a done
callback and puts the future into its set of background futures; the callback removes it from that set. A
coroutine that finished before that makes the callback fail (the server logs "Cannot remove future from
background; KeyError" once per call, as seen under load on a GPU) and the finished future stays in the set for
good. This test plays the stub's side with its thread slowed down between the two steps."""

from __future__ import annotations

import asyncio
import threading
import time


class Request:
    def get_response_sender(self) -> "Request":
        return self

    def is_cancelled(self) -> bool:
        return False

    def send(self, *args: object, **kwargs: object) -> None:
        pass


def test_execute_outlives_the_stubs_bookkeeping(adapters) -> None:
    common = adapters("common")
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    background: set = set()
    failed: list = []
    handled: list = []

    def done(future) -> None:  # the stub's done callback
        try:
            background.remove(future)
        except KeyError:
            failed.append(future)

    async def handle(request: Request, sender: Request) -> None:
        handled.append(request)

    try:
        futures = []
        for _ in range(4):
            future = asyncio.run_coroutine_threadsafe(common.serve([Request()], handle), loop)
            time.sleep(0.02)  # the stub's thread is late (GIL, load) before it files the future
            future.add_done_callback(done)
            background.add(future)
            futures.append(future)
        for future in futures:
            future.result(timeout=5)
        time.sleep(0.05)
    finally:
        loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout=5)
    assert len(handled) == 4  # the requests ran while execute lingered
    assert not failed, "execute finished before the stub filed its future"
    assert not background  # every future was removed again: none kept for good
