"""The planner's Kubernetes connector through the official client, over real HTTP, against a
stand-in for the three apiserver endpoints it uses (no cluster can run here): a Deployment's
scale subresource (read, patch) and the pods of a role. Roles are the Deployments that exist;
pods become worker records by their Ready condition and deletion; scaling adds to the replicas
and never goes below zero."""
from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from kubernetes import client

from tokenmill.bench.harness.serve_process import free_port
from tokenmill.planner.kubernetes_connector import KubernetesConnector

NAMESPACE = "tokenmill"
READY_AT = "2026-12-03T12:00:00Z"


class FakeApiserver:
    def __init__(self) -> None:
        self.replicas = {"tokenmill-prefill": 1, "tokenmill-decode": 2}
        self.patches: list[dict[str, Any]] = []
        self.pods = {"prefill": [_pod("tokenmill-prefill-a", ready=True)],
                     "decode": [_pod("tokenmill-decode-a", ready=True), _pod("tokenmill-decode-b", ready=False),
                                _pod("tokenmill-decode-c", ready=True, deleting=True)]}
        self.app = FastAPI()
        base = "/apis/apps/v1/namespaces/{namespace}/deployments/{name}/scale"
        self.app.get(base)(self.read_scale)
        self.app.patch(base)(self.patch_scale)
        self.app.get("/api/v1/namespaces/{namespace}/pods")(self.list_pods)

    def _scale(self, name: str) -> JSONResponse:
        if name not in self.replicas:
            return JSONResponse({"kind": "Status", "apiVersion": "v1", "status": "Failure", "reason": "NotFound",
                                 "code": 404, "message": f"deployments.apps {name!r} not found"}, 404)
        return JSONResponse({"apiVersion": "autoscaling/v1", "kind": "Scale",
                             "metadata": {"name": name, "namespace": NAMESPACE},
                             "spec": {"replicas": self.replicas[name]}, "status": {"replicas": self.replicas[name]}})

    async def read_scale(self, namespace: str, name: str) -> JSONResponse:
        return self._scale(name)

    async def patch_scale(self, namespace: str, name: str, request: Request) -> JSONResponse:
        body = await request.json()
        self.patches.append({"name": name, "body": body, "content_type": request.headers.get("content-type")})
        self.replicas[name] = body["spec"]["replicas"]
        return self._scale(name)

    async def list_pods(self, namespace: str, labelSelector: str = "") -> JSONResponse:  # noqa: N803
        role = labelSelector.split("=", 1)[1]
        return JSONResponse({"apiVersion": "v1", "kind": "PodList", "metadata": {}, "items": self.pods.get(role, [])})


def _pod(name: str, ready: bool, deleting: bool = False) -> dict[str, Any]:
    metadata = {"name": name, "namespace": NAMESPACE, **({"deletionTimestamp": READY_AT} if deleting else {})}
    condition = {"type": "Ready", "status": "True" if ready else "False", "lastTransitionTime": READY_AT}
    return {"apiVersion": "v1", "kind": "Pod", "metadata": metadata, "status": {"conditions": [condition]}}


@pytest.fixture
def apiserver() -> Iterator[tuple[FakeApiserver, str]]:
    fake, port = FakeApiserver(), free_port()
    server = uvicorn.Server(uvicorn.Config(fake.app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert time.monotonic() < deadline and thread.is_alive(), "the stand-in apiserver did not start"
        time.sleep(0.02)
    yield fake, f"http://127.0.0.1:{port}"
    server.should_exit = True
    thread.join(timeout=10)


def _connector(url: str) -> KubernetesConnector:
    api = client.ApiClient(client.Configuration(host=url))
    return KubernetesConnector(client.AppsV1Api(api), client.CoreV1Api(api), NAMESPACE,
                               {role: f"tokenmill-{role}" for role in ("agg", "prefill", "decode")})


def test_roles_workers_and_scaling_through_the_official_client(apiserver: tuple[FakeApiserver, str]) -> None:
    fake, url = apiserver
    connector = _connector(url)

    async def scenario() -> None:
        assert await connector.roles() == {"prefill", "decode"}  # no tokenmill-agg Deployment
        workers = {w["name"]: w for w in await connector.workers()}
        assert {name: (w["role"], w["state"]) for name, w in workers.items()} == {
            "tokenmill-prefill-a": ("prefill", "serving"), "tokenmill-decode-a": ("decode", "serving"),
            "tokenmill-decode-b": ("decode", "starting"), "tokenmill-decode-c": ("decode", "draining")}
        assert workers["tokenmill-decode-a"]["started_at"] == pytest.approx(1796299200.0)  # READY_AT
        up = await connector.scale("prefill", 2)
        down = await connector.scale("decode", -5)
        assert (up.status, up.detail["replicas"], down.detail["replicas"]) == (200, 3, 0)  # never below zero
        missing = await connector.scale("agg", 1)  # reported, not raised: the next interval asks again
        assert missing.status == 404 and "tokenmill-agg" in missing.detail["deployment"]
        connector.deployments.pop("agg")
        assert (await connector.scale("agg", 1)).status == 400

    asyncio.run(scenario())
    assert fake.replicas == {"tokenmill-prefill": 3, "tokenmill-decode": 0}
    assert [p["body"] for p in fake.patches] == [{"spec": {"replicas": 3}}, {"spec": {"replicas": 0}}]
    assert all("patch" in (p["content_type"] or "") for p in fake.patches)


@pytest.mark.parametrize("connector,message", [("kubernetes", "--connector kubernetes: no in-cluster account"),
                                               ("local", "--url http://127.0.0.1:9: /admin/workers")])
def test_planner_run_without_its_deployment_exits_2_naming_it(connector: str, message: str, tmp_path: Any,
                                                              monkeypatch: pytest.MonkeyPatch,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    from tokenmill.cli import main

    monkeypatch.setenv("KUBECONFIG", str(tmp_path / "no-kubeconfig"))
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    code = main(["planner", "run", "--url", "http://127.0.0.1:9", "--profile", "llama-3.1-8b@h100:fp8:tp1",
                 "--connector", connector])
    assert code == 2 and message in capsys.readouterr().out
