"""The Kubernetes manifests stay in step with the code: files exist, flags and env names parse.

No cluster runs here, so this checks what can be checked offline: every Kustomize resource and
patch exists and is valid YAML, and every `--flag` and `SLUICE_*` variable a container passes
to a Sluice service is one that service's own parser accepts.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "deploy" / "k8s"


def _kustomizations() -> list[Path]:
    return sorted(K8S.rglob("kustomization.yaml"))


def _documents(path: Path) -> list[dict]:
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc]


def _help_text(command: list[str]) -> str:
    result = subprocess.run(
        [sys.executable, *command, "--help"], capture_output=True, text=True, timeout=60, cwd=ROOT
    )
    assert result.returncode == 0, result.stderr
    return result.stdout


def _service_command(container: dict) -> list[str]:
    """The Python command line a container runs (the image's entrypoint is `sluice`)."""
    command = container.get("command")
    args = container.get("args", [])
    if command:
        assert command[:2] == ["python", "-m"], command
        return ["-m", command[2]]
    assert args[:1] == ["serve"], args
    return ["-m", "services.cli", "serve", args[1]]


def test_every_kustomize_reference_exists_and_parses() -> None:
    assert _kustomizations(), "no kustomization.yaml under deploy/k8s"
    for kustomization in _kustomizations():
        spec = _documents(kustomization)[0]
        for entry in spec.get("resources", []):
            target = kustomization.parent / entry
            assert target.exists(), f"{kustomization}: missing resource {entry}"
            if target.is_file():
                assert _documents(target), f"{target} is empty"
        for patch in spec.get("patches", []):
            assert (kustomization.parent / patch["path"]).exists()


def _sluice_containers() -> list[tuple[Path, dict]]:
    found = []
    for path in sorted((K8S / "base").glob("*.yaml")):
        for doc in _documents(path):
            pod = doc.get("spec", {}).get("template", {}).get("spec", {})
            for container in pod.get("containers", []):
                if container.get("image") == "sluice":
                    found.append((path, container))
    return found


@pytest.mark.parametrize(
    ("path", "container"), _sluice_containers(), ids=lambda v: getattr(v, "name", None)
)
def test_container_flags_and_env_are_accepted(path: Path, container: dict) -> None:
    command = _service_command(container)
    help_text = _help_text(command)
    args = container.get("args", [])
    flags = [a.split("=", 1)[0] for a in args if a.startswith("--")]
    assert flags, f"{path.name}: {container['name']} passes no flags"
    for flag in flags:
        assert re.search(rf"{re.escape(flag)}\b", help_text), f"{path.name}: unknown {flag}"
    for variable in container.get("env", []):
        name = variable["name"]
        if name.startswith("SLUICE_"):
            assert name in help_text.replace("\n", " ").replace(" ", ""), (
                f"{path.name}: {container['name']} sets {name}, which no flag reads"
            )
