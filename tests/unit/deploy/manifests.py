"""What the deploy tests share: the rendered overlays, the tools that check them, and each
Sluice container's command line as the service's own parser reads it.

No cluster runs here, so the checks are offline: `kubectl kustomize` renders each overlay, the
Kubernetes schemas shipped in `kubernetes-validate` (plus the vendored KubeRay RayCluster schema)
validate every object, and the parsers of the services themselves (built from their config
dataclasses) read each container's flags and environment. scripts/setup.sh installs the tools
(kubectl, hadolint, kubernetes-validate) into the virtual environment; a missing one fails.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import importlib
import json
import re
import shlex
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from unittest import mock

import jsonschema
import yaml
from referencing import Registry, Resource

ROOT = Path(__file__).resolve().parents[3]
DEPLOY = ROOT / "deploy"
K8S = DEPLOY / "k8s"
OVERLAYS = ("local", "gpu")
# The oldest Kubernetes the manifests are written for (native gRPC probes, the preStop sleep
# action and HPA autoscaling/v2 are all GA or on by default there).
KUBERNETES_VERSION = "1.32"
RAYCLUSTER_SCHEMA = K8S / "schemas" / "raycluster-ray-v1.json"
SLUICE_IMAGES = {"sluice-cpu": "Dockerfile.cpu", "sluice-cuda": "Dockerfile.cuda"}
SERVE_MODULES = {  # `sluice serve <role>` (the images' entrypoint) runs these modules' main()
    "router": "services.router.server",
    "tokenizer": "services.tokenizer.server",
    "engine": "services.engine.server",
}


def tool(name: str) -> str:
    """Path of a CLI tool: the virtual environment's first (setup.sh installs it there)."""
    beside = Path(sys.executable).parent / name
    found = str(beside) if beside.exists() else shutil.which(name)
    if found is None:
        raise AssertionError(f"{name} is not installed: run scripts/setup.sh")
    return found


@functools.cache
def render(overlay: str) -> tuple[dict[str, Any], ...]:
    """The objects `kubectl kustomize deploy/k8s/overlays/<overlay>` renders."""
    result = subprocess.run(
        [tool("kubectl"), "kustomize", str(K8S / "overlays" / overlay)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, f"kustomize {overlay} failed: {result.stderr}"
    return tuple(doc for doc in yaml.safe_load_all(result.stdout) if doc)


def objects(overlay: str, kind: str) -> list[dict[str, Any]]:
    return [doc for doc in render(overlay) if doc["kind"] == kind]


def one(overlay: str, kind: str, name: str) -> dict[str, Any]:
    found = [doc for doc in objects(overlay, kind) if doc["metadata"]["name"] == name]
    assert len(found) == 1, f"{overlay}: expected one {kind}/{name}, found {len(found)}"
    return found[0]


# ---- pods and containers ------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Pod:
    """One pod template of a rendered object (a RayCluster has one per group)."""

    owner: str  # Kind/name[/group]
    labels: dict[str, str]
    spec: dict[str, Any]


def pods(overlay: str) -> list[Pod]:
    found = []
    for doc in render(overlay):
        name = f"{doc['kind']}/{doc['metadata']['name']}"
        if doc["kind"] in ("Deployment", "StatefulSet"):
            template = doc["spec"]["template"]
            found.append(Pod(name, template["metadata"].get("labels", {}), template["spec"]))
        elif doc["kind"] == "RayCluster":
            head = doc["spec"]["headGroupSpec"]["template"]
            found.append(Pod(f"{name}/head", head["metadata"].get("labels", {}), head["spec"]))
            for group in doc["spec"].get("workerGroupSpecs", []):
                template = group["template"]
                labels = template["metadata"].get("labels", {})
                found.append(Pod(f"{name}/{group['groupName']}", labels, template["spec"]))
    return found


def sluice_containers(overlay: str) -> Iterator[tuple[Pod, dict[str, Any]]]:
    for pod in pods(overlay):
        for container in pod.spec["containers"]:
            if container["image"].split(":")[0] in SLUICE_IMAGES:
                yield pod, container


def selects(selector: dict[str, Any], labels: dict[str, str]) -> bool:
    """A LabelSelector (matchLabels, matchExpressions) against a pod's labels."""
    for key, value in selector.get("matchLabels", {}).items():
        if labels.get(key) != value:
            return False
    for expression in selector.get("matchExpressions", []):
        key, operator, values = expression["key"], expression["operator"], expression.get("values")
        if operator == "In" and labels.get(key) not in values:
            return False
        if operator == "NotIn" and labels.get(key) in values:
            return False
        if operator == "Exists" and key not in labels:
            return False
        if operator == "DoesNotExist" and key in labels:
            return False
    return True


def service_pods(overlay: str, service: dict[str, Any]) -> list[Pod]:
    """The pod templates a Service's selector (a plain label map) picks."""
    selector = service["spec"].get("selector", {})
    return [pod for pod in pods(overlay) if selects({"matchLabels": selector}, pod.labels)]


# ---- what a container runs --------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Process:
    """The Sluice module a container runs and the flags it passes."""

    module: str
    argv: tuple[str, ...]


def process(container: dict[str, Any]) -> Process | None:
    """The Sluice process of a container (None when it runs none itself, like a Ray worker,
    whose engine actors get their settings from the head's driver)."""
    command = container.get("command") or []
    args = list(container.get("args") or [])
    if not command:  # the image's entrypoint: `sluice serve <role> ...`
        assert args[:1] == ["serve"] and args[1] in SERVE_MODULES, args
        return Process(SERVE_MODULES[args[1]], tuple(args[2:]))
    if command[:2] == ["python", "-m"]:
        return Process(command[2], tuple(command[3:] + args))
    if command[:2] == ["/bin/bash", "-c"]:
        script = " ".join(args)
        found = re.search(r"\bpython -m ([\w.]+)(.*)", script, re.S)
        if found is None:
            return None
        return Process(found.group(1), tuple(shlex.split(found.group(2))))
    raise AssertionError(f"unexpected command {command}")


class _Parsed(Exception):
    def __init__(self, parser: argparse.ArgumentParser) -> None:
        self.parser = parser


def service_parser(module: str) -> argparse.ArgumentParser:
    """The argparse parser the module's main() builds (stopped at its first parse_args)."""

    def capture(self: argparse.ArgumentParser, *args: Any, **kwargs: Any) -> None:
        raise _Parsed(self)

    entry = importlib.import_module(module).main
    with mock.patch.object(argparse.ArgumentParser, "parse_args", capture):
        try:
            entry([])
        except _Parsed as parsed:
            return parsed.parser
    raise AssertionError(f"{module}.main() parsed no arguments")


def flags(parser: argparse.ArgumentParser) -> set[str]:
    return {option for action in parser._actions for option in action.option_strings}


def env_names(parser: argparse.ArgumentParser) -> set[str]:
    """SLUICE_* variables the parser's dataclass fields read (services/common/config.py)."""
    texts = " ".join(action.help or "" for action in parser._actions)
    return set(re.findall(r"\(env (SLUICE_[A-Z0-9_]+);", texts))


@functools.cache
def env_only_settings() -> frozenset[str]:
    """SLUICE_* variables read straight through services/common/env.py, not through a flag."""
    names = set()
    for path in (ROOT / "services").rglob("*.py"):
        names.update(re.findall(r"\bsetting\(\"([a-z0-9_]+)\"\)", path.read_text()))
    return frozenset("SLUICE_" + name.upper() for name in names)


def parse(module: str, argv: tuple[str, ...]) -> argparse.Namespace:
    """argv as the module's parser reads it; an unknown flag fails with the parser's message."""
    parser = service_parser(module)
    parser.exit_on_error = False
    try:
        namespace, unknown = parser.parse_known_args(list(argv))
    except argparse.ArgumentError as error:
        raise AssertionError(f"{module}: {error}") from error
    assert not unknown, f"{module} does not accept {unknown}"
    return namespace


# ---- schema validation ------------------------------------------------------------------
@functools.cache
def _kubernetes_definitions() -> dict[str, Any]:
    from importlib import resources

    path = f"kubernetes-json-schema/v{KUBERNETES_VERSION}.0-local-strict/_definitions.json"
    return json.loads((resources.files("kubernetes_validate") / path).read_text())


def validate(doc: dict[str, Any]) -> None:
    """Raise jsonschema.ValidationError (or SchemaNotFoundError) when `doc` is not valid."""
    if doc.get("apiVersion", "").startswith("ray.io/"):
        schema = json.loads(RAYCLUSTER_SCHEMA.read_text())
        definitions = _kubernetes_definitions()
        registry = Registry().with_resources(
            [
                (definitions["$id"], Resource.from_contents(definitions)),
                (schema["$id"], Resource.from_contents(schema)),
            ]
        )
        jsonschema.Draft202012Validator(schema, registry=registry).validate(doc)
        return
    from kubernetes_validate import utils

    utils.validate(doc, KUBERNETES_VERSION, strict=True)
