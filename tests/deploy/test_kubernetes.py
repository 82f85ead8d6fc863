"""deploy/kubernetes: every overlay rendered by a real kustomize, schema-checked with kubernetes-validate, and
consistent with the code it deploys (settings names, the build's paths, the gateway's metrics and probes)."""

from __future__ import annotations

import copy
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from gateway.metrics import GatewayMetrics
from gateway.settings import Settings

REPO_ROOT = Path(__file__).resolve().parents[2]
KUBERNETES_DIR = REPO_ROOT / "deploy" / "kubernetes"
#: overlay -> (LLM backend, Triton layout, GPUs per Triton pod): the compose profiles' choices.
OVERLAYS = {
    "torch": ("torch", "colocated", 1),
    "tensorrt-llm": ("trtllm", "single", 1),
}
KUBERNETES_VERSION = "1.30.0"


def _renderer() -> list[str] | None:
    if shutil.which("kustomize"):
        return ["kustomize", "build"]
    if shutil.which("kubectl"):
        return ["kubectl", "kustomize"]
    return None


@pytest.fixture(scope="module")
def rendered() -> dict[str, list[dict]]:
    command = _renderer()
    if command is None:
        pytest.skip("neither `kustomize` nor `kubectl` (which embeds kustomize) is installed")
    out = {}
    for overlay in OVERLAYS:
        result = subprocess.run([*command, str(KUBERNETES_DIR / "overlays" / overlay)],
                                capture_output=True, text=True, check=False)
        assert result.returncode == 0, result.stderr
        out[overlay] = [doc for doc in yaml.safe_load_all(result.stdout) if doc]
    return out


@pytest.fixture(scope="module")
def validate():
    kubernetes_validate = pytest.importorskip("kubernetes_validate", reason="pip install kubernetes-validate (dev extra)")

    def check(doc: dict) -> None:
        kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)

    return check


def find(docs: list[dict], kind: str, name: str) -> dict:
    [doc] = [d for d in docs if d["kind"] == kind and re.fullmatch(rf"{name}(-[a-z0-9]{{10}})?", d["metadata"]["name"])]
    return doc


def container(deployment: dict, name: str) -> dict:
    [found] = [c for c in deployment["spec"]["template"]["spec"]["containers"] if c["name"] == name]
    return found


@pytest.mark.parametrize("overlay", list(OVERLAYS))
def test_every_rendered_object_passes_the_kubernetes_schema(rendered, validate, overlay):
    kinds = sorted(doc["kind"] for doc in rendered[overlay])
    assert kinds == sorted(["ConfigMap", "ConfigMap", "Deployment", "Deployment", "Service", "Service", "Job",
                            "PersistentVolumeClaim", "PersistentVolumeClaim", "HorizontalPodAutoscaler",
                            "PodDisruptionBudget"])
    for doc in rendered[overlay]:
        validate(doc)


def test_the_validator_rejects_a_broken_object(rendered, validate):
    gateway = copy.deepcopy(find(rendered["torch"], "Deployment", "gateway"))
    container(gateway, "gateway")["readinessProbe"]["httpGet"]["port"] = {"not": "a port"}
    with pytest.raises(Exception, match="port"):
        validate(gateway)
    typo = copy.deepcopy(find(rendered["torch"], "Deployment", "triton"))
    typo["spec"]["replica"] = 2  # strict mode: unknown fields are errors
    with pytest.raises(Exception, match="replica"):
        validate(typo)


@pytest.mark.parametrize("overlay", list(OVERLAYS))
def test_triton_serves_what_the_build_renders_on_its_gpus(rendered, overlay, monkeypatch):
    from cosyvoice_build.cli import build_parser, settings_from_args

    backend, layout, gpus = OVERLAYS[overlay]
    docs = rendered[overlay]
    values = find(docs, "ConfigMap", "cosyvoice-build")["data"]
    assert (values["COSYVOICE_LLM_BACKEND"], values["COSYVOICE_TRITON_LAYOUT"]) == (backend, layout)
    # every COSYVOICE_* value is an option the build reads; the paths Triton's shell derives are the build's
    for key, value in values.items():
        monkeypatch.setenv(key, value)
    options = {a.dest for a in build_parser()._actions}
    assert {k.removeprefix("COSYVOICE_").lower() for k in values if k.startswith("COSYVOICE_")} <= options
    settings = settings_from_args(build_parser().parse_args(["--to", "render"]))
    assert settings.triton_repo_dir == Path(values["COSYVOICE_WORK_DIR"]) / "triton_repo" / f"{backend}_{layout}"
    triton = find(docs, "Deployment", "triton")
    server = container(triton, "triton")
    assert "${COSYVOICE_LLM_BACKEND}_${COSYVOICE_TRITON_LAYOUT}" in server["command"][-1]
    wait = triton["spec"]["template"]["spec"]["initContainers"][0]["command"][-1]
    marker = settings.state_dir / "render.done.json"
    assert str(marker).replace(values["COSYVOICE_WORK_DIR"], "$COSYVOICE_WORK_DIR") in wait
    assert server["resources"]["limits"]["nvidia.com/gpu"] == gpus
    assert server["readinessProbe"]["httpGet"]["path"] == "/v2/health/ready"
    assert triton["spec"]["template"]["metadata"]["annotations"]["prometheus.io/port"] == "8002"
    ports = {p["name"]: p["containerPort"] for p in server["ports"]}
    assert ports == {"http": 8000, "grpc": 8001, "metrics": 8002}
    service = find(docs, "Service", "triton")
    assert service["spec"]["clusterIP"] == "None"  # headless: the gateway sees every Triton pod
    job = find(docs, "Job", "cosyvoice-build")["spec"]["template"]["spec"]
    assert job["containers"][0]["envFrom"][0]["configMapRef"]["name"] == find(docs, "ConfigMap", "cosyvoice-build")[
        "metadata"]["name"]


def test_the_gateway_is_stateless_probed_and_scaled_on_in_flight_requests(rendered):
    docs = rendered["torch"]
    settings_env = find(docs, "ConfigMap", "cosyvoice-gateway")["data"]
    known = {f"TTS_{name.upper()}" for name in Settings.model_fields}
    gateway = find(docs, "Deployment", "gateway")
    server = container(gateway, "gateway")
    assert set(settings_env) | {e["name"] for e in server["env"]} <= known  # no misspelled setting
    assert settings_env["TTS_TRITON_URL"] == "dns:///triton:8001"
    assert server["livenessProbe"]["httpGet"]["path"] == "/health"
    assert server["readinessProbe"]["httpGet"]["path"] == "/ready"
    # uploaded voices go to the shared volume, mounted where the setting points
    [mount] = server["volumeMounts"]
    assert mount["mountPath"] == settings_env["TTS_UPLOADED_VOICES_DIR"]
    [volume] = gateway["spec"]["template"]["spec"]["volumes"]
    claim = find(docs, "PersistentVolumeClaim", volume["persistentVolumeClaim"]["claimName"])
    assert claim["spec"]["accessModes"] == ["ReadWriteMany"]
    # the autoscaler's metric is one the gateway really exports, and it scales before the 429 limit
    hpa = find(docs, "HorizontalPodAutoscaler", "gateway")
    [metric] = hpa["spec"]["metrics"]
    exported = {m.name for m in GatewayMetrics().registry.collect()}
    assert metric["pods"]["metric"]["name"] in exported
    assert float(metric["pods"]["target"]["averageValue"]) < int(settings_env["TTS_MAX_IN_FLIGHT"])
    assert hpa["spec"]["scaleTargetRef"]["name"] == gateway["metadata"]["name"]
    assert hpa["spec"]["minReplicas"] >= 2


def test_gpu_resources_only_where_gpus_are_used(rendered):
    for overlay in OVERLAYS:
        gateway = find(rendered[overlay], "Deployment", "gateway")
        assert "nvidia.com/gpu" not in str(gateway)
