"""deploy/k8s, checked without a cluster (none can run here): every object loads into the official
client's model of its kind with no field the model does not know (a typo would vanish silently on
a real apply), every tokenmill container's arguments parse with tokenmill's own CLI, and the
wiring holds — Services select their pods and name real ports, probes hit the ports the
processes listen on, workers drain before they stop, the planner may do what it does."""
from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import yaml
from kubernetes import client

from tokenmill.cli import build_parser

K8S = Path(__file__).resolve().parents[2] / "deploy" / "k8s"
MODELS = {("v1", "Namespace"): client.V1Namespace, ("v1", "Service"): client.V1Service,
          ("v1", "ServiceAccount"): client.V1ServiceAccount,
          ("v1", "PersistentVolumeClaim"): client.V1PersistentVolumeClaim,
          ("apps/v1", "Deployment"): client.V1Deployment,
          ("rbac.authorization.k8s.io/v1", "Role"): client.V1Role,
          ("rbac.authorization.k8s.io/v1", "RoleBinding"): client.V1RoleBinding}


def _objects() -> list[dict[str, Any]]:
    kustomization = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    assert sorted(kustomization["resources"]) == sorted(p.name for p in K8S.glob("*.yaml")
                                                         if p.name != "kustomization.yaml")
    return [doc for name in kustomization["resources"] for doc in yaml.safe_load_all((K8S / name).read_text()) if doc]


def _unknown_fields(given: Any, loaded: Any, path: str = "") -> list[str]:
    """Keys of `given` that the model dropped (it ignores what it does not know)."""
    problems = []
    if isinstance(given, dict):
        for key, value in given.items():
            if not isinstance(loaded, dict) or key not in loaded:
                problems.append(f"{path}.{key}")
            else:
                problems += _unknown_fields(value, loaded[key], f"{path}.{key}")
    elif isinstance(given, list) and isinstance(loaded, list):
        for index, (item, kept) in enumerate(zip(given, loaded)):
            problems += _unknown_fields(item, kept, f"{path}[{index}]")
    return problems


def _deployments() -> dict[str, dict[str, Any]]:
    return {o["metadata"]["name"]: o for o in _objects() if o["kind"] == "Deployment"}


def _container(deployment: dict[str, Any]) -> dict[str, Any]:
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    return container


def _flag(args: list[str], name: str) -> str:
    return args[args.index(name) + 1]


@pytest.mark.parametrize("obj", _objects(), ids=lambda o: f"{o['kind']}/{o['metadata']['name']}")
def test_every_object_loads_into_the_clients_model_with_no_unknown_field(obj: dict[str, Any]) -> None:
    model = MODELS[(obj["apiVersion"], obj["kind"])].from_dict(obj)
    sent = client.ApiClient().sanitize_for_serialization(model)  # what the client would send an apiserver
    assert _unknown_fields(obj, sent) == []


def test_tokenmill_containers_take_their_arguments() -> None:
    containers = [_container(d) for d in _deployments().values() if _container(d)["image"] == "tokenmill"]
    assert len(containers) == 4  # frontend, prefill, decode, planner
    for container in containers:
        env = {e["name"] for e in container.get("env", [])}
        args = [re.sub(r"\$\((\w+)\)", lambda m: m.group(1).lower().replace("_", "-"), a) for a in container["args"]]
        assert {m for a in container["args"] for m in re.findall(r"\$\((\w+)\)", a)} <= env
        parsed = build_parser(args).parse_args(args)  # argparse exits (SystemExit) on any unknown flag
        assert parsed.command == args[0]


def test_services_select_their_pods_and_name_their_ports() -> None:
    deployments = list(_deployments().values())
    for service in (o for o in _objects() if o["kind"] == "Service"):
        selector = service["spec"]["selector"]
        (chosen,) = [d for d in deployments if selector.items() <= d["spec"]["template"]["metadata"]["labels"].items()]
        ports = {p["name"] for p in _container(chosen)["ports"]}
        assert {p["targetPort"] for p in service["spec"]["ports"]} <= ports


def test_probes_and_the_drain_match_what_the_processes_do() -> None:
    deployments = _deployments()
    frontend = _container(deployments["tokenmill-frontend"])
    assert frontend["readinessProbe"]["httpGet"] == {"path": "/health", "port": "http"}
    assert {"containerPort": int(_flag(frontend["args"], "--port")), "name": "http"} in frontend["ports"]
    assert "nvidia.com/gpu" not in frontend["resources"]["requests"]  # frontends run without accelerators
    for role in ("prefill", "decode"):
        deployment = deployments[f"tokenmill-{role}"]
        worker = _container(deployment)
        assert _flag(worker["args"], "--role") == role
        assert deployment["spec"]["template"]["metadata"]["labels"]["app.kubernetes.io/component"] == role
        assert worker["readinessProbe"]["httpGet"] == {"path": "/health", "port": "health"}
        assert {"containerPort": int(_flag(worker["args"], "--health-port")), "name": "health"} in worker["ports"]
        assert _flag(worker["args"], "--worker-id") == "$(POD_NAME)"  # the planner's pods are its workers
        assert "kill -USR1 1" in " ".join(worker["lifecycle"]["preStop"]["exec"]["command"])
        assert deployment["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] >= 60
        assert worker["resources"]["requests"]["nvidia.com/gpu"] == "1"
        shm = [v for v in deployment["spec"]["template"]["spec"]["volumes"] if v["name"] == "dshm"]
        assert shm and shm[0]["emptyDir"]["medium"] == "Memory"


def test_the_planner_may_list_pods_and_scale_the_worker_deployments() -> None:
    objects = _objects()
    (role,) = [o for o in objects if o["kind"] == "Role"]
    (binding,) = [o for o in objects if o["kind"] == "RoleBinding"]
    planner = _deployments()["tokenmill-planner"]
    account = planner["spec"]["template"]["spec"]["serviceAccountName"]
    assert binding["roleRef"]["name"] == role["metadata"]["name"]
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": account}]
    grants = {(r, v) for rule in role["rules"] for r in rule["resources"] for v in rule["verbs"]}
    assert {("deployments/scale", "get"), ("deployments/scale", "patch"), ("pods", "list")} <= grants
    assert _flag(_container(planner)["args"], "--connector") == "kubernetes"
