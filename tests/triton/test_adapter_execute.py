"""Every Triton model's `execute` is a plain function, and `serve` hands requests to the process's serving loop.

The python stub runs an `async def execute` of a decoupled model in the background and keeps its future in a set
that a done-callback empties; it registers the callback before it adds the future, so a coroutine that finished in
between (a request refused at once) left an error line and a future behind for good. The adapters avoid that path
altogether; the real-server check is `test_pipeline.py`'s bookkeeping test, which a rare race cannot fail on
demand, so this one fails whenever a model's `execute` becomes a coroutine function again.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
ADAPTERS = sorted(p.stem for p in (REPO_ROOT / "triton_repo" / "adapters").glob("*.py") if p.stem != "__init__")

# In a fresh interpreter: the adapters import `triton_python_backend_utils`, which exists only inside tritonserver.
_PROBE = """
import importlib, inspect, json, sys
from unittest import mock
sys.modules["triton_python_backend_utils"] = mock.MagicMock()
found = {}
for name in sys.argv[1:]:
    module = importlib.import_module("triton_repo.adapters." + name)
    for attr, value in vars(module).items():
        # the models `handler_model` makes (engine, LLM, token2wav) are classes defined in `common`, named here
        if inspect.isclass(value) and callable(getattr(value, "execute", None)):
            found[name + "." + attr] = inspect.iscoroutinefunction(value.execute)
print(json.dumps(found))
"""

_SERVE = """
import asyncio, json, sys, threading
from unittest import mock
pb = mock.MagicMock()
pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL = 1
sys.modules["triton_python_backend_utils"] = pb
from triton_repo.adapters import common

sent, done = [], threading.Event()

class Sender:
    def send(self, response=None, flags=0):
        sent.append((response is not None, flags, threading.current_thread().name))
        if len(sent) == 2:
            done.set()

class Request:
    def get_response_sender(self):
        return Sender()

async def handle(request, sender):
    await asyncio.sleep(0.05)
    if request.fail:
        raise ValueError("refused")
    sender.send(object(), flags=common.FINAL)

good, bad = Request(), Request()
good.fail, bad.fail = False, True
returned = common.serve([good, bad], handle, cancellable=False)
answered_before_return = bool(sent)
assert done.wait(10), "no answer"
print(json.dumps({"returned": returned, "answered_before_return": answered_before_return, "sent": sent,
                  "error_responses": pb.TritonError.call_count}))
"""


def _python(code: str, *args: str) -> str:
    done = subprocess.run([sys.executable, "-c", code, *args], cwd=REPO_ROOT, capture_output=True, text=True,  # noqa: S603
                          timeout=180, check=False)
    assert done.returncode == 0, done.stderr
    return done.stdout.strip().splitlines()[-1]


def test_no_model_execute_is_a_coroutine_function():
    found = json.loads(_python(_PROBE, *ADAPTERS))
    assert {"common.PipelineEntryModel", "voice_prompt.TritonPythonModel"} <= found.keys(), found  # it saw the models
    assert any(name.startswith("engine_entry.") for name in found), found  # and the engine's process
    assert [name for name, is_coroutine in found.items() if is_coroutine] == []


def test_serve_returns_at_once_and_answers_on_the_serving_loop():
    out = json.loads(_python(_SERVE))
    assert out["returned"] is None and not out["answered_before_return"]
    assert sorted(flags for _, flags, _ in out["sent"]) == [1, 1]  # each request answered once, with FINAL
    assert {thread for *_, thread in out["sent"]} == {"serving-loop"}
    assert out["error_responses"] == 1  # the failure went back as the request's error response


_STALL = """
import asyncio, json, sys
from unittest import mock
sys.modules["triton_python_backend_utils"] = mock.MagicMock()
import numpy as np
from speech_serving.errors import RemoteError
from speech_serving.io_struct import LLMRequest
from triton_repo.adapters import common, engine_entry
from triton_repo.model_params import InternalModels

common.BLS_STALL_TIMEOUT_S = 0.2
cancelled = []

class Silent:
    '''An engine whose LLM hands over one delivery and then nothing, and whose token2wav never answers.'''
    class llm:
        class scheduler:
            pass
        @staticmethod
        async def deliveries(request_id, request):
            try:
                yield [7, 8], False
                await asyncio.sleep(3600)
            finally:
                cancelled.append(request_id)
    class token2wav:
        class service:
            @staticmethod
            async def process(*args):
                await asyncio.sleep(3600)

async def main():
    models = InternalModels("cosyvoice2_stream", "cosyvoice2_stream", True, True)
    clients = engine_entry.EngineClients(Silent, vocab=None, models=models)
    got, errors = [], []
    try:
        async for ids in clients.llm("r1", LLMRequest(np.zeros(3, np.int32), 0, 10, 0, 25, 0.8, 1.0, True, (5,))):
            got.append(ids)
    except RemoteError as exc:
        errors.append(str(exc))
    try:
        await clients.token2wav("r1", np.zeros(4, np.int32), None, None, 0)
    except RemoteError as exc:
        errors.append(str(exc))
    print(json.dumps({"got": got, "errors": errors, "cancelled": cancelled}))

asyncio.run(main())
"""


def test_an_engine_part_that_goes_silent_fails_the_request_instead_of_hanging_it():
    """In the engine's process (the colocated layout's streaming entry model) the orchestrator's calls keep the
    deadline its BLS calls have: an LLM that stops handing over tokens, or a token2wav call that never ends, becomes
    an error (and the LLM's sequence is let go)."""
    out = json.loads(_python(_STALL))
    assert out["got"] == [[7, 8]]
    assert len(out["errors"]) == 2 and all("sent no response" in e for e in out["errors"]), out["errors"]
    assert "(LLM)" in out["errors"][0] and "(token2wav)" in out["errors"][1]
    assert out["cancelled"] == ["r1"]
