"""``python3 -m triton_repo.launch --model-repository=DIR [TRITONSERVER ARGS...]``: the containers' tritonserver.

Compose, the Triton image and Kubernetes start tritonserver through this launcher, so the arguments every
deployment needs are stated once (`triton_repo.server.SERVING_ARGS`, which the local stack passes too). The
launcher adds them to its own arguments (an argument given on the command line wins) and tritonserver replaces
it (`exec`): nothing stays in between, so signals and the exit status are tritonserver's own.

The binary is ``tritonserver`` on PATH (``TRITONSERVER`` overrides it).
"""

from __future__ import annotations

import os
import sys
from typing import Mapping, NoReturn, Sequence

from triton_repo.server import SERVING_ARGS, serving_arg_key


def tritonserver_command(args: Sequence[str], environ: Mapping[str, str]) -> list[str]:
    """tritonserver with `args` and the serving arguments (an argument given in `args` wins)."""
    given = {serving_arg_key(arg) for arg in args}
    return [environ.get("TRITONSERVER", "tritonserver"), *args,
            *(arg for arg in SERVING_ARGS if serving_arg_key(arg) not in given)]


def main(argv: Sequence[str] | None = None) -> NoReturn:
    command = tritonserver_command(list(sys.argv[1:] if argv is None else argv), os.environ)
    sys.stdout.flush()
    os.execvp(command[0], command)  # noqa: S606 - the server replaces the launcher, by design


if __name__ == "__main__":
    main()
