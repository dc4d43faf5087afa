"""Real data shipped with tokenmill: measured deployments, request traces and code to edit.

A user's clone has nothing beside it, so what the simulator, the benchmarks and the tests
read lives here, inside the package (SOURCES.md gives each file's origin and license).
`data_dir` resolves where to read from: an explicit `--data`, then $TOKENMILL_SHARED_DATA (a
directory laid out like this one: `silicon/`, `traces/`), then the shipped copy.
"""
from __future__ import annotations

import os
from pathlib import Path

DATA_ENV = "TOKENMILL_SHARED_DATA"  # a directory laid out like `../shared/data`
SHIPPED = Path(__file__).resolve().parent
SILICON = Path("silicon/silicon_measured.csv")
MOONCAKE_TRACE = Path("traces/mooncake_synthetic_trace.jsonl")
AZURE_CONV_TRACE = Path("traces/AzureLLMInferenceTrace_conv_2023.csv")
AZURE_CODE_TRACE = Path("traces/AzureLLMInferenceTrace_code_2023.csv")
CODE_FUNCTIONS = Path("code/tokenmill_functions.jsonl")  # shipped only: not in the shared data


def data_dir(explicit: str | Path | None = None) -> Path:
    """`explicit`, then $TOKENMILL_SHARED_DATA, then the copy shipped in the package."""
    if explicit:
        return Path(explicit).expanduser()
    if os.environ.get(DATA_ENV):
        return Path(os.environ[DATA_ENV]).expanduser()
    return SHIPPED


def data_file(relative: Path, explicit: str | Path | None = None) -> Path:
    """One data file; `explicit` may name the file itself or a data directory.

    Raises ValueError (naming the path and how to override it) when the file is missing.
    """
    base = data_dir(explicit)
    path = base if base.is_file() else base / relative
    if not path.is_file():
        raise ValueError(f"data file {path} not found (use --data or ${DATA_ENV})")
    return path
