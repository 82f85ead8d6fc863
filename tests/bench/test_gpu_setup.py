"""scripts/gpu_setup.sh in its dry-run mode: the pip commands it would run cover every package the stack
imports at run time, the Triton stubs get a numpy < 2 environment, offline mode never asks an index."""

from __future__ import annotations

import ast
import re
import importlib.metadata
import shlex
import shutil
import subprocess
import sys
import tomllib

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from triton_repo.server import REPO_ROOT

SCRIPT = REPO_ROOT / "scripts" / "gpu_setup.sh"
#: What runs on the GPU machine: the gateway, the engine, the serving layer, the Triton models, the benchmarks,
#: the soak.
RUNTIME_SOURCES = ["pipeline_contract", "gateway", "cosyvoice2", "speech_serving", "triton_repo", "benchmarks/ttsbench",
                   "benchmarks/stackbench", "benchmarks/enginebench", "tests/reliability/soak.py",
                   "tests/reliability/stack_rig.py"]  # fmt: skip
FIRST_PARTY = {"pipeline_contract", "gateway", "cosyvoice2", "speech_serving", "triton_repo", "ttsbench", "stackbench",
               "enginebench", "spark_tts", "cosyvoice_build", "tests"}  # fmt: skip
#: Imported at run time but not installed by the script, with the reason.
PROVIDED = {
    "torch": "the machine's CUDA build (the script checks it and pins it, never installs it)",
    "triton": "the kernel compiler that ships with CUDA builds of torch",
    "triton_python_backend_utils": "provided to the models by Triton's python backend",
    "datasets": "optional: tts-bench --seed-tts says how to get it",
    "pynvml": "optional: stack-bench samples the GPU with nvidia-smi without it",
}
NO_VALUE_OPTIONS = {"--no-deps", "--upgrade", "--no-index", "--no-build-isolation", "--disable-pip-version-check"}


def dry_run(*options: str) -> str:
    done = subprocess.run(["bash", str(SCRIPT), "--dry-run", "--python", sys.executable, *options],  # noqa: S603
                          capture_output=True, text=True, timeout=120)  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


def pip_installs(output: str) -> list[list[str]]:
    """The argument lists of the `pip install` commands in a dry run's output."""
    commands = []
    for line in output.splitlines():
        if line.startswith("+ ") and " -m pip install " in line:
            words = shlex.split(line[2:])
            commands.append(words[words.index("install") + 1 :])
    return commands


def requirements_of(command: list[str]) -> tuple[list[str], bool]:
    """(requirement strings, whether their dependencies are installed too) of one pip install command."""
    reqs, i = [], 0
    while i < len(command):
        word = command[i]
        if word == "-e":
            reqs.append(project_requirement(command[i + 1]))
            i += 2
        elif word in NO_VALUE_OPTIONS:
            i += 1
        elif word.startswith("-"):
            i += 2  # -c FILE, --find-links DIR, --target DIR
        else:
            reqs.append(word)
            i += 1
    return reqs, "--no-deps" not in command


def project_requirement(spec: str) -> str:
    path, _, extras = spec.partition("[")
    assert path == str(REPO_ROOT), spec
    return f"cosyvoice-serve[{extras}" if extras else "cosyvoice-serve"


def project_requires(extras: set[str]) -> list[Requirement]:
    project = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["project"]
    reqs = list(project["dependencies"])
    for extra in extras:
        reqs += project["optional-dependencies"][extra]
    return [Requirement(r) for r in reqs]


def installed_closure(output: str) -> set[str]:
    """Every distribution the dry run's pip commands would end up installing (or keeping), by name."""
    todo: list[tuple[Requirement, bool]] = []
    for command in pip_installs(output):
        reqs, with_deps = requirements_of(command)
        todo += [(Requirement(r), with_deps) for r in reqs]
    names: set[str] = set()
    seen: set[tuple[str, frozenset[str]]] = set()
    while todo:
        req, with_deps = todo.pop()
        name = canonicalize_name(req.name)
        names.add(name)
        if not with_deps or (name, frozenset(req.extras)) in seen:
            continue
        seen.add((name, frozenset(req.extras)))
        if name == "cosyvoice-serve":  # the checkout's own metadata, not an installed copy's
            requires = project_requires(set(req.extras))
        else:
            try:
                requires = [Requirement(r) for r in importlib.metadata.requires(req.name) or []]
            except importlib.metadata.PackageNotFoundError:
                continue
        for r in requires:
            if r.marker is None or any(r.marker.evaluate({"extra": e}) for e in (req.extras or {""})):
                todo.append((r, True))
    return names


def runtime_modules() -> set[str]:
    """Top-level third-party modules imported anywhere in the run-time code (also inside functions)."""
    modules: set[str] = set()
    for source in RUNTIME_SOURCES:
        path = REPO_ROOT / source
        for file in [path] if path.is_file() else path.rglob("*.py"):
            for node in ast.walk(ast.parse(file.read_text())):
                if isinstance(node, ast.Import):
                    modules |= {alias.name.split(".")[0] for alias in node.names}
                elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                    modules.add(node.module.split(".")[0])
    return {m for m in modules if m not in sys.stdlib_module_names and m not in FIRST_PARTY}


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, tuple[str, object]]:
    """The dry runs (each starts PY once, which imports torch: slow), by name: (output, stub env dir)."""
    root = tmp_path_factory.mktemp("gpu_setup")
    wheels = root / "wheels"
    wheels.mkdir()
    return {
        "one-env": (dry_run("--stub-env", str(root / "a")), root / "a"),
        "stub-env": (dry_run("--separate-stub-env", "--stub-env", str(root / "b")), root / "b"),
        "offline": (dry_run("--separate-stub-env", "--stub-env", str(root / "c"), "--offline-wheels", str(wheels)),
                    wheels),
    }


@pytest.mark.parametrize("name", ["one-env", "stub-env"])
def test_every_package_the_stack_imports_is_installed(runs, name):
    output, _ = runs[name]
    installed = installed_closure(output)
    owners = importlib.metadata.packages_distributions()
    missing = {}
    for module in sorted(runtime_modules() - set(PROVIDED)):
        distributions = {canonicalize_name(d) for d in owners.get(module, [])}
        if not distributions & installed:
            missing[module] = sorted(distributions) or "not installed here either"
    assert not missing, f"imported at run time but not installed by gpu_setup.sh: {missing}"
    assert "nvidia-pytriton" in installed  # the tritonserver binary


def test_one_environment_when_numpy_is_below_2(runs):
    import numpy

    assert int(numpy.__version__.split(".")[0]) < 2  # this test environment, like the stub's
    output, stub = runs["one-env"]
    (install,) = pip_installs(output)
    assert f"{REPO_ROOT}[engine,triton,bench]" in install
    assert f"torch=={importlib.metadata.version('torch')}" in output  # the installed torch is pinned, never replaced
    assert " -m venv " not in output and "--stub-env" not in output
    assert f"{sys.executable} -m stackbench --repeat 3" in output
    assert f"{sys.executable} -m tests.reliability.soak --full-size --device cuda --concurrency 64" in output
    assert not stub.exists()


def test_separate_stub_environment_has_numpy_below_2(runs):
    output, stub = runs["stub-env"]
    assert f"+ {sys.executable} -m venv --without-pip --clear {stub}" in output
    site = stub / "lib" / f"python{sys.version_info[0]}.{sys.version_info[1]}" / "site-packages"
    (stub_install,) = [c for c in pip_installs(output) if "--target" in c]
    assert stub_install[stub_install.index("--target") + 1] == str(site)
    assert {"numpy<2", "ml_dtypes<=0.5.4"} <= set(stub_install) and "--no-deps" in stub_install
    assert "hidden: numpy, scipy, scikit-learn, ml_dtypes" in output
    assert f"+ {stub}/bin/python3 -c " in output  # the imports are checked with the stubs' interpreter
    assert f"-m stackbench --stub-env {stub} --repeat 3" in output
    assert f"-m tests.reliability.soak --full-size --device cuda --stub-env {stub} --concurrency 64" in output
    assert f"-m stackbench --stub-env {stub} --repeat 3 --token2wav dit" in output
    assert f"-m stackbench --stub-env {stub} --spark --repeat 3" in output  # Spark-TTS's numbers too
    main_install = pip_installs(output)[0]
    assert f"{REPO_ROOT}[engine,bench]" in main_install  # not the triton extra: it would pull numpy < 2 in
    assert not stub.exists()  # a dry run creates nothing


def test_offline_wheels_never_ask_an_index(runs):
    output, wheels = runs["offline"]
    commands = pip_installs(output)
    assert len(commands) == 3
    for command in commands:
        assert "--no-index" in command and command[command.index("--find-links") + 1] == str(wheels)
    assert "--no-build-isolation" in commands[0]  # the editable build cannot fetch setuptools either


def test_unknown_options_are_refused():
    done = subprocess.run(["bash", str(SCRIPT), "--frobnicate"], capture_output=True, text=True, timeout=60)  # noqa: S603
    assert done.returncode == 2 and "unknown option --frobnicate" in done.stderr


@pytest.mark.skipif(shutil.which("shellcheck") is None, reason="shellcheck is not installed (apt-get install shellcheck)")
def test_shellcheck_is_clean():
    done = subprocess.run(["shellcheck", str(SCRIPT)], capture_output=True, text=True, timeout=60)  # noqa: S603
    assert done.returncode == 0, done.stdout


def test_help_lists_exactly_the_accepted_options():
    done = subprocess.run(["bash", str(SCRIPT), "--help"], capture_output=True, text=True, timeout=60)  # noqa: S603
    assert done.returncode == 0
    documented = set(re.findall(r"^  (--[a-z-]+)", done.stdout, re.M))
    accepted = set(re.findall(r"^    (--[a-z-]+)(?:\|-h)?\)", SCRIPT.read_text(), re.M))
    assert documented == accepted - {"--help"}
    assert "--offline-wheels" in accepted and "--dry-run" in accepted


def test_offline_wheels_download_every_requirement_but_torch(tmp_path):
    """scripts/offline_wheels.sh (dry run) asks pip for the wheels of every requirement `gpu_setup.sh` installs
    (pyproject's base, engine, triton and bench lists) except torch, for the GPU machine's Python, binaries only."""
    done = subprocess.run(["bash", str(REPO_ROOT / "scripts" / "offline_wheels.sh"), str(tmp_path / "w"),  # noqa: S603
                           "--python-version", "3.12", "--dry-run"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr
    (line,) = [line for line in done.stdout.splitlines() if line.startswith("+ ")]
    words = shlex.split(line[2:])
    assert words[1:4] == ["-m", "pip", "download"] and "--only-binary=:all:" in words
    assert words[words.index("--python-version") + 1] == "3.12"
    assert words[words.index("--dest") + 1] == str(tmp_path / "w") and not (tmp_path / "w").exists()
    asked = {canonicalize_name(Requirement(w).name) for w in words[words.index("--dest") + 2 :]}
    project = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["project"]
    extras = project["optional-dependencies"]
    listed = {canonicalize_name(Requirement(r).name)
              for r in [*project["dependencies"], *extras["engine"], *extras["triton"], *extras["bench"]]}
    assert asked == listed - {"torch"} and "nvidia-pytriton" in asked
