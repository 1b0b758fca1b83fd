"""The mask rules, written once for every backend.

A call may give any of valid_lens, a boolean keep-mask, `causal` and a window mask. They
combine into one boolean `keep`, True where a query attends to a key, and an additive `bias`
(the finite entries of a float window mask, its -inf entries being moved into `keep`). Both
have the scores' rank, (batch_size, no. of queries, no. of keys) or with heads
(batch_size, num_heads, no. of queries, no. of keys), each axis that size or 1, so that they
broadcast against the scores; None means no such mask.

`Masks.combine` holds the rules: which masks there are, the shape each one has, and where
the head axis goes. A backend subclasses `Masks` with the few array operations the rules need,
in its framework (see `_Masks` in each module of mha/backends).
"""

from __future__ import annotations

from typing import Any


class Masks:
    """The mask rules; subclasses give the array operations below, for one call's sizes."""

    def combine(
        self, valid_lens: Any, mask: Any, causal: bool, window_mask: Any, multihead: bool = False
    ) -> tuple[Any, Any]:
        """(keep, bias) for the given masks; see the module's docstring."""
        keep = bias = None
        # Each mask with its rank: the scores' leading axes it lacks are inserted at the end
        masks = []
        if valid_lens is not None:
            # Keep keys j < valid_len; shape (batch_size, 1 or no. of queries, no. of keys)
            masks.append((self.length_mask(valid_lens), 3))
        if mask is not None and self.rank(mask) <= 3:
            # A keep-mask of 1 to 3 axes, broadcastable to (batch_size, Q, K)
            masks.append((mask, self.rank(mask)))
        if causal:
            # Query i attends to keys j <= i (top-left aligned when Q != K); shape (Q, K)
            masks.append((self.causal_mask(), 2))
        if window_mask is not None:
            # Example b uses window b mod num_windows; shape (batch_size, Q, K)
            windows = self.windows(window_mask)
            if self.is_bool(windows):
                masks.append((windows, 3))
            else:
                blocked = self.isneginf(windows)
                masks.append((self.negate(blocked), 3))
                bias = self.zeros_where(blocked, windows)
        rank = 0  # of keep: the largest of its masks'
        for each, each_rank in masks:
            keep = each if keep is None else self.both(keep, each)
            rank = max(rank, each_rank)
        keep, bias = self.to_scores(keep, rank, multihead), self.to_scores(bias, 3, multihead)
        if multihead and mask is not None and self.rank(mask) == 4:
            # A 4-D mask is (batch_size, num_heads, Q, K), each axis broadcastable
            keep = mask if keep is None else self.both(keep, mask)
        return keep, bias

    def to_scores(self, x: Any, rank: int, multihead: bool) -> Any:
        """(..., Q, K) of `rank` axes -> (1, ..., Q, K) of 3 axes; with multihead, then the
        head axis after the batch axis: every 1-D to 3-D mask applies to all heads."""
        if x is None:
            return None
        for _ in range(3 - rank):
            x = self.expand_dims(x, 0)
        return self.expand_dims(x, 1) if multihead else x

    # The array operations, in the backend's framework

    def length_mask(self, valid_lens: Any) -> Any:
        """valid_lens (batch_size,) or (batch_size, Q) -> keep (batch_size, 1 or Q, K)."""
        raise NotImplementedError

    def causal_mask(self) -> Any:
        """keep (Q, K): True where key j <= query i."""
        raise NotImplementedError

    def windows(self, window_mask: Any) -> Any:
        """window_mask (num_windows, Q, K) -> (batch_size, Q, K), example b taking window
        b mod num_windows."""
        raise NotImplementedError

    def rank(self, mask: Any) -> int:
        """The number of axes of the user's keep-mask."""
        raise NotImplementedError

    def is_bool(self, windows: Any) -> bool:
        raise NotImplementedError

    def isneginf(self, x: Any) -> Any:
        raise NotImplementedError

    def zeros_where(self, blocked: Any, x: Any) -> Any:
        """x with 0 where `blocked` is True."""
        raise NotImplementedError

    def both(self, a: Any, b: Any) -> Any:
        """Logical and of two broadcastable boolean masks."""
        raise NotImplementedError

    def negate(self, a: Any) -> Any:
        raise NotImplementedError

    def expand_dims(self, x: Any, axis: int) -> Any:
        raise NotImplementedError
