"""The mask rules, written once for every backend.

A call may give any of valid_lens, a boolean keep-mask, `causal`, a window mask and an
additive attn_bias, and the layer may have a sliding window and attention chunks. They
combine into one boolean `keep`, True where a query attends to a key, and an additive `bias`
(the finite entries of a float window mask and of attn_bias, their -inf entries being moved
into `keep`). Both have the scores' rank, (batch_size, no. of queries, no. of keys) or with
heads (batch_size, num_heads, no. of queries, no. of keys), each axis that size or 1, so that
they broadcast against the scores; None means no such mask.

`Masks.combine` holds the rules: which masks there are, the shape each one has, and where
the head axis goes. A backend subclasses `Masks` with the few array operations the rules need,
in its framework (see `_Masks` in each module of mha/backends); the ones that are Python's
operators on every framework's tensors are written here.
"""

from __future__ import annotations

import copy
import math
from typing import Any


def segment_pair(segment_ids: Any) -> tuple[Any, Any]:
    """(query segment ids, key segment ids) of segment_ids: one tensor for both, where the
    queries are the keys' positions, or a pair."""
    return segment_ids if isinstance(segment_ids, tuple) else (segment_ids, segment_ids)


def is_causal_alone(causal: bool, offset: int, *others: Any) -> bool:
    """Whether the causal mask, top-left (its first query at position 0), is the call's only
    mask: the fused kernels' own causal mask computes it then. `others`: every other mask,
    window, bias, slope or segment id of the call, each None when absent. An offset a trace
    leaves free (K - Q of free sizes) is taken as not 0: the causal mask of any offset is
    right at every size, where comparing it would bind the program to the example's."""
    top_left = isinstance(offset, int) and offset == 0
    return bool(causal) and top_left and all(x is None for x in others)


def every_row_keeps_a_key(
    valid_lens: Any, smallest_length: Any, causal: bool, offset: int, *others: Any
) -> bool:
    """Whether every row of the call's keep keeps a key, known without reading the mask, so
    that no read looks for rows with none: key 0 is kept by lengths whose smallest
    (`smallest_length`, None when not read) is at least 1 and by the causal mask of an offset
    of 0 or more, and there is no other mask (`others`, each None when absent)."""
    lengths = valid_lens is None or (smallest_length is not None and smallest_length >= 1)
    diagonal = not causal or (isinstance(offset, int) and offset >= 0)
    return lengths and diagonal and all(x is None for x in others)


def grouped_rows(shape: tuple[int, ...], heads: int, rows: int, group: int):
    """How a mask (keep, bias or sinks) of `shape`, broadcastable to (..., heads, rows, n),
    follows the queries when each key-value head's `group` query heads become one head of
    group x rows query rows: None where it broadcasts against them as it is (one mask row
    for every head and query), else (expand to, then reshape to). Keys and values then stay
    as they are, where repeating them per query head (Llama's repeat_kv) would copy them
    `group` times: a decoding step's whole cache."""
    shape = (1,) * (3 - len(shape)) + tuple(shape)
    *leading, num_heads, num_rows, n = shape
    # A size unknown while tracing (a tensor) is taken as not 1: expanding it is right either way
    if all(isinstance(size, int) and size == 1 for size in (num_heads, num_rows)):
        return None
    return (*leading, heads, rows, n), (*leading, heads // group, group * rows, n)


class Masks:
    """The mask rules; subclasses give the array operations below, for one call's sizes."""

    def __init__(self, batch_size: Any, num_queries: Any, num_keys: Any, offset: Any = 0):
        self.batch_size, self.num_queries, self.num_keys = batch_size, num_queries, num_keys
        # The position of the first query: the number of cached keys before this call's
        self.offset = offset

    def combine(
        self,
        valid_lens: Any,
        mask: Any,
        causal: bool,
        window_mask: Any,
        multihead: bool = False,
        attn_bias: Any = None,
        sliding_window: int | None = None,
        alibi_slopes: Any = None,
        segment_ids: Any = None,
        attention_chunk_size: int | None = None,
    ) -> tuple[Any, Any]:
        """(keep, bias) for the given masks; see the module's docstring. alibi_slopes: each
        head's ALiBi slope, (num_heads, 1, 1) in the scores' dtype, or None; segment_ids, of
        packed sequences: (batch_size, positions), or a pair for the queries and the keys;
        attention_chunk_size: the layer's chunks of positions, or None."""
        keep = bias = None
        # Packed sequences: the positions within each segment, where each sequence alone has
        # them, tell causal, the window and ALiBi; shape (batch_size, Q, K)
        packed = None if segment_ids is None else self.packed_distances(segment_ids)
        # Each mask with its rank: the scores' leading axes it lacks are inserted at the end
        masks = []
        if valid_lens is not None:
            # Keep keys j < valid_len; shape (batch_size, 1 or no. of queries, no. of keys)
            masks.append((self.length_mask(valid_lens), 3))
        if mask is not None and self.rank(mask) <= 3:
            # A keep-mask of 1 to 3 axes, broadcastable to (batch_size, Q, K)
            masks.append((mask, self.rank(mask)))
        masks += self.position_masks(
            causal, sliding_window, attention_chunk_size, segment_ids, packed
        )
        if window_mask is not None:
            # Example b uses window b mod num_windows; shape (batch_size, Q, K)
            windows = self.windows(window_mask)
            if self.is_bool(windows):
                masks.append((windows, 3))
            else:
                blocked = self.isneginf(windows)
                masks.append((self.negate(blocked), 3))
                bias = self.to_scores(self.zeros_where(blocked, windows), 3, multihead)
        rank = 0  # of keep: the largest of its masks'
        for each, each_rank in masks:
            keep = each if keep is None else self.both(keep, each)
            rank = max(rank, each_rank)
        keep = self.to_scores(keep, rank, multihead)
        return self.with_heads(
            keep, bias, mask if multihead else None, attn_bias, multihead, alibi_slopes, packed
        )

    def position_masks(
        self, causal: bool, sliding_window: Any, chunk_size: Any, segment_ids: Any, packed: Any
    ) -> list[tuple[Any, int]]:
        """combine's masks that read positions, each with its rank: (Q, K), or (batch_size,
        Q, K) for packed sequences, whose positions are packed's (packed_distances)."""
        masks = []
        if segment_ids is not None:
            # Packed sequences: a query keeps the keys of its own segment
            masks.append((self.same_segment(segment_pair(segment_ids)), 3))
        if causal:
            # Query i, at position offset + i, attends to keys j <= offset + i (top-left
            # aligned when Q != K and nothing is cached)
            masks.append((self.causal_mask(), 2) if packed is None else (packed <= 0, 3))
        if sliding_window is not None:
            # Query i attends to keys j with |offset + i - j| < sliding_window
            if packed is None:
                masks.append((self.band_mask(sliding_window), 2))
            else:
                masks.append((self.both(packed < sliding_window, -packed < sliding_window), 3))
        if chunk_size is not None:
            # Query and key in the same chunk of positions, packed ones at each segment's
            chunks = self.same_chunk(chunk_size, segment_ids)
            masks.append((chunks, 2 if segment_ids is None else 3))
        return masks

    def with_heads(
        self,
        keep: Any,
        bias: Any,
        mask: Any,
        attn_bias: Any,
        multihead: bool,
        alibi_slopes: Any,
        packed: Any = None,
    ) -> tuple[Any, Any]:
        """(keep, bias) with the masks and biases that may have a head axis added; packed:
        packed_distances, or None."""
        # A 4-D mask or attn_bias is (batch_size, num_heads, Q, K), each axis broadcastable;
        # a bias, like a float window, excludes its -inf entries exactly and adds the others
        with_heads = []
        if mask is not None and self.rank(mask) == 4:
            with_heads.append(mask)
        if attn_bias is not None:
            blocked = self.isneginf(attn_bias)
            rank = self.rank(attn_bias)
            if rank < 4:
                blocked = self.to_scores(blocked, rank, multihead)
                attn_bias = self.to_scores(attn_bias, rank, multihead)
            with_heads.append(self.negate(blocked))
            attn_bias = self.zeros_where(blocked, attn_bias)
            bias = attn_bias if bias is None else bias + attn_bias
        for each in with_heads:
            keep = each if keep is None else self.both(keep, each)
        if alibi_slopes is not None:
            # ALiBi: head h adds slope_h * (j - (offset + i)); shape (1, num_heads, Q, K), or
            # (batch_size, num_heads, Q, K) for packed sequences. Half precision's products are
            # taken in float32 and rounded once (a float16 distance past 65,504 is inf)
            slopes = self.widened(alibi_slopes)
            if packed is None:
                alibi = self.expand_dims(slopes * self.distances(slopes), 0)
            else:
                alibi = slopes * self.expand_dims(self.distances(slopes, packed), 1)
            alibi = self.cast_like(alibi, alibi_slopes)
            bias = alibi if bias is None else bias + alibi
        return keep, bias

    def function_masks(
        self, valid_lens: Any, mask: Any, causal: bool, window: Any, bias: Any, segment_ids=None
    ) -> tuple[Any, Any]:
        """(keep, bias) of a call of dot_product_attention, each broadcastable to its scores
        (batch_size, heads, Q, K) or None: its masks broadcast as numpy broadcasts, and the
        diagonal of causal and of the window is the offset's (the alignment's). window: the
        (left, right) of function_checks.window_sides, or None; segment_ids: (batch_size,
        positions), or a pair for the queries and the keys, or None."""
        keep = None
        masks = [mask]
        if valid_lens is not None:
            # Shape (batch_size, 1, 1 or no. of queries, no. of keys): every head alike
            masks.append(self.expand_dims(self.length_mask(valid_lens), 1))
        packed = None
        if segment_ids is not None:
            # Packed sequences: a query keeps the keys of its own segment, and causal and the
            # window read the positions within it; shape (batch_size, 1, Q, K)
            masks.append(self.expand_dims(self.same_segment(segment_pair(segment_ids)), 1))
            packed = self.expand_dims(self.packed_distances(segment_ids), 1)
        if causal:
            masks.append(self.causal_mask() if packed is None else packed <= 0)
        if window is not None:
            masks.append(self.window_keep(*window, packed))
        if bias is not None:
            # A bias's -inf entries leave their keys out exactly; the others are added
            blocked = self.isneginf(bias)
            masks.append(self.negate(blocked))
            bias = self.zeros_where(blocked, bias)
        for each in masks:
            if each is not None:
                keep = each if keep is None else self.both(keep, each)
        return keep, bias

    def packed_positions(self, segment_ids: Any) -> tuple[Any, Any]:
        """(query positions, key positions) of packed sequences, each (batch_size, positions):
        a position's index within its segment, where rotary embeddings restart; (None, None)
        without segment_ids."""
        if segment_ids is None:
            return None, None
        queries, keys = segment_pair(segment_ids)
        # One tensor for both: the queries' positions are the keys'
        positions = self.segment_positions(keys)
        return positions if queries is keys else self.segment_positions(queries), positions

    def packed_distances(self, segment_ids: Any) -> Any:
        """(batch_size, Q, K) integers: key j's position less query i's (offset + i), each
        counted within its own segment of the packed row, as its sequence alone counts them
        (segments need not be contiguous, and the queries' and the keys' may differ)."""
        self.require_int32()
        queries, keys = self.packed_positions(segment_ids)
        return self.expand_dims(keys, -2) - (self.expand_dims(queries, -1) + self.offset)

    def same_segment(self, segments: tuple[Any, Any]) -> Any:
        """keep (batch_size, Q, K): True where query i and key j have the same segment id."""
        queries, keys = segments
        return self.expand_dims(queries, -1) == self.expand_dims(keys, -2)

    def same_chunk(self, size: int, segment_ids: Any) -> Any:
        """keep: True where query i and key j lie in the same chunk of `size` positions,
        chunks counted from position 0 (Llama 4's attention_chunk_size): (Q, K), query i at
        position offset + i; or, with segment_ids, (batch_size, Q, K) at the positions within
        each packed segment, the queries' from offset."""
        if segment_ids is None:
            return self.chunk_mask(size)
        self.require_int32(size, packed=True)
        queries, keys = self.packed_positions(segment_ids)
        queries, keys = self.chunk_of(queries + self.offset, size), self.chunk_of(keys, size)
        return self.expand_dims(queries, -1) == self.expand_dims(keys, -2)

    def chunk_of(self, positions: Any, size: int) -> Any:
        """The chunk of each of the integer `positions`: position // size."""
        return positions // size

    def window_keep(self, left: int | None, right: int | None, packed: Any = None) -> Any:
        """keep (Q, K): True where p - left <= j <= p + right for query i at p = offset + i,
        a side that is None open; the causal masks of the diagonals shifted to its edges. With
        `packed` (packed_distances), the positions within each segment, its shape."""
        keep = None
        side = max(abs(side) for side in (left, right, 0) if side is not None)
        self.require_int32(side, packed=packed is not None)
        if right is not None:  # j <= p + right
            keep = self.shifted(right).causal_mask() if packed is None else packed <= right
        if left is not None:  # j >= p - left
            if packed is None:
                after = self.negate(self.shifted(-left - 1).causal_mask())
            else:
                after = -packed <= left
            keep = after if keep is None else self.both(keep, after)
        return keep

    def require_int32(self, size: int = 0, *, packed: bool = False) -> None:
        """Refuses an offset (alignment), window or chunk size whose positions would pass the
        backend's integers (JAX's int32 without its 64-bit mode); packed: `size` is compared
        with positions within segments, its own alone. Nothing to refuse here."""
        return None  # a body of its own: AutoGraph cannot convert a docstring alone

    def shifted(self, by: int) -> Masks:
        """These masks with every query `by` positions further on."""
        moved = copy.copy(self)
        moved.offset = self.offset + by
        return moved

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
        """keep (Q, K): True where key j <= offset + query i."""
        raise NotImplementedError

    def band_mask(self, width: int) -> Any:
        """keep (Q, K): True where |offset + i - j| < width, query i beside key offset + i."""
        raise NotImplementedError

    def chunk_mask(self, size: int) -> Any:
        """keep (Q, K): True where (offset + i) // size == j // size, query i and key j in
        the same chunk of positions."""
        raise NotImplementedError

    def distances(self, like: Any, packed: Any = None) -> Any:
        """(Q, K) in the dtype of `like`: key j's position less query i's, j - (offset + i);
        or packed_distances' `packed` (batch_size, Q, K) in that dtype."""
        raise NotImplementedError

    def windows(self, window_mask: Any) -> Any:
        """window_mask (num_windows, Q, K) -> (batch_size, Q, K), example b taking window
        b mod num_windows."""
        raise NotImplementedError

    def is_bool(self, windows: Any) -> bool:
        raise NotImplementedError

    def segment_positions(self, segment_ids: Any) -> Any:
        """segment_ids (batch_size, n) -> (batch_size, n) integers: how many earlier positions
        of the row share each position's segment id (its index among its segment's positions,
        which need not be contiguous)."""
        raise NotImplementedError

    def zeros_where(self, blocked: Any, x: Any) -> Any:
        """x with 0 where `blocked` is True."""
        raise NotImplementedError

    def cast_like(self, x: Any, like: Any) -> Any:
        """x in the dtype of `like` (the scores')."""
        raise NotImplementedError

    def widened(self, x: Any) -> Any:
        """x in float32 where it is float16 or bfloat16, else x itself."""
        raise NotImplementedError

    def expand_dims(self, x: Any, axis: int) -> Any:
        raise NotImplementedError

    # Python's operators, the same on every framework's tensors

    def rank(self, mask: Any) -> int:
        """The number of axes of the user's keep-mask."""
        return len(mask.shape)

    def isneginf(self, x: Any) -> Any:
        return x == -math.inf

    def both(self, a: Any, b: Any) -> Any:
        """Logical and of two broadcastable boolean masks."""
        return a & b

    def negate(self, a: Any) -> Any:
        return ~a
