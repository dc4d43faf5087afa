"""The raw baselines `tokenmill bench transfer` sets the agents' figures against.

`memcpy_gbps`: one numpy copy in this process. `raw_socket_gbps`: a child process `sendall`s the
bytes per 8-byte request into a blocking `recv_into` loop here, over 127.0.0.1 or, with `netns`,
from inside that network namespace (bound to `host`, one of its addresses) across its veth pair.
"""
from __future__ import annotations

import multiprocessing
import socket
import statistics
import struct
import time
from collections.abc import Callable
from typing import Any

LENGTH = struct.Struct("<Q")
LOOPBACK = "127.0.0.1"


def memcpy_gbps(nbytes: int, repeats: int) -> float:
    import numpy as np

    src, dst = np.ones(nbytes, dtype=np.uint8), np.zeros(nbytes, dtype=np.uint8)
    np.copyto(dst, src)  # warm: both sides faulted in
    return nbytes / median_seconds(lambda: np.copyto(dst, src), repeats) / 1e9


def raw_socket_gbps(nbytes: int, repeats: int, netns: str | None = None, host: str = LOOPBACK) -> float:
    """Plain sockets, another process: it `sendall`s `nbytes` per 8-byte request."""
    import numpy as np

    context = multiprocessing.get_context("spawn")
    ports = context.Queue()
    sender = context.Process(target=_raw_sender, args=(ports, nbytes, netns, host), daemon=True)
    sender.start()
    try:
        port = ports.get(timeout=60)
        if isinstance(port, str):
            raise RuntimeError(f"raw socket sender: {port}")
        with socket.create_connection((host, port)) as sock:
            view = memoryview(np.zeros(nbytes, dtype=np.uint8)).cast("B")

            def one() -> None:
                sock.sendall(LENGTH.pack(nbytes))
                got = 0
                while got < nbytes:
                    got += sock.recv_into(view[got:])

            one()  # warm
            return nbytes / median_seconds(one, repeats) / 1e9
    finally:
        sender.join(30)


def _raw_sender(ports: Any, nbytes: int, netns: str | None, host: str) -> None:
    try:
        if netns is not None:
            from tokenmill.runtime.netns import enter_netns

            enter_netns(netns)
        server = socket.create_server((host, 0))
    except OSError as exc:  # the parent would otherwise wait out its timeout for a port
        ports.put(f"{type(exc).__name__}: {exc}")
        return
    payload = memoryview(bytearray(b"\x01" * nbytes))
    with server:
        ports.put(server.getsockname()[1])
        conn, _ = server.accept()
        with conn:
            while len(request := conn.recv(LENGTH.size)) == LENGTH.size:
                conn.sendall(payload[:LENGTH.unpack(request)[0]])


def median_seconds(action: Callable[[], object], repeats: int) -> float:
    samples = []
    for _ in range(repeats):
        started = time.perf_counter()
        action()
        samples.append(time.perf_counter() - started)
    return statistics.median(samples)
