"""``python3 -m triton_repo.launch --model-repository=DIR [TRITONSERVER ARGS...]``: the containers' tritonserver.

Compose, the Triton image and Kubernetes start tritonserver through this launcher, so the arguments every
deployment needs are stated once (`triton_repo.server.SERVING_ARGS`, which the local stack passes too) and CUDA
MPS is started the same way everywhere:

* ``COSYVOICE_CUDA_MPS`` off (the default): tritonserver replaces this process (`exec`), nothing stays in between.
* ``COSYVOICE_CUDA_MPS=on``: a CUDA MPS control daemon is started first (`triton_repo.cuda_mps`: the model
  processes then share each GPU at once instead of in time slices), tritonserver runs as a child with the
  daemon's variables, SIGTERM/SIGINT are passed on to it, and the daemon is told to quit once tritonserver has
  exited; the launcher exits with tritonserver's status. A daemon that cannot start stops the launch at once
  (exit status 2) with a message naming the setting.

The binary is ``tritonserver`` on PATH (``TRITONSERVER`` overrides it).
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
from typing import Sequence

from triton_repo.cuda_mps import SETTING_ENV, MpsDaemon, MpsError, mps_setting
from triton_repo.server import SERVING_ARGS

logger = logging.getLogger("triton_repo.launch")

#: Exit status of a launch refused for a setting (as the local stack's).
BAD_SETTINGS = 2


def tritonserver_command(args: Sequence[str], environ: dict[str, str]) -> list[str]:
    """tritonserver with `args` and the serving arguments (an argument given in `args` wins)."""
    given = {arg.split("=", 1)[0] for arg in args}
    return [environ.get("TRITONSERVER", "tritonserver"), *args,
            *(arg for arg in SERVING_ARGS if arg.split("=", 1)[0] not in given)]


def run_with_mps(command: list[str], daemon: MpsDaemon) -> int:
    """Start `daemon`, run `command` as its client until it exits (signals passed on), stop the daemon."""
    daemon.start()
    try:
        child = subprocess.Popen(command, env=dict(os.environ, **daemon.env()))  # noqa: S603 - the server
        forwarded = {sig: signal.signal(sig, lambda number, _frame: child.send_signal(number))
                     for sig in (signal.SIGTERM, signal.SIGINT)}
        try:
            return child.wait()
        finally:
            for sig, handler in forwarded.items():
                signal.signal(sig, handler)
    finally:
        daemon.stop()


def main(argv: Sequence[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    args = list(sys.argv[1:] if argv is None else argv)
    command = tritonserver_command(args, dict(os.environ))
    try:
        mps = mps_setting(os.environ.get(SETTING_ENV))
        if not mps:
            sys.stdout.flush()
            os.execvp(command[0], command)  # noqa: S606 - the server replaces the launcher, by design
        status = run_with_mps(command, MpsDaemon())
    except MpsError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return BAD_SETTINGS
    return status if status >= 0 else 128 - status  # killed by a signal: the shell's convention


if __name__ == "__main__":
    raise SystemExit(main())
