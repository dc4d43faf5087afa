"""Bad disaggregation flags are refused up front, naming the flag, before any worker starts."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest


def tokenmill(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "tokenmill.cli", *argv], capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("flags,message", [
    (("--prefill", "1"), "--prefill and --decode go together"),
    (("--prefill", "1", "--decode", "1", "--workers", "3"), "--workers is for aggregated serving"),
    (("--prefill", "1", "--decode", "1", "--disagg-threshold", "-1"), "--disagg-threshold"),
    (("--prefill", "1", "--decode", "1", "--prefill-queue-limit", "0"), "--prefill-queue-limit"),
    (("--prefill", "1", "--decode", "1", "--local-prefill-limit", "-1"), "--local-prefill-limit"),
    (("--event-plane", "nats://nohost"), "--event-plane: 'nohost' is not host:port"),
    (("--events-stale-after-s", "0"), "--events-stale-after-s must be positive"),
])
def test_serve_refuses_bad_topologies(tiny_dense: Path, flags: tuple[str, ...], message: str) -> None:
    result = tokenmill("serve", "--model", str(tiny_dense), *flags)
    assert result.returncode == 2 and message in result.stderr


@pytest.mark.parametrize("flags,message", [
    (("--kv-transfer-backends", "rdma"), "--kv-transfer-backends"),
    (("--transfer-faults", "explode"), "--transfer-faults"),
    (("--kv-pull-timeout-s", "0"), "--kv-pull-timeout-s"),
    (("--advertise-host", "10.0.0.2", "--address", "ipc:///tmp/x.sock"), "--advertise-host needs a tcp:// --address"),
    (("--advertise-host", "10.0.0.2", "--events-address", "ipc:///tmp/e.sock"), "--events-address"),
    (("--advertise-host", "tcp://10.0.0.2:5"), "--advertise-host: a host name or IP"),
    (("--discovery-ttl-s", "0.5", "--discovery", "etcd://127.0.0.1:1"), "--discovery-ttl-s"),
    (("--event-plane", "nats://127.0.0.1:1", "--events-address", "ipc:///tmp/e.sock"), "choose one"),
    (("--event-plane", "kafka://127.0.0.1:1"), "--event-plane must be nats://"),
])
def test_worker_refuses_bad_transfer_flags(tiny_dense: Path, tmp_path: Path, flags: tuple[str, ...],
                                           message: str) -> None:
    result = tokenmill("worker", "--model", str(tiny_dense), "--role", "decode",
                       "--discovery", f"file:{tmp_path}", *flags)
    assert result.returncode == 2 and message in result.stderr
