"""Enumerate parallel layouts and batch grids for the deployment search."""
from __future__ import annotations

import itertools

import numpy as np

from tokenmill.sim.models import ModelConfig
from tokenmill.sim.parallel import Parallel

POWERS_OF_TWO = (1, 2, 4, 8, 16, 32, 64, 128)


def enumerate_layouts(model: ModelConfig, max_gpus: int, max_pp: int = 8) -> Parallel:
    """Every valid (tp, pp, ep, dp) with power-of-two sizes that fits in `max_gpus` GPUs."""
    combos = []
    for tp, dp, pp in itertools.product(POWERS_OF_TWO, POWERS_OF_TWO, POWERS_OF_TWO):
        if tp * dp * pp > max_gpus or pp > max_pp or (dp > 1 and not model.is_moe):
            continue  # attention-DP only pays off with MoE; dense replicas are separate instances
        eps = [e for e in POWERS_OF_TWO if e <= tp * dp] if model.is_moe else [1]
        combos.extend((tp, pp, ep, dp) for ep in eps)
    if not combos:
        raise ValueError(f"search: field gpus={max_gpus} admits no layout")
    arr = np.array(combos, dtype=np.int64)
    par = Parallel.of(arr[:, 0], arr[:, 1], arr[:, 2], arr[:, 3])
    keep = par.valid_mask(model)
    return Parallel.of(par.tp[keep], par.pp[keep], par.ep[keep], par.dp[keep])


def batch_grid(max_batch: int = 8192, per_octave: int = 4) -> np.ndarray:
    """Geometric batch sizes 1 .. max_batch, `per_octave` per doubling, rounded to integers."""
    octaves = np.log2(max_batch)
    values = np.round(2.0 ** np.linspace(0, octaves, int(octaves * per_octave) + 1))
    return np.unique(values)


def cross(par: Parallel, values: np.ndarray) -> tuple[Parallel, np.ndarray]:
    """Every layout paired with every value, flattened."""
    n, k = par.tp.size, values.size
    rep = lambda a: np.repeat(a, k)  # noqa: E731 - local shorthand
    return Parallel.of(rep(par.tp), rep(par.pp), rep(par.ep), rep(par.dp)), np.tile(values, n)
