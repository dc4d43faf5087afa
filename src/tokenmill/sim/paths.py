"""Where the shared (never copied into the repo) data lives."""
from __future__ import annotations

import os
from pathlib import Path

SHARED_ENV = "TOKENMILL_SHARED_DATA"
SILICON_RELATIVE = Path("silicon/silicon_measured.csv")


def shared_data_dir(explicit: str | Path | None = None) -> Path:
    """`--data`, then $TOKENMILL_SHARED_DATA, then `<repo>/../shared/data`."""
    if explicit:
        return Path(explicit).expanduser()
    if os.environ.get(SHARED_ENV):
        return Path(os.environ[SHARED_ENV]).expanduser()
    repo = Path(__file__).resolve().parents[3]  # src/tokenmill/sim/paths.py -> repo root
    return repo.parent / "shared" / "data"


def silicon_csv(explicit: str | Path | None = None) -> Path:
    """The measured-deployments CSV; `explicit` may name the CSV itself or the data directory."""
    base = shared_data_dir(explicit)
    path = base if base.suffix == ".csv" else base / SILICON_RELATIVE
    if not path.exists():
        raise ValueError(f"silicon data: {path} not found (use --data or ${SHARED_ENV})")
    return path
