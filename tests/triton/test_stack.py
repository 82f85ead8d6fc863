"""The local-stack launcher: clear message without weights, and a real start/stop on the tiny model."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import urllib.request

import pytest

from triton_repo.server import REPO_ROOT, free_port
from triton_repo.stack import StackError, ensure_model_dir, main

pytestmark = pytest.mark.triton


def test_an_empty_model_dir_with_an_unusual_name_gets_instructions(tmp_path):
    with pytest.raises(StackError, match="CosyVoice2-0.5B"):
        ensure_model_dir(tmp_path / "somewhere")


def test_the_dit_token2wav_is_chosen_from_the_environment_and_needs_its_directory(
    tiny_model_dir, tmp_path, monkeypatch, capsys
):
    monkeypatch.setenv("COSYVOICE_TOKEN2WAV", "dit")
    monkeypatch.setenv("COSYVOICE_DIT_DIR", str(tmp_path / "no_dit"))
    assert main(["--model-dir", str(tiny_model_dir), "--repo-dir", str(tmp_path / "repo")]) == 2
    assert "does not exist" in capsys.readouterr().err and not (tmp_path / "repo").exists()
    monkeypatch.delenv("COSYVOICE_DIT_DIR")
    assert main(["--model-dir", str(tiny_model_dir), "--repo-dir", str(tmp_path / "repo")]) == 2
    assert "--token2wav dit needs --dit-dir" in capsys.readouterr().err


def test_a_spark_dir_comes_from_the_environment_and_is_checked(tiny_model_dir, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("COSYVOICE_SPARK_DIR", str(tmp_path / "no_spark"))
    assert main(["--model-dir", str(tiny_model_dir), "--repo-dir", str(tmp_path / "repo")]) == 2
    assert "--spark-dir" in capsys.readouterr().err and not (tmp_path / "repo").exists()


def test_stack_serves_the_gateway_and_stops_cleanly_on_sigint(tiny_model_dir, tmp_path):
    port = free_port()
    env = {**os.environ, "TTS_PORT": str(port), "PYTHONPATH": str(REPO_ROOT)}
    proc = subprocess.Popen(
        [sys.executable, "-m", "triton_repo.stack", "--model-dir", str(tiny_model_dir), "--repo-dir", str(tmp_path / "repo")],
        cwd=REPO_ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 300
        ready = False
        while time.monotonic() < deadline and proc.poll() is None and not ready:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/ready", timeout=2) as response:
                    ready = response.status == 200
            except OSError:
                time.sleep(0.5)
        assert ready, proc.stdout.read() if proc.poll() is not None else "gateway never became ready"
        proc.send_signal(signal.SIGINT)
        assert proc.wait(60) == 0
        output = proc.stdout.read()
        assert "[stack] stopping" in output
    finally:
        if proc.poll() is None:
            proc.kill()
    with pytest.raises(OSError):
        urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2)
