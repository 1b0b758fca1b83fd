"""The masks of the masked-key checks, shared by tests/test_masked_keys.py and the GPU lane
(tests/gpu_lane.py, which runs without pytest): key LAST of K holds the poison, and each mask
leaves it out for some queries."""

import numpy as np

Q, K = 5, 5  # queries and keys
LAST = K - 1  # the key that holds the poison

MASKS = {
    "valid_lens": {"valid_lens": np.array([LAST, 2])},
    "valid_lens_2d": {"valid_lens": np.array([[1, 2, 3, 4, 4], [4, 3, 2, 1, 0]])},
    "mask": {"mask": np.arange(K) != LAST},
    "causal": {"causal": True},
    "window_bool": {"window_mask": np.tri(Q, K, dtype=bool)[None]},
    "window_additive": {"window_mask": np.where(np.tri(Q, K, dtype=bool), 0.25, -np.inf)[None]},
}
