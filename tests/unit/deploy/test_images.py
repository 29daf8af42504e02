"""The container images: hadolint passes, each Dockerfile is multi-stage from a pinned base, the
final stage runs as a non-root user with a HEALTHCHECK and no build tools, it carries every
package pyproject.toml installs, and it exposes the ports the manifests use. The HEALTHCHECK
script itself is run against a real gRPC health server. No image is built here (no Docker)."""

from __future__ import annotations

import importlib.util
import re
import subprocess
from concurrent import futures
from pathlib import Path

import grpc
import pytest
import tomllib
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from services.common.ports import free_port
from tests.unit.deploy.manifests import DEPLOY, OVERLAYS, ROOT, SLUICE_IMAGES, pods, tool

DOCKERFILES = sorted((DEPLOY / "docker").glob("Dockerfile.*"))
BUILD_TOOLS = re.compile(r"\b(g\+\+|gcc|clang|make|cmake|build-essential|pip install)\b")


def _stages(path: Path) -> list[list[str]]:
    """Instructions per stage, continuation lines joined, comments dropped, ARGs resolved."""
    text = re.sub(r"\\\n\s*", " ", path.read_text())
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    lines = [line for line in lines if not line.startswith("#")]
    defaults = dict(re.findall(r"^ARG (\w+)=(\S+)$", "\n".join(lines), re.M))
    stages: list[list[str]] = []
    for line in lines:
        line = re.sub(r"\$\{(\w+)\}", lambda m: defaults.get(m.group(1), m.group(0)), line)
        if line.startswith("FROM "):
            stages.append([])
        if stages:
            stages[-1].append(line)
    return stages


@pytest.mark.parametrize("path", DOCKERFILES, ids=lambda p: p.name)
def test_hadolint_passes(path: Path) -> None:
    result = subprocess.run(
        [tool("hadolint"), "--failure-threshold", "style", "--no-color", str(path)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.parametrize("path", DOCKERFILES, ids=lambda p: p.name)
def test_multi_stage_pinned_non_root_with_healthcheck(path: Path) -> None:
    stages = _stages(path)
    assert len(stages) >= 2, "build and final stages"
    for stage in stages:
        image = stage[0].split()[1]
        assert re.fullmatch(r"[\w./-]+:\d+\.\d+\.\d+[\w.-]*|[\w./-]+@sha256:[0-9a-f]{64}", image), (
            f"{path.name}: base {image} is not pinned to an exact version or digest"
        )
    final = stages[-1]
    users = [line.split()[1] for line in final if line.startswith("USER ")]
    assert users and users[-1].split(":")[0].isdigit() and users[-1].split(":")[0] != "0"
    assert any(line.startswith("HEALTHCHECK ") and "healthcheck.py" in line for line in final)
    assert any(line.startswith("COPY --from=") for line in final), "final stage copies the build"
    tools = {m for line in final if line.startswith("RUN ") for m in BUILD_TOOLS.findall(line)}
    if path.name == "Dockerfile.cuda":
        # Triton compiles its kernel launchers at run time with the C compiler; nothing else.
        assert tools <= {"gcc"} and "Triton" in path.read_text()
    else:
        assert not tools, f"{path.name}: build tools in the final stage: {tools}"


@pytest.mark.parametrize("path", DOCKERFILES, ids=lambda p: p.name)
def test_image_carries_every_installed_package(path: Path) -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    packages = {p.rstrip("*") for p in project["tool"]["setuptools"]["packages"]["find"]["include"]}
    copied = set(re.findall(r"^COPY (\w+) \./\1$", path.read_text(), re.M))
    assert packages <= copied, f"{path.name} does not copy {packages - copied}"


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_images_expose_the_ports_the_manifests_use(overlay: str) -> None:
    for pod in pods(overlay):
        for container in pod.spec["containers"]:
            name = container["image"].split(":")[0]
            if name not in SLUICE_IMAGES:
                continue
            text = (DEPLOY / "docker" / SLUICE_IMAGES[name]).read_text()
            exposed = {
                int(p) for line in re.findall(r"^EXPOSE (.+)$", text, re.M) for p in line.split()
            }
            for port in container.get("ports", []):
                assert port["containerPort"] in exposed, (pod.owner, port, SLUICE_IMAGES[name])


def _healthcheck_module():  # noqa: ANN202 - a module loaded from a file
    spec = importlib.util.spec_from_file_location(
        "healthcheck", DEPLOY / "docker" / "healthcheck.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_healthcheck_script_follows_the_health_service(monkeypatch: pytest.MonkeyPatch) -> None:
    healthcheck = _healthcheck_module()
    port = free_port("127.0.0.1")
    monkeypatch.setenv("SLUICE_PORT", str(port))
    assert healthcheck.main(["--timeout-s", "0.5"]) == 1, "nothing listens yet"
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    server.add_insecure_port(f"127.0.0.1:{port}")
    server.start()
    try:
        servicer.set("", health_pb2.HealthCheckResponse.NOT_SERVING)
        assert healthcheck.main([]) == 1
        servicer.set("", health_pb2.HealthCheckResponse.SERVING)
        assert healthcheck.main([]) == 0
        assert healthcheck.main(["--service", "sluice.v1.Unknown"]) == 1
        monkeypatch.delenv("SLUICE_PORT")
        assert healthcheck.main(["--default-port", str(port)]) == 0
    finally:
        server.stop(None)
