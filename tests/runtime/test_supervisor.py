import asyncio
import os
import signal
import sys

from tokenmill.runtime.supervisor import ChildSpec, Supervisor


def test_crashed_child_is_reported_and_restarted_then_all_stop() -> None:
    exits: list[str] = []
    sleeper = [sys.executable, "-c", "import time; time.sleep(60)"]
    sup = Supervisor([ChildSpec("a", sleeper), ChildSpec("b", sleeper)], on_exit=exits.append)
    sup.start()
    first_pid = sup.pid("a")

    async def crash_and_watch() -> None:
        watcher = asyncio.create_task(sup.watch(interval_s=0.02))
        os.kill(first_pid, signal.SIGKILL)
        for _ in range(200):
            if exits:
                break
            await asyncio.sleep(0.02)
        watcher.cancel()

    asyncio.run(crash_and_watch())
    assert exits == ["a"]
    assert sup.pid("a") != first_pid and sup.children["a"].restarts == 1
    sup.stop(timeout_s=5)
    assert all(c.process.poll() is not None for c in sup.children.values())
