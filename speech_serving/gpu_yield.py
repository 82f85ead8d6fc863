"""The colocated LLM's yield to token2wav: one GPU, two workers, and which of them waits.

In the colocated layout the LLM scheduler's and token2wav's worker threads run their kernels at the same time on
one GPU. A token2wav call then takes longer than alone (a one-row first chunk: 64 ms in the stack against 41 ms
alone on an H200), and so does every LLM step beside it (2.4 ms against 1.2). Where the LLM's next tokens are not
urgent, it can wait for the running call instead, and the call runs as if alone.

`lone` (render option `llm_yield`): the LLM waits only while it decodes a single streaming sequence that has
already handed over its first chunk and no other request waits: a lone listener's first chunk leaves it about half
a second of audio, which the next chunk's tokens (25 steps) and call need a fraction of. A request that arrives
while the LLM waits ends the wait (its prefill goes ahead at once), and a wait never outlasts `max_wait_s`.

Those are the two modes. A third (waiting for any call that carries a new stream's first chunk while all the LLM's
streams are past theirs) gained little in a model of the engine, was never measured in the stack, and left the
product once the targets were met without it (docs/experiments/2026-12-07-llm-yield-first-chunks.md).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

#: off: the LLM never waits; lone: it waits for the running token2wav call while it decodes one stream past its
#: first chunk (above).
LLM_YIELD_MODES = ("off", "lone")


class Token2WavCalls:
    """The token2wav worker's calls as the LLM scheduler of the same process sees them: the worker marks each
    call (`running`), the scheduler waits for the running one to end (`wait_while_running`) and counts its steps
    that ran beside one (`busy` at a step's start, or `started` changed during it)."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._running = False
        #: Calls started so far. A step that sees it change ran beside a call that started during it, even one
        #: that also ended there (which `busy`, read at the step's ends, would miss). A reader takes `started`
        #: before `busy`: a call that starts between the two reads is then seen by one or the other.
        self.started = 0

    @property
    def busy(self) -> bool:
        """Whether a call runs now."""
        return self._running

    @contextmanager
    def running(self) -> Iterator[None]:
        """Mark one call for the duration of the block."""
        with self._cond:
            self.started += 1
            self._running = True
        try:
            yield
        finally:
            with self._cond:
                self._running = False
                self._cond.notify_all()

    def wait_while_running(self, max_wait_s: float, stop: Callable[[], bool], poll_s: float = 0.002) -> float:
        """Wait until no call runs, `stop()` is true (checked every `poll_s`) or `max_wait_s` has passed; returns
        the seconds waited (0.0 when no call ran: the common case, no lock taken)."""
        if not self._running:
            return 0.0
        started = time.perf_counter()
        deadline = started + max_wait_s
        with self._cond:  # a call may end and the next start between two wake-ups: that one is waited for too
            while self._running and not stop():
                left = deadline - time.perf_counter()
                if left <= 0:
                    break
                self._cond.wait(min(poll_s, left))
        return time.perf_counter() - started
