"""What this host's CPU computes natively, from the flags /proc/cpuinfo lists (Linux x86 and
Arm; elsewhere only fp32 is taken as native).

    computes_natively("bfloat16")   # avx512_bf16 or amx_bf16 (x86), bf16 (Arm)
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import cache
from pathlib import Path

# a dtype -> any of these flags means the CPU multiplies it without converting to fp32 first
NATIVE_FLAGS: dict[str, tuple[str, ...]] = {
    "float32": (),
    "bfloat16": ("avx512_bf16", "amx_bf16", "bf16"),
    "float16": ("avx512_fp16", "amx_fp16", "fphp"),
}


@cache
def cpu_flags() -> frozenset[str]:
    """The first processor's flags (x86 `flags`, Arm `Features`); empty when unreadable."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return frozenset()
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("flags", "Features"):
            return frozenset(value.split())
    return frozenset()


def computes_natively(dtype: str, flags: frozenset[str] | None = None) -> bool:
    """fp32 always; bf16 and fp16 where the CPU has instructions for them."""
    if dtype == "float32":
        return True
    have = cpu_flags() if flags is None else flags
    return any(flag in have for flag in NATIVE_FLAGS.get(dtype, ()))


@dataclass(slots=True, frozen=True)
class DtypeChoice:
    dtype: str
    reason: str | None = None  # why `auto` is not the checkpoint's dtype


def choose_auto_dtype(checkpoint: str, fp32_weight_bytes: int, memory_bytes: int | None,
                      flags: frozenset[str] | None = None) -> DtypeChoice:
    """`--dtype auto` for the torch runner on this CPU: the checkpoint's dtype, or fp32 where the
    CPU has no instructions for it (bf16 on an AVX2-only CPU is converted to fp32 inside every
    matmul, and measured slower than fp32 itself) and the fp32 weights take at most a quarter of
    the host's memory (room for a few workers). The host's total, not what is free now, so that
    every process of a worker decides alike."""
    if computes_natively(checkpoint, flags):
        return DtypeChoice(checkpoint)
    if memory_bytes is None or fp32_weight_bytes > memory_bytes // 4:
        return DtypeChoice(checkpoint)
    return DtypeChoice("float32", f"the checkpoint is {checkpoint}, which this CPU does not compute natively; "
                                  f"float32 computes faster here ({fp32_weight_bytes / 2**30:.1f} GiB of weights)")


def memory_bytes() -> int | None:
    """MemTotal from /proc/meminfo; None when unreadable."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None
