"""The Dockerfile and Kubernetes manifests, checked statically (no container engine here)."""

from __future__ import annotations

import os
import pathlib
import re
import subprocess
import sys
import tomllib

import pytest

from aclnn_server import ServerOptions

ROOT = pathlib.Path(__file__).resolve().parent.parent
BIN = pathlib.Path(sys.executable).parent
MANIFESTS = sorted((ROOT / "deploy").glob("*.yaml"))


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


def test_yamllint():
    result = run(str(BIN / "yamllint"), "-c", ".yamllint.yaml", "--strict", "deploy")
    assert result.returncode == 0, result.stdout + result.stderr


def test_every_aclnn_variable_is_a_real_option():
    options = {"ACLNN_" + name.upper() for name in ServerOptions.model_fields}
    for path in [ROOT / "Dockerfile", *MANIFESTS]:
        for variable in re.findall(r"\bACLNN_[A-Z_]*[A-Z]\b", path.read_text()):
            assert variable in options, f"{path.name}: {variable} is not an aclnn-serve option"


def test_image_pins_the_project_version():
    version = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    assert f'"aclnn-serve[server]=={version}"' in (ROOT / "Dockerfile").read_text()
    assert f"image: aclnn-serve:{version}" in (ROOT / "deploy" / "deployment.yaml").read_text()


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
