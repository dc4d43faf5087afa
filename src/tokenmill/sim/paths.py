"""Where the simulator reads its measured-deployment table (see `tokenmill.datasets`)."""
from __future__ import annotations

from pathlib import Path

from tokenmill.datasets import SILICON, data_file


def silicon_csv(explicit: str | Path | None = None) -> Path:
    """The measured-deployments CSV; `explicit` may name the CSV itself or a data directory."""
    return data_file(SILICON, explicit)
