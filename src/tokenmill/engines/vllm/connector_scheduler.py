"""The scheduler side of `TokenmillConnector`, in vLLM's engine core process.

    request kv_transfer_params          what happens
    {"do_remote_decode": True}          prefill: after its one-token step the prompt's blocks are
                                        held and `request_finished` returns the handle
    {"do_remote_prefill": True, ...}    decode: the handle's tokens beyond the local prefix-cache
    (a prefill worker's handle)         hits are loaded asynchronously, then decoding goes on

Invariants: a request pulls at most once (a failed pull recomputes; it never pulls again); a
prefill request's blocks are held only if it ended by length (its one token) and the worker
side knows the agent to name in the handle; every held id reaches the worker side in the next
step's `StepJobs.held`, so it alone reports it as finished sending (released or timed out).
"""
from __future__ import annotations

import logging
from typing import Any

from tokenmill.engines.vllm.connector_jobs import LoadJob, SealJob, StepJobs, stamp

log = logging.getLogger(__name__)

REMOTE_DECODE = "do_remote_decode"
REMOTE_PREFILL = "do_remote_prefill"


class SchedulerSide:
    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self.agent: dict[str, Any] | None = None  # the worker side's agent and layout (handshake)
        self.layout: dict[str, Any] | None = None
        self._producing: dict[str, Any] = {}  # prefill requests (vLLM Request) not finished yet
        self._jobs = StepJobs()

    def handshake(self, agent: dict[str, Any], layout: dict[str, Any]) -> None:
        self.agent, self.layout = agent, layout

    def on_new_request(self, request: Any) -> None:
        if (request.kv_transfer_params or {}).get(REMOTE_DECODE):
            self._producing[request.request_id] = request

    def matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int, bool]:
        """(prompt tokens the handle brings beyond the local hits, load asynchronously)."""
        handle = _pending_handle(request)
        if handle is None:
            return 0, False
        loadable = int(handle.get("num_tokens", 0)) - num_computed_tokens
        return (loadable, True) if loadable > 0 else (0, False)

    def after_alloc(self, request: Any, block_ids: list[int], num_external_tokens: int) -> None:
        handle = _pending_handle(request)
        if handle is None:
            return
        request.kv_transfer_params[REMOTE_PREFILL] = False  # once: a failed pull is recomputed here
        if num_external_tokens <= 0:  # the local prefix cache had it all: only release the remote copy
            self._jobs.loads.append(LoadJob(request.request_id, handle, 0, []))
            return
        num_tokens = int(handle["num_tokens"])
        first = (num_tokens - num_external_tokens) // self.block_size
        last = -(-num_tokens // self.block_size)
        self._jobs.loads.append(LoadJob(request.request_id, handle, first, list(block_ids[first:last])))

    def step_jobs(self, scheduled: dict[str, int], block_ids_of: Any) -> StepJobs:
        """This step's jobs (and a fresh list for the next): seal each prefill request whose prompt
        this step completes. vLLM builds the jobs before it advances `num_computed_tokens`, so a
        request's count plus what is scheduled now says whether this is its last prefill step."""
        for request_id, request in self._producing.items():
            computing = scheduled.get(request_id, 0)
            if computing and request.num_computed_tokens + computing >= request.num_prompt_tokens:
                blocks = -(-request.num_prompt_tokens // self.block_size)
                self._jobs.seals.append(SealJob(request_id, list(block_ids_of(request_id))[:blocks]))
        jobs, self._jobs = self._jobs, StepJobs()
        return jobs

    def finished(self, request: Any, block_ids: list[int], length_capped: bool) -> tuple[bool, dict[str, Any] | None]:
        """(hold the blocks, the handle) for a request that ended; (False, None) for any but a
        prefill request that made its one token."""
        if self._producing.pop(request.request_id, None) is None:
            return False, None
        if not length_capped or not block_ids or self.agent is None:
            if self.agent is None:
                log.warning("no transfer agent announced by the worker side: %s is not handed off", request.request_id)
            return False, None
        self._jobs.held.append(request.request_id)
        return True, {"agent": self.agent, "layout": self.layout, "remote_request_id": request.request_id,
                      "block_ids": list(block_ids), "num_tokens": request.num_prompt_tokens,
                      "stamp": stamp(request.request_id)}


def _pending_handle(request: Any) -> dict[str, Any] | None:
    params = request.kv_transfer_params
    if not params or not params.get(REMOTE_PREFILL):
        return None
    return params
