"""What the parity tests of every model share: the largest absolute difference between our output and the oracle's."""

from __future__ import annotations

import numpy as np


def max_abs(a, b) -> float:
    """max |a - b| in float64 over arrays or tensors of the same shape (tensors are read from any device)."""

    def array(x) -> np.ndarray:
        return np.asarray(x.detach().cpu() if hasattr(x, "detach") else x, dtype=np.float64)

    a, b = array(a), array(b)
    assert a.shape == b.shape, (a.shape, b.shape)
    return float(np.abs(a - b).max())
