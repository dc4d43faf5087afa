"""Shared fixtures: small checkpoints written once per test session."""
from __future__ import annotations

from pathlib import Path

import pytest

from tokenmill.engine.make_model import write_model


@pytest.fixture(scope="session")
def model_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("models")
    return {preset: write_model(preset, root / preset, seed=0)
            for preset in ("tiny-dense", "tiny-moe", "tiny-llama")}


@pytest.fixture(scope="session")
def tiny_dense(model_dirs: dict[str, Path]) -> Path:
    return model_dirs["tiny-dense"]


@pytest.fixture(scope="session")
def tiny_moe(model_dirs: dict[str, Path]) -> Path:
    return model_dirs["tiny-moe"]
