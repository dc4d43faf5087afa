"""The Kubernetes connector: the planner's replicas are Deployments' pods, and it scales them
through each Deployment's scale subresource (`deploy/k8s/`: `tokenmill-prefill`,
`tokenmill-decode`, or `tokenmill-agg`), with the official `kubernetes` client.

Observed: every pod labelled `app.kubernetes.io/component=<role>` in the namespace, one worker
record each — `serving` once its Ready condition holds (since when: that condition's transition
time, for the warm-up rule), `draining` once it is being deleted (its preStop hook drains it),
`starting` before. The worker id is the pod's name, as the worker registers itself
(`--worker-id $(POD_NAME)`), so the frontend's per-worker gauges match.
Acted: `replicas += delta` (never below 0) on the role's Deployment. A pod that never becomes
ready stays `starting`, which the planner does not count as serving capacity.

The client is synchronous; every call runs on a thread, off the event loop.
"""
from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import Any

import urllib3
from kubernetes.client.exceptions import ApiException

from tokenmill.planner.live import ActionOutcome

log = logging.getLogger(__name__)

ROLE_LABEL = "app.kubernetes.io/component"


@dataclass(slots=True)
class KubernetesConnector:
    apps: Any  # kubernetes.client.AppsV1Api
    core: Any  # kubernetes.client.CoreV1Api
    namespace: str
    deployments: dict[str, str]  # role -> Deployment name

    @classmethod
    def from_cluster(cls, namespace: str, prefix: str, roles: tuple[str, ...]) -> KubernetesConnector:
        """In a pod: its service account; elsewhere: ~/.kube/config. ValueError naming the flag."""
        from kubernetes import client, config

        try:
            config.load_incluster_config()
        except config.ConfigException:
            try:
                config.load_kube_config()
            except (config.ConfigException, OSError) as exc:
                raise ValueError(f"--connector kubernetes: no in-cluster account and no kubeconfig ({exc})") from exc
        api = client.ApiClient()
        return cls(client.AppsV1Api(api), client.CoreV1Api(api), namespace, {r: f"{prefix}-{r}" for r in roles})

    async def roles(self) -> set[str]:
        """The roles whose Deployment exists (decode among them: disaggregated)."""
        present = set()
        for role, name in self.deployments.items():
            try:
                await asyncio.to_thread(self.apps.read_namespaced_deployment_scale, name, self.namespace)
                present.add(role)
            except (ApiException, urllib3.exceptions.HTTPError) as exc:  # 404: the layout has no such role
                log.debug("no Deployment %s: %s", name, exc)
        return present

    async def workers(self) -> list[dict[str, Any]]:
        records = []
        for role in self.deployments:
            pods = await asyncio.to_thread(self.core.list_namespaced_pod, self.namespace,
                                           label_selector=f"{ROLE_LABEL}={role}")
            records += [_record(pod, role) for pod in pods.items]
        return records

    async def scale(self, role: str, delta: int) -> ActionOutcome:
        name = self.deployments.get(role)
        if name is None:
            return ActionOutcome(role, delta, 400, {"error": f"no Deployment for role {role!r}"})
        try:
            current = await asyncio.to_thread(self.apps.read_namespaced_deployment_scale, name, self.namespace)
            replicas = max(0, (current.spec.replicas or 0) + delta)
            await asyncio.to_thread(self.apps.patch_namespaced_deployment_scale, name, self.namespace,
                                    {"spec": {"replicas": replicas}})
        except (ApiException, urllib3.exceptions.HTTPError) as exc:  # reported; the next interval asks again
            status = getattr(exc, "status", None) or 503
            log.warning("planner: scaling %s by %+d failed (%s)", name, delta, status)
            return ActionOutcome(role, delta, int(status), {"deployment": name, "error": str(exc).splitlines()[0]})
        log.info("planner: %s %+d -> %d replicas", name, delta, replicas)
        return ActionOutcome(role, delta, 200, {"deployment": name, "replicas": replicas})


def _record(pod: Any, role: str) -> dict[str, Any]:
    ready = next((c for c in pod.status.conditions or () if c.type == "Ready"), None)
    if pod.metadata.deletion_timestamp is not None:
        state = "draining"
    elif ready is not None and ready.status == "True":
        state = "serving"
    else:
        state = "starting"
    since = ready.last_transition_time.timestamp() if state == "serving" and ready.last_transition_time else None
    return {"name": pod.metadata.name, "role": role, "state": state, "started_at": since}
