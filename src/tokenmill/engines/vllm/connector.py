"""`TokenmillConnector`: vLLM's v1 KV connector over tokenmill's transfer agents, so disaggregated
vLLM workers move KV as tokenmill's own do (tcp here; any `TransferAgent` backend).

A vLLM worker whose role is prefill or decode starts vLLM with (config.py):

    --kv-transfer-config {"kv_connector": "TokenmillConnector",
                          "kv_connector_module_path": "tokenmill.engines.vllm.connector",
                          "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
                          "kv_connector_extra_config": {"worker_id": ..., "hold_timeout_s": ...,
                                                        "pull_timeout_s": ..., "faults": ...}}

vLLM builds one instance per process and role: the scheduler side (`connector_scheduler.py`) in
its engine core, the worker side (`connector_worker.py`) where the KV cache lives. The worker
side announces its agent through vLLM's handshake metadata; the scheduler side names it in each
handle. The handle's format is in `connector_jobs.py`.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorHandshakeMetadata,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
)
from vllm.v1.request import RequestStatus

from tokenmill.engines.vllm.connector_jobs import StepJobs
from tokenmill.engines.vllm.connector_scheduler import SchedulerSide
from tokenmill.engines.vllm.connector_worker import WorkerSide
from tokenmill.transfer import TcpBackend
from tokenmill.worker.transfer_faults import TransferFaults


class StepMetadata(KVConnectorMetadata):
    def __init__(self, jobs: StepJobs) -> None:
        self.jobs = jobs


@dataclass
class AgentAnnouncement(KVConnectorHandshakeMetadata):
    agent: dict[str, Any]
    layout: dict[str, Any]


class TokenmillConnector(KVConnectorBase_V1):
    def __init__(self, vllm_config: Any, role: KVConnectorRole, kv_cache_config: Any = None) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        extra = self._kv_transfer_config.kv_connector_extra_config or {}
        self._scheduler: SchedulerSide | None = None
        self._worker: WorkerSide | None = None
        if role == KVConnectorRole.SCHEDULER:
            self._scheduler = SchedulerSide(vllm_config.cache_config.block_size)
        else:
            # tcp alone: vLLM's cache is this process's private memory, which shm peers cannot map
            tcp = TcpBackend(str(extra.get("tcp_host", "127.0.0.1")), advertise_host=extra.get("advertise_host"))
            self._worker = WorkerSide(str(extra.get("worker_id", "vllm")), [tcp],
                                      float(extra.get("hold_timeout_s", 30.0)), float(extra.get("pull_timeout_s", 10.0)),
                                      TransferFaults.parse(extra.get("faults")))

    # -- worker side ------------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        self._worker_side().register(kv_caches)

    def get_handshake_metadata(self) -> AgentAnnouncement:
        worker = self._worker_side()
        return AgentAnnouncement(worker.agent.metadata(), worker.layout)

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        self._worker_side().start_loads(self._jobs())

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # loads are whole requests, finished before vLLM schedules them

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any) -> None:
        return  # nothing is pushed: a decode worker pulls the held blocks

    def wait_for_save(self) -> None:
        self._worker_side().seal(self._jobs())

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        sent, received, failed = self._worker_side().results()
        return KVConnectorTransferResults(finished_sending=sent, finished_recving=received, failed_recving=failed)

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.close()

    # -- scheduler side ---------------------------------------------------------------------

    def set_xfer_handshake_metadata(self, metadata: dict[int, KVConnectorHandshakeMetadata]) -> None:
        announcement = metadata.get(0)
        if isinstance(announcement, AgentAnnouncement):
            self._scheduler_side().handshake(announcement.agent, announcement.layout)

    def on_new_request(self, request: Any) -> None:
        self._scheduler_side().on_new_request(request)

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int | None, bool]:
        return self._scheduler_side().matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        self._scheduler_side().after_alloc(request, list(blocks.get_block_ids()[0]), num_external_tokens)

    def build_connector_meta(self, scheduler_output: Any) -> StepMetadata:
        manager = self._kv_cache_manager
        return StepMetadata(self._scheduler_side().step_jobs(
            scheduler_output.num_scheduled_tokens, lambda request_id: manager.get_block_ids(request_id)[0]))

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        return self._scheduler_side().finished(request, block_ids,
                                               request.status == RequestStatus.FINISHED_LENGTH_CAPPED)

    # -- helpers ----------------------------------------------------------------------------

    def _jobs(self) -> StepJobs:
        metadata = self._get_connector_metadata()
        return metadata.jobs if isinstance(metadata, StepMetadata) else StepJobs()

    def _worker_side(self) -> WorkerSide:
        if self._worker is None:
            raise RuntimeError("a worker-side call on the connector's scheduler side")
        return self._worker

    def _scheduler_side(self) -> SchedulerSide:
        if self._scheduler is None:
            raise RuntimeError("a scheduler-side call on the connector's worker side")
        return self._scheduler
