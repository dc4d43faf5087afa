"""A fitted trace as index-aligned arrays: what trace readers produce and block chains hash."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(slots=True)
class Rows:
    """A fitted trace, index-aligned arrays in file order.

    Row r's hash ids are `hid_flat[hid_start[r] : hid_start[r] + hid_count[r]]`, kept only as
    far as the prompt reaches (`ceil(input / tokens_per_hash_block)`); `hid_flat` always has
    one more (sentinel) entry so that masked gathers never index an empty array.
    """
    arrival_s: np.ndarray      # float64, from the earliest row, time-scaled
    input_tokens: np.ndarray   # int64
    output_tokens: np.ndarray  # int64
    hid_start: np.ndarray      # int64
    hid_count: np.ndarray      # int64
    hid_flat: np.ndarray       # uint64

    @classmethod
    def unshared(cls, arrival_s: np.ndarray, inputs: np.ndarray, outputs: np.ndarray) -> Rows:
        """Rows without hash ids: every prompt is request-unique."""
        zeros = np.zeros(len(arrival_s), dtype=np.int64)
        return cls(np.asarray(arrival_s, dtype=np.float64), np.asarray(inputs, dtype=np.int64),
                   np.asarray(outputs, dtype=np.int64), zeros, zeros.copy(),
                   np.zeros(1, dtype=np.uint64))
