"""The positional encodings' numbers, shared by every backend.

The sinusoidal table and the rotary frequencies are computed once in float64 with numpy; each
backend casts them and keeps them as non-trainable buffers or constants.
"""

from __future__ import annotations

import numpy as np

__all__ = ["rotary_angle_dtype", "rotary_frequencies", "sinusoid_table"]


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


def rotary_frequencies(num_hiddens: int, theta: float) -> np.ndarray:
    """The angle per position of each pair of features, theta^(-2i / num_hiddens) for
    i = 0, ..., num_hiddens / 2 - 1, of shape (num_hiddens / 2,), in float64."""
    return 1.0 / np.power(float(theta), np.arange(0, num_hiddens, 2) / num_hiddens)


def rotary_angle_dtype(dtype: str) -> str:
    """The dtype rotary angles (position x frequency) are computed in: float64 for float64
    layers, else float32, as Hugging Face and Keras compute them; cosines and sines are then
    cast to the layer's dtype."""
    return "float64" if dtype == "float64" else "float32"
