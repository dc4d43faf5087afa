"""tokenmill.sim: hardware and model catalogs, step-time model, deployment search."""
from __future__ import annotations

from tokenmill.sim.hardware import GpuSpec, get_gpu
from tokenmill.sim.local_calibrate import StepCoefficients, step_coefficients
from tokenmill.sim.models import ModelConfig, get_model

__all__ = ["GpuSpec", "ModelConfig", "StepCoefficients", "get_gpu", "get_model", "step_coefficients"]
