"""The reliability rig: one local stack (`python -m triton_repo.local_stack`) on the tiny model, on loopback,
shared by the soak and fault suites of one test run (tests/reliability/stack_rig.py)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.reliability.stack_rig import SPEECH_RATIO, StackProcess


@pytest.fixture(scope="session")
def tiny_stack(tmp_path_factory) -> Iterator[StackProcess]:
    from cosyvoice2.testing import write_tiny_model

    model_dir = write_tiny_model(tmp_path_factory.mktemp("stack_model"))
    stack = StackProcess(
        model_dir, tmp_path_factory.mktemp("stack"), extra_env={"TTS_DRAIN_GRACE_S": "60"}, extra_args=SPEECH_RATIO
    ).start()
    yield stack
    stack.stop()
