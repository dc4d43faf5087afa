"""The frontend's tenants in the fleet simulator: each request's priority in the engines, and the
fleet's slots (`--max-in-flight`) released by class and fair share, in the live frontend's order
(`tenants.fair_queue.FairShare`, the same code).

    admission = FleetAdmission(tenants, max_in_flight=64, batch_share=0.8)
    for request in admission.arrive(request): route(request)    # let in now, or held
    for request in admission.done(request_id, tokens): route(request)
    admission.priority(request)                                 # -1 interactive, 0 standard, 1 batch

A request names its tenant (`TraceRequest.tenant`); one that names none, or a tenant not given,
is the default tenant's (standard class, weight 1), as a live request without a tenants file is.
Without `max_in_flight` every request is let in at once. A request holds its slot from admission
to its last token, and is charged its prompt and output tokens then, as the live frontend does.
"""
from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

from tokenmill.tenants.config import Tenant
from tokenmill.tenants.fair_queue import FairShare, Slot

if TYPE_CHECKING:
    from tokenmill.sim.fleet.arrivals import TraceRequest

DEFAULT_TENANT = Tenant("default", ())


class FleetAdmission:
    def __init__(self, tenants: Iterable[Tenant] = (), max_in_flight: int | None = None,
                 batch_share: float = 0.8) -> None:
        self.tenants = {t.name: t for t in tenants}
        self.share = FairShare(max_in_flight, batch_share) if max_in_flight is not None else None
        self.slots: dict[str, Slot] = {}  # request id -> the slot it holds

    def tenant(self, request: TraceRequest) -> Tenant:
        return self.tenants.get(request.tenant, DEFAULT_TENANT)

    def priority(self, request: TraceRequest) -> int:
        return self.tenant(request).priority

    def arrive(self, request: TraceRequest) -> list[TraceRequest]:
        """The requests let in now (this one, or none while the slots are taken)."""
        if self.share is None:
            return [request]
        self.share.enqueue(self.tenant(request), request)
        return self._granted(self.share)

    def done(self, request_id: str, tokens: int) -> list[TraceRequest]:
        """`request_id` streamed its last token, `tokens` in all: its slot frees; who goes next."""
        slot = self.slots.pop(request_id, None)
        if slot is None or self.share is None:
            return []
        self.share.charge(slot, tokens)
        self.share.release(slot)
        return self._granted(self.share)

    def waiting(self) -> int:
        return 0 if self.share is None else sum(len(q) for q in self.share.waiting.values())

    def _granted(self, share: FairShare) -> list[TraceRequest]:
        out = []
        for request, slot in share.grant():
            self.slots[request.request_id] = slot
            out.append(request)
        return out
