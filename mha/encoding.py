"""The sinusoidal positional-encoding table, shared by every backend.

Computed once in float64 with numpy; each backend casts it to the layer's dtype and keeps it
as a non-trainable buffer or constant.
"""

from __future__ import annotations

import numpy as np

__all__ = ["sinusoid_table"]


def sinusoid_table(max_len: int, num_hiddens: int) -> np.ndarray:
    """P of shape (1, max_len, num_hiddens), in float64.

    P[0, i, 2j] = sin(i / 10000^(2j / num_hiddens)) and
    P[0, i, 2j + 1] = cos(i / 10000^(2j / num_hiddens)). An odd num_hiddens works: its last
    column is a sine.
    """
    # Shape of positions: (max_len, 1); shape of angles: (max_len, ceil(num_hiddens / 2))
    positions = np.arange(max_len, dtype=np.float64).reshape(-1, 1)
    angles = positions / np.power(10000.0, np.arange(0, num_hiddens, 2) / num_hiddens)
    P = np.zeros((1, max_len, num_hiddens))
    P[0, :, 0::2] = np.sin(angles)
    P[0, :, 1::2] = np.cos(angles[:, : num_hiddens // 2])
    return P
