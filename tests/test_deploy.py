"""The Dockerfile and Kubernetes manifests, checked statically (no container engine here).

The base (deploy/base: the secure default) and each overlay are rendered with `kubectl kustomize`
and validated as a cluster would receive them; their security-relevant settings are then read back.
"""

from __future__ import annotations

import functools
import os
import pathlib
import re
import shutil
import subprocess
import sys
import tomllib

import pytest
import yaml
from certs import make_certificates

from aclnn_server import ServerOptions
from aclnn_server.healthcheck import VARIABLES as HEALTHCHECK_VARIABLES

ROOT = pathlib.Path(__file__).resolve().parent.parent
BIN = pathlib.Path(sys.executable).parent
DEPLOY = ROOT / "deploy"
MANIFESTS = sorted(p for p in (DEPLOY / "base").glob("*.yaml") if p.name != "kustomization.yaml")
VARIANTS = ("base", "overlays/insecure", "overlays/npu")
HEALTHCHECK = ["python", "-m", "aclnn_server.healthcheck"]


def run(*command: str) -> subprocess.CompletedProcess:
    return subprocess.run(command, capture_output=True, text=True, cwd=ROOT, timeout=120)


def test_hadolint():
    result = run(str(BIN / "hadolint"), "Dockerfile")
    assert result.returncode == 0, result.stdout + result.stderr


def test_kubernetes_validate_strict():
    result = run(str(BIN / "kubernetes-validate"), "--strict", *map(str, MANIFESTS))
    assert result.returncode == 0, result.stdout + result.stderr
    assert {"Deployment", "Service", "PodDisruptionBudget", "HorizontalPodAutoscaler"} <= {
        re.search(r"^kind: (\w+)", m.read_text(), re.M)[1] for m in MANIFESTS
    }


@functools.cache
def rendered(variant: str) -> str:
    """The manifests of a kustomization as `kubectl apply -k` sends them."""
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("kubectl (with its built-in kustomize) is not installed")
    result = run(kubectl, "kustomize", str(DEPLOY / variant))
    assert result.returncode == 0, result.stderr
    return result.stdout


def objects(variant: str) -> dict[str, dict]:
    return {doc["kind"]: doc for doc in yaml.safe_load_all(rendered(variant))}


def container(variant: str) -> dict:
    (only,) = objects(variant)["Deployment"]["spec"]["template"]["spec"]["containers"]
    return only


def env(variant: str) -> dict[str, str]:
    return {e["name"]: e["value"] for e in container(variant)["env"]}


@pytest.mark.parametrize("variant", VARIANTS)
def test_rendered_variant_validates_strictly(variant, tmp_path):
    path = tmp_path / "rendered.yaml"
    path.write_text(rendered(variant))
    result = run(str(BIN / "kubernetes-validate"), "--strict", str(path))
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.parametrize("variant", VARIANTS)
def test_rendered_options_load(variant, tmp_path, monkeypatch):
    """The server would start on the rendered environment (its Secrets' files stood in for by real ones)."""
    certs = make_certificates(tmp_path)
    stand_ins = {"tls.crt": "server-dns.pem", "tls.key": "server-dns.key", "ca.crt": "ca.pem"}
    for name, value in env(variant).items():
        if name.startswith("ACLNN_"):
            if value.startswith("/etc/aclnn/"):
                file = pathlib.Path(value).name
                value = certs.path(stand_ins[file]) if file in stand_ins else tmp_path / file
                if file not in stand_ins:
                    value.write_text("a-token\n")
            monkeypatch.setenv(name, str(value))
    ServerOptions()


@pytest.mark.parametrize("variant", ["base", "overlays/npu"])
def test_secure_variants_use_tls_and_tokens_from_secrets_and_tls_probes(variant):
    variables = env(variant)
    assert "ACLNN_INSECURE" not in variables
    assert variables["ACLNN_HOST"] == "0.0.0.0"
    pod = objects(variant)["Deployment"]["spec"]["template"]["spec"]
    secrets = {v["name"]: v["secret"]["secretName"] for v in pod["volumes"] if "secret" in v}
    mounts = {m["mountPath"]: m["name"] for m in container(variant)["volumeMounts"]}
    for name in ("ACLNN_TLS_CERT", "ACLNN_TLS_KEY", "ACLNN_AUTH_TOKEN_FILE", "ACLNN_HEALTHCHECK_CA"):
        directory = str(pathlib.PurePosixPath(variables[name]).parent)
        assert mounts.get(directory) in secrets, f"{name} is not read from a Secret"
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert container(variant)[probe]["exec"]["command"] == HEALTHCHECK, probe


def test_insecure_overlay_is_plaintext_with_tokens_and_grpc_probes():
    variables = env("overlays/insecure")
    assert variables["ACLNN_INSECURE"] == "true"
    assert "ACLNN_AUTH_TOKEN_FILE" in variables
    assert not {"ACLNN_TLS_CERT", "ACLNN_TLS_KEY", "ACLNN_HEALTHCHECK_CA"} & set(variables)
    pod = objects("overlays/insecure")["Deployment"]["spec"]["template"]["spec"]
    assert "aclnn-serve-tls" not in str(pod)
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert set(container("overlays/insecure")[probe]) & {"exec", "grpc"} == {"grpc"}, probe


def test_npu_overlay_takes_one_ascend_device():
    version = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    npu = container("overlays/npu")
    assert npu["resources"]["limits"]["huawei.com/Ascend910"] == "1"
    assert env("overlays/npu")["ACLNN_BACKEND"] == "npu"
    assert env("overlays/npu")["ACLNN_DEVICE"] == "0"
    assert npu["image"] == f"aclnn-serve:{version}-npu"
    assert "HorizontalPodAutoscaler" not in objects("overlays/npu")


def test_image_ships_warm_kernels_and_pods_keep_them():
    """The image compiles the cpu kernels at build; the pod copies them into its cache volume first."""
    dockerfile = (ROOT / "Dockerfile").read_text()
    assert re.search(r'^RUN python -c "from aclnn_server.backends.cpu import warm_up; warm_up\(\)"$', dockerfile, re.M)
    assert dockerfile.index("NUMBA_CACHE_DIR=/home/aclnn/.cache/numba") < dockerfile.index("warm_up()")
    (deployment,) = [d for d in yaml.safe_load_all((ROOT / "deploy/base/deployment.yaml").read_text())]
    pod = deployment["spec"]["template"]["spec"]
    (init,) = pod["initContainers"]
    mounts = {m["name"]: m["mountPath"] for m in init["volumeMounts"]}
    main = {m["name"]: m["mountPath"] for m in pod["containers"][0]["volumeMounts"]}
    assert init["command"] == ["cp", "-a", "/home/aclnn/.cache/numba", mounts["cache"] + "/"]
    assert main["cache"] == "/home/aclnn/.cache"


def test_image_base_is_a_build_argument():
    dockerfile = (ROOT / "Dockerfile").read_text()
    assert re.search(r"^ARG BASE_IMAGE=python:3\.11-slim$", dockerfile, re.M)
    assert re.findall(r"^FROM (\S+)", dockerfile, re.M) == ["${BASE_IMAGE}", "${BASE_IMAGE}"]


def test_yamllint():
    result = run(str(BIN / "yamllint"), "-c", ".yamllint.yaml", "--strict", "deploy")
    assert result.returncode == 0, result.stdout + result.stderr


def test_every_aclnn_variable_is_a_real_option():
    options = {"ACLNN_" + name.upper() for name in ServerOptions.model_fields} | set(HEALTHCHECK_VARIABLES)
    for path in [ROOT / "Dockerfile", *sorted(DEPLOY.rglob("*.yaml"))]:
        for variable in re.findall(r"\bACLNN_[A-Z_]*[A-Z]\b", path.read_text()):
            assert variable in options, f"{path.name}: {variable} is not an aclnn-serve option"


def test_image_pins_the_project_version():
    version = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    assert f'"aclnn-serve[server]=={version}"' in (ROOT / "Dockerfile").read_text()
    assert f"image: aclnn-serve:{version}" in (DEPLOY / "base" / "deployment.yaml").read_text()


@pytest.mark.parametrize("alive", [True, False])
def test_healthcheck_command(server_address, alive):
    port = server_address.rsplit(":", 1)[1] if alive else "1"
    result = subprocess.run(
        [sys.executable, "-m", "aclnn_server.healthcheck"],
        capture_output=True,
        text=True,
        timeout=30,
        env={**os.environ, "ACLNN_PORT": port},
    )
    assert result.returncode == (0 if alive else 1), result.stdout + result.stderr
    if alive:
        assert "SERVING" in result.stdout
