"""GPU power in the catalog (for energy figures): every entry has one, with its source; old cpu-local files load."""
import json
import logging

import pytest

from tokenmill.cli import main
from tokenmill.sim.hardware import CPU_LOCAL_DEFAULT_POWER_W, builtin_gpus, get_gpu, load_gpu_file

# NVIDIA's figures per GPU (GB200/GB300: the per-GPU share of the superchip's GPU power).
EXPECTED_W = {"h100": 700, "h200": 700, "b200": 1000, "b300": 1100, "gb200": 1200, "gb300": 1400}


def test_every_builtin_gpu_has_power_with_a_source():
    gpus = builtin_gpus()
    assert set(EXPECTED_W) <= set(gpus)
    for name, spec in gpus.items():
        assert spec.power_w > 0, name
        assert spec.sources.get("power_w", "").strip(), f"{name} lacks a power_w source"
        if name in EXPECTED_W:
            assert spec.power_w == EXPECTED_W[name], name
            assert f"{EXPECTED_W[name]:,} W" in spec.sources["power_w"], spec.sources["power_w"]


@pytest.mark.parametrize("bad", [0, -5, float("nan")])
def test_power_must_be_positive(bad):
    with pytest.raises(ValueError, match="power_w"):
        get_gpu("h100").with_overrides(power_w=bad)


def _old_cpu_local(path, **extra):
    """A cpu-local file as `sim calibrate` wrote it before power_w existed."""
    entry = {"name": "cpu-local", "display_name": "this machine (CPU)", "bf16_flops": 1e11, "fp8_flops": 1e11,
             "fp4_flops": 1e11, "fp32_flops": 2e11, "hbm_gb": 64.0, "hbm_bw": 2e10, "nvlink_bw": 5e9, "domain_size": 1,
             "scaleout_bw": 1.25e9, "kernel_latency_s": 5e-6, "collective_latency_s": 50e-6, "a2a_latency_s": 50e-6,
             "gemm_eff_max": 1.0, "gemm_m_half": 1.0, "attn_eff": 0.5, "mem_eff": 1.0, "link_eff": 1.0,
             "sources": {"fp32_flops": "measured"}, **extra}
    path.write_text(json.dumps(entry))
    return path


def test_cpu_local_file_without_power_still_loads_with_a_warning(tmp_path, caplog):
    path = _old_cpu_local(tmp_path / "cpu-local.json")
    with caplog.at_level(logging.WARNING, logger="tokenmill.sim.hardware"):
        gpu = get_gpu("cpu-local", cpu_local_file=path)
    assert gpu.power_w == CPU_LOCAL_DEFAULT_POWER_W
    assert "assumption" in gpu.sources["power_w"] and gpu.sources["fp32_flops"] == "measured"
    assert any("power_w" in r.getMessage() for r in caplog.records)


def test_cpu_local_power_set_by_the_user_is_used(tmp_path, caplog):
    path = _old_cpu_local(tmp_path / "cpu-local.json", power_w=350.0)
    with caplog.at_level(logging.WARNING, logger="tokenmill.sim.hardware"):
        assert load_gpu_file(path).power_w == 350.0
    assert not caplog.records


def test_calibrate_writes_power_as_a_stated_assumption_and_keeps_a_user_edit(tmp_path):
    path = tmp_path / "cpu.json"
    assert main(["sim", "calibrate", "--quick", "--out", str(path)]) == 0
    entry = json.loads(path.read_text())
    assert entry["power_w"] == CPU_LOCAL_DEFAULT_POWER_W and "assumption" in entry["sources"]["power_w"]
    entry["power_w"] = 450.0  # the user edits the figure for their machine, then recalibrates
    path.write_text(json.dumps(entry))
    assert main(["sim", "calibrate", "--quick", "--out", str(path)]) == 0
    again = json.loads(path.read_text())
    assert again["power_w"] == 450.0 and "user" in again["sources"]["power_w"]
    assert get_gpu("cpu-local", cpu_local_file=path).power_w == 450.0
