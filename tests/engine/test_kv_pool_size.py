"""The KV pool's size where no flag gives it: $TOKENMILL_KV_CACHE_GB (GiB) for every worker of a
host, else 1 GiB; `--kv-cache-blocks`/`--kv-cache-gb` win; a bad value is refused naming it, by the
engine and by `serve` before any worker starts; a vLLM worker gets the same default size."""
from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

import pytest

from tokenmill.engine.config import DEFAULT_KV_CACHE_GB, KV_CACHE_GB_ENV, EngineConfig
from tokenmill.engines.vllm.config import EventEndpoints, mapped_argv
from tokenmill.textgen.model_config import load_model_config

GIB = 2**30


def _blocks(model: Path, **overrides) -> int:
    config = EngineConfig(model=str(model), dtype="float32", **overrides)
    return config.kv_blocks(load_model_config(model))


def _block_bytes(model: Path) -> int:
    cfg = load_model_config(model)
    return 2 * cfg.num_layers * EngineConfig(model=str(model)).block_size * cfg.num_kv_heads * cfg.head_dim * 4


def test_the_variable_sizes_the_default_pool_and_flags_win(tiny_dense: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(KV_CACHE_GB_ENV, raising=False)
    assert _blocks(tiny_dense) == int(DEFAULT_KV_CACHE_GB * GIB) // _block_bytes(tiny_dense)
    monkeypatch.setenv(KV_CACHE_GB_ENV, "0.125")
    assert _blocks(tiny_dense) == GIB // 8 // _block_bytes(tiny_dense)
    assert _blocks(tiny_dense, kv_cache_gb=0.5) == GIB // 2 // _block_bytes(tiny_dense)
    assert _blocks(tiny_dense, num_kv_blocks=7) == 7


@pytest.mark.parametrize("value", ["0", "-1", "lots", "nan", "inf", ""])
def test_a_bad_value_is_refused_naming_the_variable(value: str, tiny_dense: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(KV_CACHE_GB_ENV, value)
    with pytest.raises(ValueError, match=KV_CACHE_GB_ENV):
        EngineConfig(model=str(tiny_dense))
    assert EngineConfig(model=str(tiny_dense), num_kv_blocks=8).kv_blocks(load_model_config(tiny_dense)) == 8


def test_serve_exits_2_naming_it(tiny_dense: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(KV_CACHE_GB_ENV, "half")
    run = subprocess.run([sys.executable, "-m", "tokenmill.cli", "serve", "--model", str(tiny_dense)],
                         capture_output=True, text=True, timeout=60)
    assert run.returncode == 2
    assert run.stderr.strip().splitlines()[-1].startswith("error: ") and KV_CACHE_GB_ENV in run.stderr


def test_a_vllm_worker_gets_the_same_default(tiny_dense: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)
    monkeypatch.setattr("tokenmill.engines.vllm.config._has_cuda", lambda: False)  # as on a CPU host
    monkeypatch.setenv(KV_CACHE_GB_ENV, "0.25")
    args = argparse.Namespace(model=str(tiny_dense), dtype="float32", block_size=32, seed=0, max_model_len=None,
                              kv_cache_blocks=None, kv_cache_gb=None, no_prefix_caching=False, role="agg")

    def kv_bytes() -> str:
        argv = mapped_argv(args, EventEndpoints.in_dir(tmp_path))
        return argv[argv.index("--kv-cache-memory-bytes") + 1]

    assert kv_bytes() == str(GIB // 4)  # no GPU: tokenmill sizes vLLM's CPU pool
    args.kv_cache_gb = 2.0
    assert kv_bytes() == str(2 * GIB)
