"""The fair queue's order: classes first, then tokens shared by weight, arrival order within a
tenant; timeouts and cancellations hold no slot."""
from __future__ import annotations

import asyncio
from collections import Counter

import pytest

from tokenmill.tenants.config import Tenant
from tokenmill.tenants.fair_queue import FairQueue, QueueTimeout


def tenant(name: str, weight: float = 1.0, cls: str = "standard") -> Tenant:
    return Tenant(name, (f"k-{name}",), cls, weight)


async def served_tokens(queue: FairQueue, senders: dict[Tenant, list[int]], releases: int) -> Counter[str]:
    """Every sender's requests queued at once behind a held slot; then `releases` slots freed one
    at a time, each request's streams charging its cost: the tokens each tenant got."""
    held = await queue.acquire(tenant("holder"), None)
    costs = {}
    tasks = []
    for t, sent in senders.items():
        for cost in sent:
            task = asyncio.create_task(queue.acquire(t, None))
            costs[task] = cost
            tasks.append(task)
    await asyncio.sleep(0)
    got: Counter[str] = Counter()
    queue.release(held)
    for _ in range(releases):
        for _ in range(20):  # the grant reaches its waiting task through a few loop turns
            await asyncio.sleep(0)
        done = [t for t in tasks if t.done() and not t.result().released]
        assert len(done) == 1  # one slot: one request at a time
        slot = done[0].result()
        got[slot.tenant.name] += costs[done[0]]
        queue.charge(slot, costs[done[0]])
        queue.release(slot)
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    return got


@pytest.mark.parametrize(("weights", "share"), [((1.0, 1.0), 1.0), ((3.0, 1.0), 3.0)])
def test_backlogged_tenants_get_tokens_by_weight_whatever_their_request_counts(weights, share) -> None:
    heavy, light = tenant("heavy", weights[0]), tenant("light", weights[1])
    # heavy sends ten times the requests of light, and light's requests are the longer ones
    got = asyncio.run(served_tokens(FairQueue(1), {heavy: [10] * 400, light: [25] * 40}, 60))
    assert got["heavy"] / got["light"] == pytest.approx(share, rel=0.1)


def test_a_waiting_interactive_request_goes_before_every_waiting_batch_one() -> None:
    async def main() -> list[str]:
        queue = FairQueue(1)
        held = await queue.acquire(tenant("holder"), None)
        order: list[str] = []

        async def one(t: Tenant) -> None:
            slot = await queue.acquire(t, None)
            order.append(t.name)
            await asyncio.sleep(0)
            queue.charge(slot, 10)
            queue.release(slot)
        tasks = [asyncio.create_task(one(tenant("sweeps", cls="batch"))) for _ in range(4)]
        await asyncio.sleep(0)
        tasks.append(asyncio.create_task(one(tenant("plain"))))
        tasks.append(asyncio.create_task(one(tenant("assistant", cls="interactive"))))
        await asyncio.sleep(0)
        queue.release(held)
        await asyncio.gather(*tasks)
        return order
    assert asyncio.run(main()) == ["assistant", "plain", "sweeps", "sweeps", "sweeps", "sweeps"]


def test_a_wait_past_its_timeout_raises_and_a_cancelled_waiter_holds_no_slot() -> None:
    async def main() -> None:
        queue = FairQueue(1)
        held = await queue.acquire(tenant("a"), None)
        with pytest.raises(QueueTimeout, match="saturated for the 0.05 s"):
            await queue.acquire(tenant("b"), 0.05)
        assert queue.waiting_for("b") == 0
        gone = asyncio.create_task(queue.acquire(tenant("c"), None))
        await asyncio.sleep(0)
        assert queue.waiting_for("c") == 1
        gone.cancel()
        await asyncio.gather(gone, return_exceptions=True)
        assert queue.waiting_for("c") == 0
        queue.release(held)
        queue.release(held)  # a second release of one slot changes nothing
        assert queue.share.in_flight == 0
        again = await queue.acquire(tenant("d"), 0.05)
        assert queue.share.in_flight == 1 and not again.released
        # granted and cancelled at once: the grant is handed back, not kept by a task that is gone
        racing = asyncio.create_task(queue.acquire(tenant("e"), None))
        await asyncio.sleep(0)
        queue.release(again)
        racing.cancel()
        await asyncio.gather(racing, return_exceptions=True)
        assert racing.cancelled() and queue.share.in_flight == 0 and queue.waiting_for("e") == 0
        # cancelled, and a slot frees before the cancelled task runs again: the slot goes to the next
        # waiter, not to the one that is gone (nor is it lost)
        holder = await queue.acquire(tenant("f"), None)
        leaving = asyncio.create_task(queue.acquire(tenant("g"), None))
        staying = asyncio.create_task(queue.acquire(tenant("h"), None))
        await asyncio.sleep(0)
        leaving.cancel()
        queue.release(holder)  # before `leaving` has run its cleanup
        slot = await staying
        await asyncio.gather(leaving, return_exceptions=True)
        assert slot.tenant.name == "h" and queue.share.in_flight == 1 and queue.waiting_for("g") == 0
        queue.release(slot)
        assert queue.share.in_flight == 0
    asyncio.run(main())


def test_a_tenant_back_from_idle_gets_no_credit_for_it() -> None:
    async def main() -> Counter[str]:
        queue = FairQueue(1)
        busy, idle = tenant("busy"), tenant("idle")
        for _ in range(50):  # busy alone for a while: its virtual time runs ahead, the class's with it
            slot = await queue.acquire(busy, None)
            queue.charge(slot, 10)
            queue.release(slot)
        return await served_tokens(queue, {busy: [10] * 40, idle: [10] * 40}, 20)
    got = asyncio.run(main())
    assert got["busy"] == pytest.approx(got["idle"], rel=0.25)  # shared from the start, not idle first


def test_a_queue_needs_a_slot() -> None:
    with pytest.raises(ValueError, match="--max-in-flight must be at least 1"):
        FairQueue(0)


def test_batch_requests_leave_the_other_classes_room() -> None:
    async def main() -> tuple[int, bool, bool]:
        queue = FairQueue(5, batch_share=0.8)
        sweeps = [asyncio.create_task(queue.acquire(tenant("sweeps", cls="batch"), None)) for _ in range(6)]
        await asyncio.sleep(0)
        admitted = sum(t.done() for t in sweeps)
        assistant = await asyncio.wait_for(queue.acquire(tenant("assistant", cls="interactive"), None), 1)
        full = queue.share.in_flight == 5
        queue.release(assistant)  # a slot, but batch ones are at their share: none goes in
        await asyncio.sleep(0)
        still = sum(t.done() for t in sweeps) == admitted
        for task in sweeps:
            task.cancel()
        await asyncio.gather(*sweeps, return_exceptions=True)
        return admitted, full, still
    assert asyncio.run(main()) == (4, True, True)
    with pytest.raises(ValueError, match="--batch-share must be in"):
        FairQueue(4, batch_share=0)
