"""`make demo` end to end: `python -m triton_repo.local_stack --demo` writes its random model into a cache directory,
serves it through the real tritonserver and gateway, labels what it serves, and stops cleanly on SIGTERM."""

from __future__ import annotations

import io
import os
import signal
import wave
from pathlib import Path

import numpy as np
import openai
import pytest

from gateway.demo import DEMO_COSYVOICE3_MODEL, DEMO_HEADER, DEMO_HEADER_VALUE, DEMO_MODEL_ID
from tests.reliability.stack_rig import StackProcess, descendants, http_status
from triton_repo.local_stack import DEMO_COSYVOICE3_SUBDIR, DEMO_MARKER

#: The whole stack: its start (up to START_TIMEOUT_S, again after a port conflict), the calls, the drain.
pytestmark = [pytest.mark.triton, pytest.mark.timeout(1200)]


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def test_the_demo_serves_labelled_noise_through_the_openai_sdk_and_stops_cleanly(tmp_path):
    demo_dir = tmp_path / "cache" / "demo-model"
    stack = StackProcess(
        model_dir=tmp_path / "no-weights-here",  # the demo needs none: what make run would look at is ignored
        work_dir=tmp_path,
        extra_args=("--demo", "--demo-dir", str(demo_dir)),
    )
    try:
        stack.start()
        assert (demo_dir / DEMO_MARKER).is_file() and not (tmp_path / "no-weights-here").exists()
        assert (demo_dir / DEMO_COSYVOICE3_SUBDIR / DEMO_MARKER).is_file()  # and its CosyVoice3, in the same cache
        log = stack.log_path.read_text()
        base_url = f"http://127.0.0.1:{stack.gateway_port}/v1"
        assert "DEMO MODE" in log and f"Base URL (OpenAI SDKs, Open WebUI, ...): {base_url}" in log
        assert f"curl -sS -D - {base_url}/audio/speech" in log and f'OpenAI(base_url="{base_url}"' in log
        assert f'model="{DEMO_COSYVOICE3_MODEL}"' in log

        client = openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=120)
        models = client.models.with_raw_response.list()
        assert models.headers[DEMO_HEADER] == DEMO_HEADER_VALUE
        assert models.parse().data[0].id == DEMO_MODEL_ID
        assert DEMO_COSYVOICE3_MODEL in {model.id for model in models.parse().data}  # served out of the box
        # an integration wired for OpenAI's names works unchanged; CosyVoice3 is one model name away
        for model in (DEMO_MODEL_ID, "tts-1", DEMO_COSYVOICE3_MODEL):
            speech = client.audio.speech.with_raw_response.create(
                model=model, voice="alloy", input="Wiring up a client.", response_format="wav"
            )
            assert speech.headers[DEMO_HEADER] == DEMO_HEADER_VALUE
            with wave.open(io.BytesIO(speech.content)) as wav:
                assert (wav.getframerate(), wav.getnchannels(), wav.getsampwidth()) == (24000, 1, 2)
                samples = np.frombuffer(wav.readframes(wav.getnframes()), np.int16)
            # benchmark mode (both models): 2 speech tokens (2 x 960 samples) per text token, a few hundred ms at least
            assert samples.size >= 24000 // 4 and np.abs(samples).max() > 0

        processes = [stack.proc.pid, *descendants(stack.proc.pid)]
        assert len(processes) >= 4  # the stack, the gateway, tritonserver and its model stubs
        stack.proc.send_signal(signal.SIGTERM)
        assert stack.proc.wait(120) == 0
        assert "[stack] stopping" in stack.log_path.read_text()
        assert [pid for pid in processes if _alive(pid)] == []
        assert http_status(f"{stack.url}/health") == 0
        assert list(Path("/dev/shm").glob(f"cvs{stack.grpc_port}_*")) == []  # tritonserver's shm regions
    finally:
        stack.stop()
    assert os.listdir(demo_dir.parent) == ["demo-model"]  # the model stays cached for the next demo
