"""Parallel layouts as numpy arrays, so one call evaluates many layouts at once.

Convention (TensorRT-LLM's): a pipeline stage has `tp * dp` GPUs. Attention runs `dp` replicas
(attention data parallelism), each split `tp` ways by heads. MoE layers spread over all `tp * dp`
GPUs of the stage as `ep` expert groups of `tp * dp / ep` tensor-parallel slices.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from tokenmill.sim.models import ModelConfig


@dataclass(slots=True, frozen=True)
class Parallel:
    tp: np.ndarray
    pp: np.ndarray
    ep: np.ndarray
    dp: np.ndarray

    @classmethod
    def of(cls, tp: object = 1, pp: object = 1, ep: object = 1, dp: object = 1) -> "Parallel":
        arrays = [np.asarray(v, dtype=np.int64) for v in (tp, pp, ep, dp)]
        for name, arr in zip(("tp", "pp", "ep", "dp"), arrays):
            if np.any(arr < 1):
                raise ValueError(f"parallelism: field {name} must be >= 1")
        return cls(*arrays)

    @property
    def stage_gpus(self) -> np.ndarray:
        return self.tp * self.dp

    @property
    def gpus(self) -> np.ndarray:
        return self.tp * self.dp * self.pp

    @property
    def moe_tp(self) -> np.ndarray:
        return np.maximum(self.stage_gpus // self.ep, 1)

    def valid_mask(self, model: ModelConfig) -> np.ndarray:
        """Layouts the model can actually be split into."""
        ok = (self.stage_gpus % self.ep == 0) & (model.layers >= self.pp)
        ok &= model.heads % self.tp == 0
        if model.is_moe:
            ok &= model.experts % self.ep == 0
        else:
            ok &= self.ep == 1
        return ok

    def check(self, model: ModelConfig) -> None:
        """Raise ValueError naming the field when a single layout is impossible."""
        if np.any(self.stage_gpus % self.ep != 0):
            raise ValueError("parallelism: field ep must divide tp * dp")
        if np.any(model.heads % self.tp != 0):
            raise ValueError(f"parallelism: field tp must divide the {model.heads} attention heads")
        if model.is_moe and np.any(model.experts % self.ep != 0):
            raise ValueError(f"parallelism: field ep must divide the {model.experts} experts")
        if not model.is_moe and np.any(self.ep != 1):
            raise ValueError("parallelism: field ep must be 1 for a dense model")
        if np.any(self.pp > model.layers):
            raise ValueError("parallelism: field pp exceeds the number of layers")
