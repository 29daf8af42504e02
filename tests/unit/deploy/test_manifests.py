"""The Kustomize overlays render, every object passes schema validation, and the manifests say
what the architecture promises: persistence, autoscaling, disruption budgets, probes, security
contexts, network isolation, and engines as Ray actors on KubeRay in the gpu overlay.

Checked offline; tests/unit/deploy/manifests.py says how.
"""

from __future__ import annotations

import copy
import re

import jsonschema
import pytest
from kubernetes_validate.utils import SchemaNotFoundError

from tests.unit.deploy.manifests import (
    K8S,
    OVERLAYS,
    SLUICE_IMAGES,
    objects,
    one,
    pods,
    render,
    service_pods,
    validate,
)


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_overlay_renders_the_whole_stack(overlay: str) -> None:
    kinds = {(doc["kind"], doc["metadata"]["name"]) for doc in render(overlay)}
    for expected in [
        ("Namespace", "sluice"),
        ("Deployment", "sluice-router"),
        ("Service", "sluice-router"),
        ("HorizontalPodAutoscaler", "sluice-router"),
        ("PodDisruptionBudget", "sluice-router"),
        ("Deployment", "sluice-tokenizer"),
        ("Service", "sluice-tokenizer"),
        ("HorizontalPodAutoscaler", "sluice-tokenizer"),
        ("StatefulSet", "sluice-redis"),
        ("Service", "sluice-redis"),
        ("NetworkPolicy", "default-deny-ingress"),
    ]:
        assert expected in kinds, f"{overlay}: missing {expected}"
    for doc in render(overlay):
        if doc["kind"] != "Namespace":
            assert doc["metadata"].get("namespace") == "sluice", doc["metadata"]["name"]
    if overlay == "gpu":
        assert ("RayCluster", "sluice-ray") in kinds
        assert ("PersistentVolumeClaim", "sluice-models") in kinds
        assert not any(kind == "Deployment" and "engine" in name for kind, name in kinds)
    else:
        assert not objects(overlay, "RayCluster"), "the local overlay needs no KubeRay"
        assert ("Deployment", "sluice-engine") in kinds


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_object_passes_schema_validation(overlay: str) -> None:
    for doc in render(overlay):
        try:
            validate(doc)
        except SchemaNotFoundError as error:
            pytest.fail(f"{overlay}: no schema for {doc['kind']}: {error.message}")
        except jsonschema.ValidationError as error:
            path = ".".join(str(part) for part in error.absolute_path)
            pytest.fail(
                f"{overlay}: {doc['kind']}/{doc['metadata']['name']} {path}: {error.message}"
            )


def test_validation_catches_mistakes() -> None:
    """The validators are strict: a misspelt field or a missing required one fails."""
    router = copy.deepcopy(one("local", "Deployment", "sluice-router"))
    router["spec"]["template"]["spec"]["containers"][0]["readinesProbe"] = {"grpc": {"port": 1}}
    with pytest.raises(jsonschema.ValidationError):
        validate(router)
    ray = one("gpu", "RayCluster", "sluice-ray")
    typo = copy.deepcopy(ray)
    typo["spec"]["workerGroupSpecs"][0]["replica"] = 2
    with pytest.raises(jsonschema.ValidationError):
        validate(typo)
    pod_typo = copy.deepcopy(ray)
    pod_typo["spec"]["workerGroupSpecs"][0]["template"]["spec"]["containers"][0]["imag"] = "x"
    with pytest.raises(jsonschema.ValidationError):
        validate(pod_typo)
    unnamed = copy.deepcopy(ray)
    del unnamed["spec"]["workerGroupSpecs"][0]["groupName"]
    with pytest.raises(jsonschema.ValidationError):
        validate(unnamed)


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_secrets_are_referenced_never_inlined(overlay: str) -> None:
    assert not objects(overlay, "Secret")
    readme = (K8S / "README.md").read_text()
    referenced = set()
    for pod in pods(overlay):
        for volume in pod.spec.get("volumes", []):
            if "secret" in volume:
                referenced.add(volume["secret"]["secretName"])
        for container in pod.spec["containers"]:
            for variable in container.get("env", []):
                ref = variable.get("valueFrom", {}).get("secretKeyRef")
                if ref:
                    referenced.add(ref["name"])
    assert {"sluice-redis", "sluice-api-keys"} <= referenced
    for name in referenced:
        assert f"create secret generic {name}" in readme, f"README.md: how to create {name}?"


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_pods_run_unprivileged_with_bounded_resources(overlay: str) -> None:
    for pod in pods(overlay):
        security = pod.spec.get("securityContext", {})
        assert security.get("runAsNonRoot") is True, pod.owner
        assert security.get("seccompProfile", {}).get("type") == "RuntimeDefault", pod.owner
        assert pod.spec.get("automountServiceAccountToken") is False, pod.owner
        for container in pod.spec["containers"]:
            where = f"{pod.owner}/{container['name']}"
            context = container.get("securityContext", {})
            assert context.get("allowPrivilegeEscalation") is False, where
            assert context.get("readOnlyRootFilesystem") is True, where
            assert context.get("capabilities", {}).get("drop") == ["ALL"], where
            resources = container.get("resources", {})
            for bound in ("requests", "limits"):
                assert {"cpu", "memory"} <= set(resources.get(bound, {})), f"{where} {bound}"


def test_redis_persists_with_auth() -> None:
    redis = one("gpu", "StatefulSet", "sluice-redis")
    container = redis["spec"]["template"]["spec"]["containers"][0]
    args = container["args"]
    assert args[args.index("--appendonly") + 1] == "yes"
    assert args[args.index("--requirepass") + 1] == "$(REDIS_PASSWORD)"
    password = next(v for v in container["env"] if v["name"] == "REDIS_PASSWORD")
    assert password["valueFrom"]["secretKeyRef"]["name"] == "sluice-redis"
    mounts = {mount["name"]: mount["mountPath"] for mount in container["volumeMounts"]}
    claims = [claim["metadata"]["name"] for claim in redis["spec"]["volumeClaimTemplates"]]
    assert args[args.index("--dir") + 1] == mounts["data"] and "data" in claims
    assert redis["spec"]["serviceName"] in {
        s["metadata"]["name"] for s in objects("gpu", "Service")
    }


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_autoscalers_and_budgets_target_real_workloads(overlay: str) -> None:
    deployments = {d["metadata"]["name"]: d for d in objects(overlay, "Deployment")}
    for hpa in objects(overlay, "HorizontalPodAutoscaler"):
        target = hpa["spec"]["scaleTargetRef"]
        assert target["kind"] == "Deployment" and target["name"] in deployments
        assert 1 <= hpa["spec"]["minReplicas"] <= hpa["spec"]["maxReplicas"]
        assert any(
            m["type"] == "Resource" and m["resource"]["name"] == "cpu"
            for m in hpa["spec"]["metrics"]
        )
    router_metrics = one(overlay, "HorizontalPodAutoscaler", "sluice-router")["spec"]["metrics"]
    assert any(m["type"] == "Pods" for m in router_metrics), "the router scales on its queue delay"
    labels = {name: d["spec"]["template"]["metadata"]["labels"] for name, d in deployments.items()}
    for budget in objects(overlay, "PodDisruptionBudget"):
        selector = budget["spec"]["selector"]["matchLabels"]
        assert any(all(lab.get(k) == v for k, v in selector.items()) for lab in labels.values())


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_services_select_pods_and_name_their_ports(overlay: str) -> None:
    for service in objects(overlay, "Service"):
        chosen = service_pods(overlay, service)
        assert chosen, f"{overlay}: Service {service['metadata']['name']} selects no pod"
        for port in service["spec"]["ports"]:
            for pod in chosen:
                ports = [p for c in pod.spec["containers"] for p in c.get("ports", [])]
                target = port["targetPort"]
                key = "name" if isinstance(target, str) else "containerPort"
                assert any(p.get(key) == target for p in ports), (service["metadata"]["name"], port)


def test_ray_head_exposes_neither_dashboard_nor_jobs_api() -> None:
    ray = one("gpu", "RayCluster", "sluice-ray")
    head = ray["spec"]["headGroupSpec"]
    assert head["rayStartParams"]["include-dashboard"] == "false"  # the jobs API lives in it
    assert head.get("serviceType", "ClusterIP") == "ClusterIP" and not head.get("enableIngress")
    container = head["template"]["spec"]["containers"][0]
    assert [port["containerPort"] for port in container["ports"]] == [6379]
    assert "ray-client-server-port" not in head["rayStartParams"]
    assert ray["metadata"]["annotations"]["ray.io/overwrite-container-cmd"] == "true"
    assert "KUBERAY_GEN_RAY_START_CMD" in " ".join(container["args"])


def test_gpu_workers_run_one_engine_actor_per_gpu() -> None:
    ray = one("gpu", "RayCluster", "sluice-ray")
    (group,) = ray["spec"]["workerGroupSpecs"]
    container = group["template"]["spec"]["containers"][0]
    assert container["resources"]["limits"]["nvidia.com/gpu"] == 1
    head = ray["spec"]["headGroupSpec"]["template"]["spec"]["containers"][0]
    engines = next(v["value"] for v in head["env"] if v["name"] == "SLUICE_ENGINES")
    assert int(engines) == group["replicas"] == group["maxReplicas"] >= 1
    assert ray["spec"]["headGroupSpec"]["rayStartParams"]["num-gpus"] == "0"
    mounts = {m["mountPath"] for m in container["volumeMounts"]}
    assert "/models" in mounts, "the gpu overlay loads the model from the PVC"
    volumes = {v["name"]: v for v in group["template"]["spec"]["volumes"]}
    assert volumes["models"]["persistentVolumeClaim"]["claimName"] == "sluice-models"


def test_base_raycluster_names_the_image_ray_version() -> None:
    ray = one("gpu", "RayCluster", "sluice-ray")
    dockerfile = (K8S.parent / "docker" / "Dockerfile.cuda").read_text()
    assert f"ARG RAY_VERSION={ray['spec']['rayVersion']}\n" in dockerfile


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_images_are_pinned(overlay: str) -> None:
    """Sluice's own images get their tag from kustomize `images:`; others name an exact version."""
    images = {c["image"] for pod in pods(overlay) for c in pod.spec["containers"]}
    for image in images:
        name, _, tag = image.partition(":")
        assert tag and tag != "latest", f"{overlay}: {image} is not pinned"
        if name not in SLUICE_IMAGES:
            assert re.match(r"\d+\.\d+\.\d+", tag), f"{overlay}: {image} is not an exact version"
