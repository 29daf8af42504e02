"""The manifests agree with the services' own configuration classes.

Each Sluice container's flags are read by the parser its service builds from its config
dataclasses (not a list kept here), and its environment is checked against the SLUICE_*
variables those dataclasses read; the resulting configs are built and validated as at start-up.
Ports, probe ports, drain grace periods, service names and network policies are then compared
with what the configs say, so renaming a flag or moving a port fails here, not in a cluster.
"""

from __future__ import annotations

import argparse
import re
from typing import Any

import pytest

from services.common.config import from_layers
from services.common.redis_store import StoreConfig
from tests.unit.deploy.manifests import (
    K8S,
    OVERLAYS,
    Pod,
    env_names,
    env_only_settings,
    objects,
    one,
    parse,
    pods,
    process,
    selects,
    service_parser,
    sluice_containers,
)

FAKE_FIELD_VALUES = {"status.podIP": "10.1.2.3", "metadata.name": "sluice-engine-0"}


def _containers(overlay: str) -> list[tuple[Pod, dict[str, Any]]]:
    return list(sluice_containers(overlay))


CASES = [(o, pod, c) for o in OVERLAYS for pod, c in _containers(o)]
CASE_IDS = [f"{o}:{pod.owner}/{c['name']}" for o, pod, c in CASES]


def _config_map(overlay: str) -> dict[str, str]:
    (config,) = objects(overlay, "ConfigMap")
    return config["data"]


def _environment(overlay: str, container: dict[str, Any]) -> dict[str, str]:
    """The variables the container starts with (secrets and field refs as stand-ins)."""
    values: dict[str, str] = {}
    for source in container.get("envFrom", []):
        assert source["configMapRef"]["name"].startswith("sluice-config")
        values.update(_config_map(overlay))
    for variable in container.get("env", []):
        if "value" in variable:
            values[variable["name"]] = variable["value"]
        elif "secretKeyRef" in variable["valueFrom"]:
            values[variable["name"]] = "stand-in-secret"
        else:
            values[variable["name"]] = FAKE_FIELD_VALUES[
                variable["valueFrom"]["fieldRef"]["fieldPath"]
            ]
    return values


def _expand(argv: tuple[str, ...], environment: dict[str, str]) -> tuple[str, ...]:
    """Kubernetes' $(VAR) expansion in args."""
    return tuple(
        re.sub(r"\$\(([A-Z0-9_]+)\)", lambda m: environment.get(m.group(1), m.group(0)), arg)
        for arg in argv
    )


def _build(module: str, argv: tuple[str, ...]) -> argparse.Namespace:
    """Parse and build the module's configs as its main() would (validation included)."""
    namespace = parse(module, argv)
    if module == "services.router.server":
        from services.router.config import RouterSettings

        RouterSettings.from_argv(list(argv))
    elif module == "services.tokenizer.server":
        from services.tokenizer.config import TokenizerConfig

        TokenizerConfig.from_argv(list(argv))
    else:
        from services.engine.worker_config import WorkerConfig

        WorkerConfig.from_namespace(namespace)
        if module in ("services.engine.worker", "services.ray_engines"):
            from_layers(StoreConfig, namespace)
        if module == "services.ray_engines":
            from services.ray_cluster import RayClusterConfig

            from_layers(RayClusterConfig, namespace)
    return namespace


def _grace_s(namespace: argparse.Namespace, parser: argparse.ArgumentParser) -> float:
    """The drain grace the service will use: its one `*grace*` setting, given or default."""
    dests = [a.dest for a in parser._actions if re.search(r"(^|_)grace(_|$)", a.dest)]
    assert len(dests) == 1, f"expected one grace setting, found {dests}"
    value = getattr(namespace, dests[0])
    if value is None:
        action = next(a for a in parser._actions if a.dest == dests[0])
        value = re.search(r"default: ([0-9.]+)\)", action.help).group(1)
    return float(value)


def _port(container: dict[str, Any], name: str) -> int | None:
    for port in container.get("ports", []):
        if port.get("name") == name:
            return int(port["containerPort"])
    return None


@pytest.mark.parametrize(("overlay", "pod", "container"), CASES, ids=CASE_IDS)
def test_flags_env_ports_and_grace_match_the_service_config(
    overlay: str, pod: Pod, container: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    _check_container(overlay, pod, container, monkeypatch)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda c: c["args"].append("--grace=30"), "does not accept"),
        (
            lambda c: c["env"].append({"name": "SLUICE_GRACE", "value": "30"}),
            "reads no SLUICE_GRACE",
        ),
        (lambda c: c["ports"][0].update(containerPort=50052), "assert 50052 == 50051"),
        (lambda c: c["args"].append("--shutdown-grace-s=44"), "killed before its 44.0 s drain"),
        (lambda c: c["args"].append("--max-queued-requests=lots"), "cannot read 'lots'"),
    ],
)
def test_a_drifted_router_container_fails(
    change: Any, message: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    import copy

    (pod,) = [p for p in pods("local") if p.owner == "Deployment/sluice-router"]
    container = copy.deepcopy(pod.spec["containers"][0])
    change(container)
    with pytest.raises(Exception, match=re.escape(message)):
        _check_container("local", pod, container, monkeypatch)


def _check_container(
    overlay: str, pod: Pod, container: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    found = process(container)
    if found is None:  # a Ray worker: its engine actors are configured by the head's driver
        assert "KUBERAY_GEN_RAY_START_CMD" in " ".join(container["args"])
        for name in _environment(overlay, container):
            if name.startswith("SLUICE_") and name not in _config_map(overlay):
                assert name in env_only_settings(), f"{name}: read by no actor"
        _check_drain_hook(overlay, pod, container)
        return
    environment = _environment(overlay, container)
    for name in list(os_environ_sluice()):
        monkeypatch.delenv(name)
    for name, value in environment.items():
        monkeypatch.setenv(name, value)
    argv = _expand(found.argv, environment)
    parser = service_parser(found.module)
    namespace = _build(found.module, argv)

    readable = env_names(parser) | env_only_settings()
    for variable in container.get("env", []):
        name = variable["name"]
        if name.startswith("SLUICE_"):
            assert name in readable, f"{found.module} reads no {name}"

    listen = namespace.engine_port if found.module == "services.ray_engines" else namespace.port
    assert listen is not None, f"{found.module}: no port given"
    if found.module == "services.ray_engines":
        _check_engine_workers(overlay, int(listen))
    else:
        assert _port(container, "grpc") == int(listen)
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            assert container[probe]["grpc"]["port"] == int(listen), probe
    if getattr(namespace, "http_port", None) is not None:  # the OpenAI-compatible front
        assert _port(container, "http") == int(namespace.http_port)
    if getattr(namespace, "metrics_port", None) is not None:
        metrics = _port(container, "metrics")
        if found.module == "services.ray_engines":
            metrics = _port(_ray_worker_container(overlay), "metrics")
        assert metrics == int(namespace.metrics_port)

    grace = _grace_s(namespace, parser)
    pre_stop = container.get("lifecycle", {}).get("preStop", {}).get("sleep", {}).get("seconds", 0)
    assert pod.spec["terminationGracePeriodSeconds"] > pre_stop + grace, (
        f"{pod.owner}: the pod is killed before its {grace} s drain ends"
    )


def os_environ_sluice() -> list[str]:
    import os

    return [name for name in os.environ if name.startswith("SLUICE_")]


def _ray_worker_container(overlay: str) -> dict[str, Any]:
    ray = one(overlay, "RayCluster", "sluice-ray")
    return ray["spec"]["workerGroupSpecs"][0]["template"]["spec"]["containers"][0]


def _check_drain_hook(overlay: str, pod: Pod, container: dict[str, Any]) -> None:
    """A Ray worker's preStop drains its engine with the head's grace, within the pod's."""
    command = container["lifecycle"]["preStop"]["exec"]["command"]
    assert command[:3] == ["python", "-m", "services.ray_engines"], command
    namespace = parse(command[2], tuple(command[3:]))
    assert namespace.drain_this_node is True
    head = one(overlay, "RayCluster", "sluice-ray")["spec"]["headGroupSpec"]["template"]["spec"]
    driver = process(head["containers"][0])
    assert driver is not None
    head_grace = _grace_s(parse(driver.module, driver.argv), service_parser(driver.module))
    drain_grace = _grace_s(namespace, service_parser(command[2]))
    assert drain_grace >= head_grace, "the hook gives up before the engine's drain ends"
    assert pod.spec["terminationGracePeriodSeconds"] > drain_grace + 5.0


def _check_engine_workers(overlay: str, engine_port: int) -> None:
    worker = _ray_worker_container(overlay)
    assert _port(worker, "engine") == engine_port
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert worker[probe]["grpc"]["port"] == engine_port, probe
    startup = worker["startupProbe"]
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 600, "warm-up budget"


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_config_map_key_is_read_by_a_consumer(overlay: str) -> None:
    readers: set[str] = set(env_only_settings())
    for _, container in sluice_containers(overlay):
        found = process(container)
        if found is not None and container.get("envFrom"):
            readers |= env_names(service_parser(found.module))
    for key in _config_map(overlay):
        assert key in readers, f"{overlay}: ConfigMap key {key} is read by no service"


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_addresses_name_real_services(overlay: str) -> None:
    services = {
        (s["metadata"]["name"], p["port"])
        for s in objects(overlay, "Service")
        for p in s["spec"]["ports"]
    }
    router = one(overlay, "Deployment", "sluice-router")["spec"]["template"]["spec"]["containers"][
        0
    ]
    namespace = parse("services.router.server", tuple(router["args"][2:]))
    host, _, port = namespace.tokenizer.rpartition(":")
    assert (host, int(port)) in services
    redis = re.fullmatch(r"redis://([\w-]+):(\d+)/\d+", _config_map(overlay)["SLUICE_REDIS_URL"])
    assert redis is not None and (redis.group(1), int(redis.group(2))) in services


# ---- network policies ---------------------------------------------------------------------
PUBLIC_ROUTER_PORTS = (50051, 8000)  # gRPC and the OpenAI-compatible HTTP front


def _allowed(overlay: str, source: Pod | None, target: Pod, port: int) -> bool:
    """Whether the policies let `source` (None: a pod in another, unlabelled namespace) reach
    `target` on `port`. Kubernetes semantics: allowed if any policy selecting the target allows
    it; a target selected by none is open (the default-deny policy selects every pod)."""
    selecting = [
        p
        for p in objects(overlay, "NetworkPolicy")
        if "Ingress" in p["spec"].get("policyTypes", ["Ingress"])
        and selects(p["spec"]["podSelector"], target.labels)
    ]
    if not selecting:
        return True
    for policy in selecting:
        for rule in policy["spec"].get("ingress", []):
            ports = [p["port"] for p in rule.get("ports", [])]
            if ports and port not in ports:
                continue
            peers = rule.get("from")
            if not peers:
                return True
            for peer in peers:
                if "ipBlock" in peer or "namespaceSelector" in peer:
                    continue  # other namespaces: never the unlabelled one, never ours here
                if source is not None and selects(peer["podSelector"], source.labels):
                    return True
    return False


def _role(overlay: str, role: str) -> list[Pod]:
    return [pod for pod in pods(overlay) if pod.labels.get("sluice.dev/role") == role]


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_network_policies_isolate_everything_but_the_router(overlay: str) -> None:
    deny = one(overlay, "NetworkPolicy", "default-deny-ingress")["spec"]
    assert deny["podSelector"] == {} and not deny.get("ingress")
    router, tokenizer, redis = (
        _role(overlay, "router"),
        _role(overlay, "tokenizer"),
        _role(overlay, "redis"),
    )
    engines = [pod for pod in pods(overlay) if pod.labels.get("sluice.dev/engine") == "true"]
    ray = _role(overlay, "ray")
    assert router and tokenizer and redis and engines
    everyone = pods(overlay)
    for pod in everyone:
        for container in pod.spec["containers"]:
            for port in container.get("ports", []):
                number = port["containerPort"]
                outside = _allowed(overlay, None, pod, number)
                public = pod in router and number in PUBLIC_ROUTER_PORTS
                assert outside == public, (pod.owner, number)
    assert _allowed(overlay, router[0], tokenizer[0], 50052)
    for engine in engines:
        assert _allowed(overlay, router[0], engine, 50061)
        assert not _allowed(overlay, tokenizer[0], engine, 50061)
    for client in [*router, *engines, *ray]:
        assert _allowed(overlay, client, redis[0], 6379), client.owner
    assert not _allowed(overlay, tokenizer[0], redis[0], 6379)
    for a in ray:
        for b in ray:
            assert _allowed(overlay, a, b, 6379) and _allowed(overlay, a, b, 10002)
        assert not _allowed(overlay, router[0], a, 6379)
        assert not _allowed(overlay, tokenizer[0], a, 10002)


def test_router_autoscaler_metric_is_published_from_a_real_histogram() -> None:
    import yaml

    rules = yaml.safe_load((K8S / "monitoring" / "prometheus-adapter-rules.yaml").read_text())
    (rule,) = rules["rules"]["custom"]
    hpa = one("gpu", "HorizontalPodAutoscaler", "sluice-router")
    pods_metric = next(m for m in hpa["spec"]["metrics"] if m["type"] == "Pods")
    assert pods_metric["pods"]["metric"]["name"] == rule["name"]["as"]
    histogram = re.search(r"(sluice_\w+)_count", rule["seriesQuery"]).group(1)
    sources = "".join(p.read_text() for p in (K8S.parents[1] / "services").rglob("metrics.py"))
    assert f'"{histogram}"' in sources, f"no metric {histogram} in services/**/metrics.py"
    assert '"queue"' in sources and 'phase="queue"' in rule["seriesQuery"]
