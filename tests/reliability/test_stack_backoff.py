"""The local stack's restart back-off and port settings (no processes started)."""

from __future__ import annotations

import pytest

from triton_repo.local_stack import Backoff, StackError, _env_port


def test_restart_delays_double_up_to_the_cap_and_reset_after_a_good_run():
    backoff = Backoff(initial_s=1, maximum_s=8, reset_after_s=60)
    assert [backoff.delay(uptime_s=2) for _ in range(6)] == [1, 2, 4, 8, 8, 8]
    assert backoff.delay(uptime_s=61) == 1  # it ran fine for a while: start over
    assert backoff.delay(uptime_s=0) == 2


@pytest.mark.parametrize(("value", "port"), [(None, 0), ("", 0), ("0", 0), ("8001", 8001)])
def test_triton_ports_come_from_the_environment(monkeypatch, value, port):
    if value is None:
        monkeypatch.delenv("COSYVOICE_TRITON_GRPC_PORT", raising=False)
    else:
        monkeypatch.setenv("COSYVOICE_TRITON_GRPC_PORT", value)
    assert _env_port("COSYVOICE_TRITON_GRPC_PORT") == port


@pytest.mark.parametrize("value", ["http", "-1", "70000"])
def test_a_bad_port_setting_is_a_clear_error(monkeypatch, value):
    monkeypatch.setenv("COSYVOICE_TRITON_HTTP_PORT", value)
    with pytest.raises(StackError, match="COSYVOICE_TRITON_HTTP_PORT"):
        _env_port("COSYVOICE_TRITON_HTTP_PORT")
