"""A run's sockets stay in its directory when their addresses fit, and move to a short one when not."""
from __future__ import annotations

import shutil
import socket
from pathlib import Path

from tokenmill.runtime.unix_sockets import NAME_ROOM, SUN_PATH_MAX, socket_dir


def test_a_short_run_directory_keeps_its_sockets(tmp_path: Path) -> None:
    short = Path("/tmp") if len(str(tmp_path)) + 1 + NAME_ROOM > SUN_PATH_MAX else tmp_path
    assert socket_dir(short) == short


def test_a_deep_run_directory_gets_a_short_socket_directory_a_long_name_binds_in(tmp_path: Path) -> None:
    deep = tmp_path / ("d" * 80)
    deep.mkdir()
    sockets = socket_dir(deep)
    try:
        assert sockets != deep and sockets.is_dir()
        path = sockets / ("w" * (NAME_ROOM - len("-events.sock")) + "-events.sock")
        with socket.socket(socket.AF_UNIX) as sock:
            sock.bind(str(path))  # would raise OSError if the address did not fit
        assert path.is_socket()
    finally:
        shutil.rmtree(sockets)
