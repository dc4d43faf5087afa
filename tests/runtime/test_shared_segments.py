"""A killed child's process group leaves no Python shared-memory segment or multiprocessing
semaphore behind (vLLM's engine core and workers talk through such segments, and a SIGKILL skips
the finalizers and the resource tracker that unlink them), but a segment another process still
maps is left to it."""
from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from multiprocessing import resource_tracker, shared_memory

import pytest

from tokenmill.runtime.shared_segments import SHM_DIR
from tokenmill.runtime.supervisor import kill_leftovers

# A leader that starts a second process of its group; each maps a segment of its own (not known to
# Python's resource tracker, so that only kill_leftovers can remove it) and prints its name.
GROUP = """
import subprocess, sys, time
from multiprocessing import resource_tracker, shared_memory
segment = shared_memory.SharedMemory(create=True, size=1 << 20)
resource_tracker.unregister(segment._name, "shared_memory")
print(segment.name, flush=True)
if len(sys.argv) > 1:
    subprocess.Popen([sys.executable, "-c", sys.argv[1]])
time.sleep(120)
"""


@pytest.fixture
def group() -> Iterator[tuple[subprocess.Popen, list[str]]]:
    leader = subprocess.Popen([sys.executable, "-c", GROUP, GROUP], stdout=subprocess.PIPE, text=True,
                              start_new_session=True)
    assert leader.stdout is not None
    names = [leader.stdout.readline().strip(), leader.stdout.readline().strip()]
    yield leader, names
    leader.kill()
    leader.wait()
    for name in names:
        (SHM_DIR / name).unlink(missing_ok=True)


def test_the_groups_segments_go_with_it(group: tuple[subprocess.Popen, list[str]]) -> None:
    leader, names = group
    assert all((SHM_DIR / name).exists() for name in names)
    kill_leftovers(leader.pid)  # as a worker that outlived its stop grace, with its engine's processes
    assert not any((SHM_DIR / name).exists() for name in names)


def test_a_crashed_leaders_child_leaves_nothing(group: tuple[subprocess.Popen, list[str]]) -> None:
    leader, (_, child_segment) = group
    leader.kill()  # a crashed worker: its child (an engine core) lives on, mapping its segment
    leader.wait()
    kill_leftovers(leader.pid)
    assert not (SHM_DIR / child_segment).exists()


def test_a_segment_mapped_outside_the_group_stays(group: tuple[subprocess.Popen, list[str]]) -> None:
    leader, names = group
    kept = shared_memory.SharedMemory(name=names[0])  # this process maps the leader's segment
    resource_tracker.unregister(kept._name, "shared_memory")
    try:
        kill_leftovers(leader.pid)
        assert (SHM_DIR / names[0]).exists() and not (SHM_DIR / names[1]).exists()
        assert bytes(kept.buf[:4]) == b"\0\0\0\0"  # still readable here
    finally:
        kept.close()


# A leader holding a lock of multiprocessing's spawn context: a named semaphore in /dev/shm, which
# glibc maps under the temporary name it made it with, and which the group's resource tracker
# would unlink at the leader's exit, but not when the whole group is killed.
LOCK = """
import multiprocessing, time
lock = multiprocessing.get_context("spawn").Lock()
print(lock._semlock.name, flush=True)
time.sleep(120)
"""


def test_a_killed_groups_multiprocessing_semaphore_goes_with_it() -> None:
    leader = subprocess.Popen([sys.executable, "-c", LOCK], stdout=subprocess.PIPE, text=True,
                              start_new_session=True)
    assert leader.stdout is not None
    semaphore = SHM_DIR / ("sem." + leader.stdout.readline().strip().lstrip("/"))
    try:
        assert semaphore.exists()
        kill_leftovers(leader.pid)
        assert not semaphore.exists()
    finally:
        leader.kill()
        leader.wait()
        semaphore.unlink(missing_ok=True)
