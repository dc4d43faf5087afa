"""GPU catalog: peak rates, memory, links and efficiency curves per accelerator.

Built-in entries come from `data/gpus.json` (each number with its source). A `cpu-local`
entry, written by `tokenmill sim calibrate`, is loaded from the user's cache when present.
"""
from __future__ import annotations

import dataclasses
import json
import logging
import os
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path

import numpy as np

log = logging.getLogger(__name__)
CPU_LOCAL_NAME = "cpu-local"
DEFAULT_CPU_LOCAL_PATH = Path("~/.cache/tokenmill/cpu-local.json")
# A CPU box has no datasheet board power: energy figures for `cpu-local` use this share of a
# 2-socket-class server (CPUs + DRAM under load). An assumption, stated in the entry's sources; the
# user may edit `power_w` in cpu-local.json. Files written before the field existed get it too.
CPU_LOCAL_DEFAULT_POWER_W = 200.0
CPU_LOCAL_POWER_SOURCE = ("assumption: 200 W, the share of a 2-socket-class server (CPUs + DRAM under load); "
                          "not measured, edit power_w in this file to your machine's figure")
# Aliases used by the silicon CSV and by users.
GPU_ALIASES: dict[str, str] = {
    "h100_sxm": "h100", "h200_sxm": "h200", "b200_sxm": "b200", "b300_sxm": "b300",
    "gb200_nvl72": "gb200", "gb300_nvl72": "gb300",
}


@dataclass(slots=True, frozen=True)
class GpuSpec:
    """One accelerator. Rates are per GPU, dense, per direction for links."""

    name: str
    display_name: str
    bf16_flops: float
    fp8_flops: float
    fp4_flops: float
    fp32_flops: float
    hbm_gb: float
    hbm_bw: float
    nvlink_bw: float
    domain_size: int
    scaleout_bw: float
    kernel_latency_s: float
    collective_latency_s: float
    a2a_latency_s: float
    gemm_eff_max: float
    gemm_m_half: float
    attn_eff: float
    mem_eff: float
    link_eff: float
    power_w: float  # board power / TDP per GPU (GB200/GB300: the per-GPU share), for energy figures
    sources: dict[str, str] = field(default_factory=dict, compare=False, hash=False)

    def __post_init__(self) -> None:
        for name in ("bf16_flops", "fp8_flops", "fp4_flops", "hbm_gb", "hbm_bw", "nvlink_bw", "scaleout_bw", "power_w"):
            if not getattr(self, name) > 0:  # `not >` also rejects NaN
                raise ValueError(f"gpu {self.name}: field {name} must be > 0")
        if self.domain_size < 1:
            raise ValueError(f"gpu {self.name}: field domain_size must be >= 1")
        for name in ("gemm_eff_max", "attn_eff", "mem_eff", "link_eff"):
            if not 0 < getattr(self, name) <= 1:
                raise ValueError(f"gpu {self.name}: field {name} must be in (0, 1]")

    def peak_flops(self, compute: str) -> float:
        """Peak dense FLOP/s for a compute precision: bf16, fp8, fp4 or fp32."""
        table = {"bf16": self.bf16_flops, "fp8": self.fp8_flops, "fp4": self.fp4_flops, "fp32": self.fp32_flops}
        if compute not in table:
            raise ValueError(f"compute precision {compute!r} not one of {sorted(table)}")
        return table[compute]

    def gemm_efficiency(self, rows: np.ndarray | float) -> np.ndarray:
        """Achievable fraction of peak for a GEMM with `rows` token rows (saturating curve)."""
        m = np.maximum(np.asarray(rows, dtype=np.float64), 1.0)
        return self.gemm_eff_max * m / (m + self.gemm_m_half)

    def with_overrides(self, **changes: float) -> "GpuSpec":
        return dataclasses.replace(self, **changes)


def _spec_from_dict(name: str, entry: dict) -> GpuSpec:
    """Build a spec, naming unknown or missing fields (a bad catalog or calibration file is user input)."""
    fields = [f for f in dataclasses.fields(GpuSpec) if f.name != "name"]
    unknown = set(entry) - {f.name for f in fields}
    if unknown:
        raise ValueError(f"gpu {name}: unknown fields {sorted(unknown)}")
    required = {f.name for f in fields if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING}
    missing = required - set(entry)
    if missing:
        raise ValueError(f"gpu {name}: missing fields {sorted(missing)}")
    return GpuSpec(name=name, **entry)


def builtin_gpus() -> dict[str, GpuSpec]:
    text = resources.files("tokenmill.sim").joinpath("data/gpus.json").read_text()
    raw = json.loads(text)
    return {name: _spec_from_dict(name, entry) for name, entry in raw.items() if not name.startswith("_")}


def cpu_local_path() -> Path:
    return Path(os.environ.get("TOKENMILL_CPU_LOCAL", str(DEFAULT_CPU_LOCAL_PATH))).expanduser()


def load_gpu_file(path: Path) -> GpuSpec:
    """Read a calibration file (`cpu-local`); files written before `power_w` existed get the stated default."""
    entry = json.loads(Path(path).read_text())
    name = entry.pop("name", CPU_LOCAL_NAME)
    entry.pop("tuning", None)  # the engine's fitted overheads: `cpu_local_tuning`
    if "power_w" not in entry:
        log.warning("gpu %s: %s has no power_w; using %.0f W (an assumption: edit the file or rerun "
                    "`tokenmill sim calibrate`)", name, path, CPU_LOCAL_DEFAULT_POWER_W)
        entry["power_w"] = CPU_LOCAL_DEFAULT_POWER_W
        entry["sources"] = {**entry.get("sources", {}), "power_w": f"{CPU_LOCAL_POWER_SOURCE} (defaulted: the file had none)"}
    return _spec_from_dict(name, entry)


def cpu_local_tuning(path: Path | None = None) -> dict[str, float]:
    """Step-time tuning fields `sim calibrate --model` fitted to tokenmill's engine here ({} if none)."""
    try:
        fields = json.loads((path or cpu_local_path()).read_text()).get("tuning", {})
    except (OSError, ValueError):
        return {}
    return fields if isinstance(fields, dict) else {}


def get_gpu(name: str, cpu_local_file: Path | None = None) -> GpuSpec:
    """Look a GPU up by catalog name or alias; `cpu-local` reads the calibration file."""
    key = GPU_ALIASES.get(name.lower(), name.lower())
    if key == CPU_LOCAL_NAME:
        path = cpu_local_file or cpu_local_path()
        if not path.exists():
            raise ValueError(f"gpu cpu-local: no calibration at {path}; run `tokenmill sim calibrate` first")
        return load_gpu_file(path)
    catalog = builtin_gpus()
    if key not in catalog:
        raise ValueError(f"gpu {name!r} not in catalog {sorted(catalog) + [CPU_LOCAL_NAME]}")
    return catalog[key]
