"""docker-compose.yml and the Dockerfiles: valid for every profile (real compose), consistent with the repository."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import tomllib
from pathlib import Path

import pytest
import yaml

from cosyvoice_build.settings import BuildSettings
from tests.build.conftest import REPO_ROOT

COMPOSE_FILE = REPO_ROOT / "docker-compose.yml"
DOCKERFILES = sorted((REPO_ROOT / "docker").glob("*.Dockerfile"))
PROFILES = ("trtllm", "torch", "dit", "replicas2", "replicas4")
#: GPUs of the profiles that run one Triton per GPU
REPLICA_PROFILES = {"replicas2": 2, "replicas4": 4}
GATEWAY_COMMAND = ["python", "-m", "gateway"]
TRITON_IMAGE = "nvcr.io/nvidia/tritonserver:25.06-trtllm-python-py3"
#: Every container starts tritonserver through the launcher (it adds the serving arguments).
TRITON_LAUNCHER = "triton_repo.launch"


def _compose_command() -> list[str] | None:
    if shutil.which("docker"):
        probe = subprocess.run(["docker", "compose", "version"], capture_output=True, check=False)
        if probe.returncode == 0:
            return ["docker", "compose"]
    if shutil.which("docker-compose"):
        return ["docker-compose"]
    return None


@pytest.fixture(scope="module")
def compose() -> list[str]:
    command = _compose_command()
    if command is None:
        pytest.skip("neither `docker compose` nor `docker-compose` is installed (.ci/run installs docker-compose)")
    return command


def compose_config(compose: list[str], compose_file: Path, profile: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*compose, "--profile", profile, "-f", str(compose_file), "config"],
        capture_output=True, text=True, check=False, cwd=compose_file.parent,
    )  # fmt: skip


@pytest.fixture(scope="module")
def configs(compose: list[str]) -> dict[str, dict]:
    """The normalised configuration compose prints for each profile."""
    result = {}
    for profile in PROFILES:
        run = compose_config(compose, COMPOSE_FILE, profile)
        assert run.returncode == 0, f"compose rejects the file for profile {profile}:\n{run.stderr}"
        result[profile] = yaml.safe_load(run.stdout)
    return result


def enabled(config: dict, profile: str) -> dict[str, dict]:
    """Services compose starts for ``profile`` (one without profiles would start for every profile)."""
    return {name: s for name, s in config["services"].items() if profile in s.get("profiles", [profile])}


def command_line(service: dict) -> str:
    command = service.get("command") or []
    return command if isinstance(command, str) else " ".join(command)


def reached_by(url: str, services: dict[str, dict]) -> list[str]:
    """The services a gateway's `TTS_TRITON_URL` reaches: a service by name, or with `dns:///NAME:PORT` every
    service answering to NAME (its name or a network alias: Docker's DNS returns each of them)."""
    name = url.removeprefix("dns:///").split(":")[0]
    def aliases(service: dict) -> list[str]:
        return [alias for net in (service.get("networks") or {}).values() for alias in (net or {}).get("aliases", [])]

    return [n for n, service in services.items() if n == name or name in aliases(service)]


def by_role(services: dict[str, dict]) -> dict[str, list[str]]:
    roles: dict[str, list[str]] = {"gateway": [], "triton": [], "build": []}
    for name, service in services.items():
        command = command_line(service)
        if service.get("command") == GATEWAY_COMMAND:
            roles["gateway"].append(name)
        elif TRITON_LAUNCHER in command:
            roles["triton"].append(name)
        elif "-m cosyvoice_build" in command:
            roles["build"].append(name)
    return roles


@pytest.mark.parametrize("profile", PROFILES)
def test_profile_is_a_complete_stack(configs: dict[str, dict], profile: str) -> None:
    services = enabled(configs[profile], profile)
    roles = by_role(services)
    assert len(roles["gateway"]) == 1 and len(roles["build"]) == 1, roles
    assert roles["triton"], "no tritonserver in this profile"
    assert set(services) == {n for names in roles.values() for n in names}, "a service with an unknown role"
    for name, service in services.items():
        for dependency in service.get("depends_on", {}):
            assert dependency in services, f"{name} depends on {dependency}, which profile {profile} does not start"
    [gateway] = roles["gateway"]
    targets = reached_by(services[gateway]["environment"]["TTS_TRITON_URL"], services)
    assert sorted(targets) == sorted(roles["triton"]), "the gateway must reach every Triton of the profile"
    for target in targets:
        assert services[gateway]["depends_on"][target]["condition"] == "service_healthy"
    assert "/ready" in " ".join(services[gateway]["healthcheck"]["test"])
    # uploaded voices live on a named volume at the directory the gateway image stores them in
    dockerfile = (REPO_ROOT / "docker" / "gateway.Dockerfile").read_text()
    [voices_dir] = re.findall(r"TTS_UPLOADED_VOICES_DIR=(\S+)", dockerfile)
    mounts = [m if isinstance(m, dict) else dict(zip(("source", "target"), m.split(":"))) for m in services[gateway].get("volumes", [])]  # fmt: skip
    named = set(configs[profile].get("volumes", {}))
    assert any(m.get("source") in named and m.get("target") == voices_dir for m in mounts), mounts
    for name in roles["triton"]:
        triton = services[name]
        assert "/v2/health/ready" in " ".join(triton["healthcheck"]["test"])
        assert triton["shm_size"], "the python backend needs more than Docker's 64 MB /dev/shm"
        [device] = triton["deploy"]["resources"]["reservations"]["devices"]
        assert device["capabilities"] == ["gpu"]
    [build] = roles["build"]
    assert any(
        services[t].get("depends_on", {}).get(build, {}).get("condition") == "service_completed_successfully"
        for t in roles["triton"]
    ), "no Triton waits for the one-shot build"


@pytest.mark.parametrize("profile", PROFILES)
def test_triton_serves_the_repository_the_build_renders(configs: dict[str, dict], profile: str) -> None:
    services = enabled(configs[profile], profile)
    roles = by_role(services)
    build_env = services[roles["build"][0]]["environment"]
    settings = BuildSettings(
        work_dir=Path(build_env["COSYVOICE_WORK_DIR"]),
        llm_backend=build_env["COSYVOICE_LLM_BACKEND"],
        triton_layout=build_env["COSYVOICE_TRITON_LAYOUT"],
    )
    for triton in roles["triton"]:
        command = command_line(services[triton])
        assert re.findall(r"--model-repository=(\S+)", command) == [str(settings.triton_repo_dir)]
        if settings.llm_backend == "trtllm":
            # The engine check runs first and must see the build's options to find the same engine directory.
            assert command.index("cosyvoice_build.check_engine") < command.index(TRITON_LAUNCHER)
            triton_env = services[triton]["environment"]
            for key, value in build_env.items():
                if key.startswith("COSYVOICE_"):
                    assert triton_env.get(key) == value, key


@pytest.mark.parametrize("profile", sorted(REPLICA_PROFILES))
def test_replica_profiles_run_one_triton_on_each_gpu(configs: dict[str, dict], profile: str) -> None:
    """One Triton per GPU, each pinned to its own, all serving the one-GPU production repository."""
    services = enabled(configs[profile], profile)
    tritons = by_role(services)["triton"]
    devices = [services[t]["deploy"]["resources"]["reservations"]["devices"] for t in tritons]
    assert all(len(d) == 1 and "count" not in d[0] for d in devices)
    assert sorted(d[0]["device_ids"][0] for d in devices) == [str(i) for i in range(REPLICA_PROFILES[profile])]
    # the same stack as the one-GPU default profile, GPU aside
    default = enabled(configs["trtllm"], "trtllm")
    [one] = by_role(default)["triton"]
    for t in tritons:
        assert services[t]["command"] == default[one]["command"]
        assert services[t]["environment"] == default[one]["environment"]


@pytest.mark.parametrize(
    "profile, token2wav", [("trtllm", "unet"), ("torch", "unet"), ("dit", "dit"), ("replicas4", "unet")]
)
def test_each_profiles_build_renders_its_token2wav(configs, profile, token2wav, monkeypatch):
    """The build environment of each profile, read by the build's own option parser, reaches the render step."""
    from cosyvoice_build.cli import build_parser, settings_from_args
    from cosyvoice_build.triton_render import render_arguments

    services = enabled(configs[profile], profile)
    build_env = services[by_role(services)["build"][0]]["environment"]
    for key in [k for k in os.environ if k.startswith("COSYVOICE_")]:
        monkeypatch.delenv(key)
    for key, value in build_env.items():
        monkeypatch.setenv(key, str(value))
    settings = settings_from_args(build_parser().parse_args(["--to", "render"]))
    arguments = render_arguments(settings)
    assert arguments.get("token2wav", "unet") == token2wav
    if token2wav == "dit":  # the directory the download stage fetches and verifies
        assert arguments["dit_dir"] == settings.dit_dir == Path(build_env["COSYVOICE_WORK_DIR"]) / "Step-Audio-2-mini" / "token2wav"
    assert arguments["layout"] == settings.triton_layout == build_env["COSYVOICE_TRITON_LAYOUT"]


def test_default_profile_is_trtllm() -> None:
    env = dict(line.split("=", 1) for line in (REPO_ROOT / ".env").read_text().splitlines() if line and not line.startswith("#"))
    assert env["COMPOSE_PROFILES"] == "trtllm"


def test_validator_rejects_a_broken_file(compose: list[str], tmp_path: Path) -> None:
    broken = COMPOSE_FILE.read_text().replace("capabilities: [gpu]", "capabilities: gpu", 1)
    assert broken != COMPOSE_FILE.read_text()
    (tmp_path / "docker").mkdir()
    for dockerfile in DOCKERFILES:
        shutil.copy(dockerfile, tmp_path / "docker" / dockerfile.name)
    (tmp_path / "docker-compose.yml").write_text(broken)
    run = compose_config(compose, tmp_path / "docker-compose.yml", "trtllm")
    assert run.returncode != 0 and "capabilities" in run.stderr


# Static checks: paths, images, commands ------------------------------------------------------------------------
@pytest.fixture(scope="module")
def raw_compose() -> dict:
    return yaml.safe_load(COMPOSE_FILE.read_text())


def test_build_contexts_and_dockerfiles_exist(raw_compose: dict) -> None:
    builds = [s["build"] for s in raw_compose["services"].values() if "build" in s]
    assert builds
    for build in builds:
        context = (REPO_ROOT / build["context"]).resolve()
        assert context.is_dir()
        assert (context / build["dockerfile"]).is_file(), build["dockerfile"]


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_dockerfile_sources_exist_and_images_are_pinned(dockerfile: Path) -> None:
    lines = [line.strip() for line in dockerfile.read_text().splitlines()]
    for line in lines:
        if line.startswith("FROM "):
            image = line.split()[1]
            assert ":" in image and not image.endswith(":latest"), f"unpinned base image {image}"
        if line.startswith("COPY ") and "--from" not in line:
            for source in line.split()[1:-1]:
                assert (REPO_ROOT / source).exists(), f"{dockerfile.name} copies missing {source}"


def test_triton_image_is_the_pinned_ngc_trtllm_image() -> None:
    assert f"FROM {TRITON_IMAGE}" in (REPO_ROOT / "docker" / "triton.Dockerfile").read_text()


def test_compose_images_are_pinned(raw_compose: dict) -> None:
    for name, service in raw_compose["services"].items():
        image = service.get("image")
        assert image, f"{name} has no image name"
        assert ":" in image.rsplit("/", 1)[-1] and not image.endswith(":latest"), f"{name}: unpinned image {image}"


def test_python_modules_run_by_containers_exist(raw_compose: dict) -> None:
    commands = [s["command"] for s in raw_compose["services"].values() if "command" in s]
    commands += [_dockerfile_cmd(p) for p in DOCKERFILES]
    words = [w for c in commands for w in (c.split() if isinstance(c, str) else " ".join(c).split())]
    modules = {words[i + 1] for i, w in enumerate(words) if w == "-m"}
    assert modules == {"gateway", "cosyvoice_build", "cosyvoice_build.check_engine", TRITON_LAUNCHER}
    for module in modules:
        package, _, submodule = module.partition(".")
        root = REPO_ROOT / package if (REPO_ROOT / package).is_dir() else REPO_ROOT / "build" / package
        path = root / f"{submodule}.py" if submodule else root / "__main__.py"
        assert path.is_file(), f"`python -m {module}` has no {path}"


def _dockerfile_cmd(dockerfile: Path) -> list[str]:
    [cmd] = [line for line in dockerfile.read_text().splitlines() if line.startswith("CMD ")]
    return yaml.safe_load(cmd[len("CMD ") :])


def test_gateway_container_runs_the_readme_command(raw_compose: dict) -> None:
    assert _dockerfile_cmd(REPO_ROOT / "docker" / "gateway.Dockerfile") == GATEWAY_COMMAND
    gateways = [s for s in raw_compose["services"].values() if "gateway.Dockerfile" in str(s.get("build"))]
    assert gateways and all(s["command"] == GATEWAY_COMMAND for s in gateways)
    # The repository's own ways of running the gateway (`make run` and what it starts) use the same module.
    assert (REPO_ROOT / "gateway" / "__main__.py").is_file()
    launchers = [REPO_ROOT / "Makefile", *(REPO_ROOT / "triton_repo").glob("*.py")]
    pattern = re.compile(r'-m gateway\b|"-m",\s*"gateway"')
    assert [p.name for p in launchers if pattern.search(p.read_text())], "nothing in the repo runs `python -m gateway`"
    readme = REPO_ROOT / "README.md"
    if readme.exists():
        text = readme.read_text()
        assert " ".join(GATEWAY_COMMAND) in text or "make run" in text


def test_gateway_image_runs_as_a_non_root_user() -> None:
    text = (REPO_ROOT / "docker" / "gateway.Dockerfile").read_text()
    users = re.findall(r"^USER (\S+)", text, re.MULTILINE)
    assert users and users[-1] not in ("root", "0")
    # It installs the base package only, whose dependencies include no torch.
    installs = re.findall(r"pip install ([^&\n]+)", text)
    assert [i.strip() for i in installs] == ["."]
    dependencies = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    assert not [d for d in dependencies if re.match(r"torch\b", d)]
