"""The local-stack launcher: what to do without weights (through the real entry point), the demo model cache,
and a real start/stop on the tiny model."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import urllib.request

import pytest

from cosyvoice2.layout import REQUIRED_FILES, model_dir_problems
from tests.reliability.stack_rig import StackProcess
from triton_repo.server import REPO_ROOT
import pipeline_contract as contract
from cosyvoice3.layout import released_dir_problems
from triton_repo.local_stack import (
    DEMO_COSYVOICE3_SUBDIR,
    DEMO_MARKER,
    StackError,
    ensure_demo_cosyvoice3,
    ensure_demo_model,
    main,
)

pytestmark = pytest.mark.triton


def _stack(*args: str, **env: str) -> subprocess.CompletedProcess:
    """`python -m triton_repo.local_stack` as `make run` starts it, in its own process (a developer's COSYVOICE_*
    variables left out: only `env` sets them)."""
    inherited = {k: v for k, v in os.environ.items() if not k.startswith("COSYVOICE_")}
    environment = {**inherited, "PYTHONPATH": str(REPO_ROOT), **env}
    return subprocess.run(
        [sys.executable, "-m", "triton_repo.local_stack", *args], cwd=REPO_ROOT, env=environment,
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip


def _says_what_to_do(stderr: str, model_dir) -> None:
    assert f"no CosyVoice2 weights in {model_dir}" in stderr or f"weights in {model_dir} are incomplete" in stderr
    assert "-m cosyvoice_build --work-dir" in stderr and "--from download --to download" in stderr
    assert "COSYVOICE_MODEL_DIR" in stderr and "make demo" in stderr


def test_missing_weights_say_what_to_do_and_create_nothing(tmp_path):
    model_dir = tmp_path / "models" / "CosyVoice2-0.5B"
    done = _stack("--repo-dir", str(tmp_path / "var" / "repo"), COSYVOICE_MODEL_DIR=str(model_dir))
    assert done.returncode == 2, done.stderr
    _says_what_to_do(done.stderr, model_dir)
    assert f"--work-dir {model_dir.parent} " in done.stderr  # the download lands exactly where it is looked for
    for name in REQUIRED_FILES:
        assert name in done.stderr
    assert list(tmp_path.iterdir()) == []  # no model directory, no rendered repository, no log


def test_incomplete_weights_name_each_missing_file(tmp_path):
    model_dir = tmp_path / "my-weights"
    (model_dir / "CosyVoice-BlankEN").mkdir(parents=True)
    (model_dir / "llm.pt").write_bytes(b"\0" * 32)  # a truncated download
    for name in REQUIRED_FILES[1:4]:
        (model_dir / name).write_bytes(b"x")
    done = _stack("--model-dir", str(model_dir), "--repo-dir", str(tmp_path / "repo"))
    assert done.returncode == 2, done.stderr
    _says_what_to_do(done.stderr, model_dir)
    assert "llm.pt: not a torch.save archive" in done.stderr
    for name in REQUIRED_FILES[4:]:
        assert f"{name}: missing" in done.stderr
    for name in REQUIRED_FILES[1:4]:
        assert f"{name}: missing" not in done.stderr
    # the download stage writes <work dir>/CosyVoice2-0.5B: the message says so and which variable to set then
    assert f"COSYVOICE_MODEL_DIR={tmp_path / 'CosyVoice2-0.5B'}" in done.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["my-weights"]


def test_the_demo_model_is_written_once_and_only_where_it_may(tmp_path):
    demo_dir = tmp_path / "cache" / "demo-model"
    assert ensure_demo_model(demo_dir) == demo_dir
    assert model_dir_problems(demo_dir) == [] and (demo_dir / DEMO_MARKER).is_file()
    assert [p.name for p in demo_dir.parent.iterdir()] == ["demo-model"]  # no staging directory left
    written = {p: p.stat().st_mtime_ns for p in demo_dir.rglob("*")}
    ensure_demo_model(demo_dir)
    assert {p: p.stat().st_mtime_ns for p in demo_dir.rglob("*")} == written  # cached: not written again
    (demo_dir / "flow.pt").unlink()  # damaged: ours, so it is rewritten
    ensure_demo_model(demo_dir)
    assert model_dir_problems(demo_dir) == []
    # the demo's CosyVoice3: every released file (serving reads the tokenizer and the frontend models too), inside
    # the one demo directory, written once as well
    cv3 = ensure_demo_cosyvoice3(demo_dir)
    assert cv3 == demo_dir / DEMO_COSYVOICE3_SUBDIR and released_dir_problems(cv3) == []
    assert (cv3 / DEMO_MARKER).is_file() and "CosyVoice3" in (cv3 / DEMO_MARKER).read_text()
    assert sorted(p.name for p in demo_dir.iterdir() if p.name.startswith(".")) == []  # no staging directory left
    written = {p: p.stat().st_mtime_ns for p in demo_dir.rglob("*")}
    assert ensure_demo_model(demo_dir) == demo_dir and ensure_demo_cosyvoice3(demo_dir) == cv3
    assert {p: p.stat().st_mtime_ns for p in demo_dir.rglob("*")} == written  # both cached
    (cv3 / "llm.pt").unlink()  # damaged: rewritten, CosyVoice2's untouched
    ensure_demo_cosyvoice3(demo_dir)
    assert released_dir_problems(cv3) == []
    assert (demo_dir / "flow.pt").stat().st_mtime_ns == written[demo_dir / "flow.pt"]
    foreign = tmp_path / "photos"
    foreign.mkdir()
    (foreign / "holiday.jpg").write_bytes(b"jpeg")
    with pytest.raises(StackError, match="holds no demo model"):
        ensure_demo_model(foreign)
    assert [p.name for p in foreign.iterdir()] == ["holiday.jpg"]


def test_the_demo_serves_its_own_cosyvoice3_and_refuses_another_before_writing_anything(tmp_path):
    done = _stack("--demo", "--demo-dir", str(tmp_path / "demo"), COSYVOICE_COSYVOICE3_DIR=str(tmp_path / "cv3"))
    assert done.returncode == 2, done.stderr
    assert "leave --cosyvoice3-dir / COSYVOICE_COSYVOICE3_DIR unset" in done.stderr
    assert list(tmp_path.iterdir()) == []


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


@pytest.mark.parametrize("variable, flag", [("COSYVOICE_SPARK_DIR", "--spark-dir"),
                                            ("COSYVOICE_COSYVOICE3_DIR", "--cosyvoice3-dir")])
def test_another_models_dir_comes_from_the_environment_and_is_checked(tiny_model_dir, tmp_path, monkeypatch, capsys,
                                                                      variable, flag):
    monkeypatch.setenv(variable, str(tmp_path / "not_there"))
    assert main(["--model-dir", str(tiny_model_dir), "--repo-dir", str(tmp_path / "repo")]) == 2
    assert flag in capsys.readouterr().err and not (tmp_path / "repo").exists()


@pytest.mark.timeout(1200)  # the whole stack: its start (up to START_TIMEOUT_S, again after a port conflict)
def test_stack_serves_the_gateway_and_stops_cleanly_on_sigint(tiny_model_dir, tmp_path):
    # the rig picks free ports and starts again on new ones if another process took one first
    stack = StackProcess(tiny_model_dir, tmp_path)
    try:
        stack.start()
        stack.proc.send_signal(signal.SIGINT)
        assert stack.proc.wait(120) == 0
        assert "[stack] stopping" in stack.log_path.read_text()
        # tritonserver unloaded every model before it exited (its log beside the stack's repository)
        triton_log = (tmp_path / "tritonserver.log").read_text(errors="replace").split("Signal (15) received.")[-1]
        assert "Exit timeout expired" not in triton_log
        assert f"successfully unloaded '{contract.STREAMING_MODEL}'" in triton_log  # the engine's process
    finally:
        stack.stop()
    with pytest.raises(OSError):
        urllib.request.urlopen(f"{stack.url}/health", timeout=2)
