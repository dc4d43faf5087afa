import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tokenmill.runtime.discovery import FileDiscovery, MemoryDiscovery, WorkerInfo, discovery_from_url


def _info(worker_id: str, pid: int = 0) -> WorkerInfo:
    return WorkerInfo(worker_id, f"ipc:///tmp/{worker_id}", pid=pid or os.getpid(), host=os.uname().nodename)


def test_memory_discovery_join_heartbeat_leave() -> None:
    d = MemoryDiscovery(ttl_s=0.2)
    d.register(_info("a"))
    d.heartbeat("a", {"kv_usage": 0.5})
    assert [w.metadata["kv_usage"] for w in d.workers()] == [0.5]
    time.sleep(0.3)
    assert d.workers() == []  # no heartbeat within the TTL
    d.heartbeat("a")
    assert [w.worker_id for w in d.workers()] == ["a"]
    d.unregister("a")
    assert d.workers() == []


def test_file_discovery_is_shared_through_the_directory(tmp_path: Path) -> None:
    writer, reader = FileDiscovery(tmp_path, ttl_s=0.3), FileDiscovery(tmp_path, ttl_s=0.3)
    writer.register(_info("w0"))
    writer.heartbeat("w0", {"num_waiting": 3})
    (seen,) = reader.workers()
    assert seen.worker_id == "w0" and seen.metadata["num_waiting"] == 3
    time.sleep(0.4)
    assert reader.workers() == []
    writer.heartbeat("w0")
    assert len(reader.workers()) == 1
    writer.unregister("w0")
    assert reader.workers() == []
    assert not list(tmp_path.glob(".*.tmp"))


def test_file_discovery_drops_a_dead_pid_at_once(tmp_path: Path) -> None:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    FileDiscovery(tmp_path).register(_info("dead", pid=child.pid))
    assert FileDiscovery(tmp_path).workers() == []


def test_discovery_url_errors_name_the_flag() -> None:
    assert isinstance(discovery_from_url("memory:"), MemoryDiscovery)
    with pytest.raises(ValueError, match="--discovery"):
        discovery_from_url("etcd://nope")  # no port
