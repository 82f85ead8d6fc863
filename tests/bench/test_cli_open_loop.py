"""tts-bench's open-loop options: settings that mean nothing are refused before any request is sent."""

import pytest

from ttsbench.cli import main


@pytest.mark.parametrize(
    ("options", "message"),
    [(("--rates", "2", "--concurrency", "4"), "--concurrency is for closed loop"),
     (("--rates", "2", "--mode", "both"), "open loop measures streams"),
     (("--rate-search", "2", "--rate-bounds", "4,8", "--search-steps", "0"), "at least one step")],
)  # fmt: skip
def test_open_loop_refuses_settings_that_mean_nothing(tmp_path, voices_dir, capsys, options, message):
    argv = ["triton", "--url", "127.0.0.1:1", "--voices-dir", str(voices_dir), *options]
    assert main(argv) == 2
    assert message in capsys.readouterr().err
