"""`--dtype auto` on a CPU: the checkpoint's dtype where the CPU computes it, fp32 where it does not
(bf16 on AVX2) and the fp32 weights fit, and the reason said."""
from __future__ import annotations

import dataclasses
from pathlib import Path

from tokenmill.engine.config import EngineConfig
from tokenmill.engine.cpu_features import choose_auto_dtype, computes_natively, cpu_flags, memory_bytes
from tokenmill.textgen.model_config import load_model_config

AVX2 = frozenset({"avx", "avx2", "fma", "f16c"})
SAPPHIRE_RAPIDS = AVX2 | {"avx512f", "avx512_bf16", "amx_bf16", "avx512_fp16"}
GIB = 2**30


def test_native_dtypes_follow_the_flags() -> None:
    assert computes_natively("float32", frozenset())
    assert not computes_natively("bfloat16", AVX2) and not computes_natively("float16", AVX2)
    assert computes_natively("bfloat16", SAPPHIRE_RAPIDS) and computes_natively("float16", SAPPHIRE_RAPIDS)
    assert computes_natively("bfloat16", frozenset({"fp", "asimd", "bf16"}))  # Arm's name for it


def test_auto_widens_bf16_to_fp32_on_avx2_when_it_fits() -> None:
    widened = choose_auto_dtype("bfloat16", 1 * GIB, 24 * GIB, AVX2)
    assert widened.dtype == "float32" and "does not compute natively" in (widened.reason or "")
    assert choose_auto_dtype("bfloat16", 1 * GIB, 24 * GIB, SAPPHIRE_RAPIDS).dtype == "bfloat16"
    too_big = choose_auto_dtype("bfloat16", 7 * GIB, 24 * GIB, AVX2)  # over a quarter of memory
    assert too_big.dtype == "bfloat16" and too_big.reason is None
    assert choose_auto_dtype("bfloat16", 1 * GIB, None, AVX2).dtype == "bfloat16"  # memory unknown


def test_the_engine_config_applies_the_rule_to_the_torch_runner_only(tiny_dense: Path) -> None:
    bf16 = dataclasses.replace(load_model_config(str(tiny_dense)), checkpoint_dtype="bfloat16")
    here = "bfloat16" if computes_natively("bfloat16") else "float32"
    assert memory_bytes() is not None and cpu_flags()  # this host's /proc is readable
    assert EngineConfig(model=str(tiny_dense)).dtype_name(bf16) == here
    assert EngineConfig(model=str(tiny_dense), runner="mock").dtype_name(bf16) == "bfloat16"
    assert EngineConfig(model=str(tiny_dense), dtype="bfloat16").dtype_name(bf16) == "bfloat16"
    fp32 = load_model_config(str(tiny_dense))
    assert EngineConfig(model=str(tiny_dense)).dtype_name(fp32) == "float32"
