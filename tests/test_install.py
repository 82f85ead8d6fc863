"""What `make` installs: `make demo` / `make run` / `make weights` only what the stack runs (no test tools, torch
from TORCH_INDEX: the CPU build unless told otherwise), `make test` everything the tests need (CI's install)."""

from __future__ import annotations

import re
import shutil
import subprocess
import tomllib

import pytest

from triton_repo.server import REPO_ROOT

pytestmark = pytest.mark.skipif(shutil.which("make") is None, reason="no make")


def _planned_installs(target: str, tmp_path, *variables: str) -> list[str]:
    """The `pip install` lines `make <target>` would run for a venv that does not exist yet (`make -n`)."""
    venv = tmp_path / "venv"
    done = subprocess.run(
        ["make", "-n", "-C", str(REPO_ROOT), target, f"VENV={venv}", *variables],
        capture_output=True, text=True, check=True, timeout=60,
    )  # fmt: skip
    return [line for line in done.stdout.splitlines() if "pip install" in line and "--upgrade pip" not in line]


def _extras(line: str) -> set[str]:
    match = re.search(r"\.\[([a-z,]+)\]", line)
    assert match, line
    return set(match.group(1).split(","))


@pytest.mark.parametrize("target", ["demo", "run", "weights"])
def test_the_stack_installs_the_runtime_only_with_cpu_torch(target, tmp_path):
    [install] = _planned_installs(target, tmp_path)
    assert _extras(install) == {"engine", "triton"}
    assert "--extra-index-url https://download.pytorch.org/whl/cpu" in install


def test_an_empty_torch_index_takes_pypi_alone(tmp_path):
    [install] = _planned_installs("demo", tmp_path, "TORCH_INDEX=")
    assert "--extra-index-url" not in install


def test_make_test_installs_what_the_tests_import_from_pypi_alone(tmp_path):
    [install] = _planned_installs("test", tmp_path)
    assert _extras(install) == {"engine", "triton", "dev"} and "--extra-index-url" not in install


def test_the_runtime_extras_hold_no_test_tool():
    extras = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    runtime = {re.split(r"[<>=!\[ ;]", requirement, maxsplit=1)[0].lower() for requirement in
               extras["engine"] + extras["triton"]}  # fmt: skip
    tools = {re.split(r"[<>=!\[ ;]", requirement, maxsplit=1)[0].lower() for requirement in extras["dev"]}
    assert not runtime & tools, runtime & tools
