"""Hold someone's attention function to mha's reference: a kit for kernel authors.

`run(function, framework)` calls `function(query, key, value, **options)` on the framework's
tensors, (batch, heads, positions, head size), for each case of `CASES` (every mask kind,
both causal alignments and an integer one, grouped heads, windows, soft cap, lengths, rows
with no key, NaN at a masked key, packed segments, each option beside others, masks
together, long rows, scores past float32's exp and products past float16's range) in each
dtype, and compares its output with the NumPy reference's `dot_product_attention` of the
same inputs in float64, at the dtype's tolerance. `options` are mha's names (mask, bias,
scale, causal, alignment, window, valid_lens, softcap, segment_ids), only those a case sets:
a function that raises NotImplementedError, or TypeError for an option or mask of the case it
has no argument for, has "not taken" it. `mha.conformance_adapters`
gives the frameworks' own functions those names; `mha conform` is the command.
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from mha.backends import numpy as reference
from mha.registry import load_backend
from mha.weights import numpy_dtype

__all__ = ["CASES", "DTYPES", "TOLERANCES", "Case", "Row", "format_table", "run"]

DTYPES = ("float32", "float16", "bfloat16")
# Of the largest reference output's magnitude (at least 1): float32's rounding of a sum of a few
# products, float16's and bfloat16's 11 and 8 bits, with room for their softmax
TOLERANCES = {"float64": 1e-10, "float32": 1e-5, "float16": 5e-3, "bfloat16": 3e-2}


@dataclasses.dataclass(frozen=True)
class Case:
    """One call: sizes (batch, heads, kv heads, queries, keys, head size, value head size),
    the options it sets, and what it makes of the inputs (`inputs`: "plain", "nan at masked
    keys", "dominant key", "large products" or "long rows")."""

    name: str
    sizes: tuple[int, int, int, int, int, int, int] = (2, 4, 4, 5, 7, 8, 8)
    options: tuple[tuple[str, Any], ...] = ()
    masks: tuple[str, ...] = ()  # made from the sizes: "key padding", "per head", "bias", ...
    inputs: str = "plain"


# Six query heads over three: each key-value head serves two neighbours (h // 2), where
# four over two could not tell h // 2 from h // kv_heads
_GROUPED = (2, 6, 3, 5, 7, 8, 8)
_WINDOW_CAUSAL = (("window", (2, 1)), ("causal", True))
_WINDOW_BOTTOM_RIGHT = (("window", (2, 1)), ("alignment", "bottom_right"))

CASES = (
    Case("plain"),
    Case("scale", options=(("scale", 0.3),)),
    Case("grouped heads (6 query, 3 key-value)", sizes=_GROUPED),
    Case("value head size 12", sizes=(2, 4, 4, 5, 7, 8, 12)),
    Case("causal, Q = K", sizes=(2, 4, 4, 6, 6, 8, 8), options=(("causal", True),)),
    Case("causal, Q < K (top_left)", options=(("causal", True),)),
    Case("causal bottom_right, Q < K", options=(("causal", True), ("alignment", "bottom_right"))),
    Case("boolean mask (batch, 1, 1, K)", masks=("key padding",)),
    Case("boolean mask (batch, heads, Q, K)", masks=("per head",)),
    Case("additive bias (batch, heads, Q, K)", masks=("bias",)),
    Case("valid_lens (batch,)", masks=("lengths",)),
    Case("window (2, 1)", sizes=(2, 4, 4, 7, 7, 8, 8), options=(("window", (2, 1)),)),
    Case("softcap 5", options=(("softcap", 5.0),)),
    Case("packed segments (3 + 4, 5 + 2)", sizes=(2, 4, 4, 7, 7, 8, 8), masks=("segments",)),
    Case("a row with no key", masks=("empty row",)),
    Case("NaN at masked keys", masks=("key padding",), inputs="nan at masked keys"),
    # Each option beside another, and the forms a kernel may mistake for a simpler one
    Case("causal, alignment 1 (a cached key)", options=(("causal", True), ("alignment", 1))),
    Case(
        "window 3 (an int), alignment 1",
        sizes=(2, 4, 4, 7, 7, 8, 8),
        options=(("window", 3), ("alignment", 1)),
    ),
    Case("valid_lens (batch, Q)", masks=("lengths per query",)),
    Case("softcap 5, causal", options=(("softcap", 5.0), ("causal", True))),
    Case("softcap 5, additive bias", options=(("softcap", 5.0),), masks=("bias",)),
    Case("additive bias with -inf, a row all -inf", masks=("bias with -inf",)),
    Case(
        "NaN at keys a -inf bias leaves out", masks=("padding bias",), inputs="nan at masked keys"
    ),
    Case("boolean mask (heads, Q, K)", masks=("per head, 3-D",)),
    # Forms a kernel may read as another: a 2-D mask is (Q, K), not key padding (batch, K); a
    # key axis of 1 is every key's, not one key's padded; a side of None is open
    Case("boolean mask (Q, K)", masks=("per query, 2-D",)),
    Case("additive bias (heads, Q, 1), every key's", masks=("bias of each row",)),
    Case(
        "window (None, 1), open on the left",
        sizes=(2, 4, 4, 7, 7, 8, 8),
        options=(("window", (None, 1)),),
    ),
    Case("packed segments, a pair (queries, keys)", masks=("segment pair",)),
    # Causal and windows on each position's index among its segment's, not the packed row's
    Case("packed segments, a pair, causal", options=(("causal", True),), masks=("segment pair",)),
    Case(
        "packed segments, a pair, window (1, 0)",
        options=(("window", (1, 0)),),
        masks=("segment pair",),
    ),
    # Masks together, as a kernel that takes one of them at a time would not compute them
    Case("boolean mask and causal", masks=("per head",), options=(("causal", True),)),
    Case("valid_lens and causal", masks=("lengths",), options=(("causal", True),)),
    Case("boolean mask and additive bias", masks=("key padding", "bias")),
    Case("boolean mask and valid_lens", masks=("per head", "lengths")),
    Case("window (2, 1) and causal", sizes=(2, 4, 4, 7, 7, 8, 8), options=_WINDOW_CAUSAL),
    # Grouped heads beside masks: a kernel folding a group's queries into one axis must read
    # each query's own position and head
    Case("grouped heads, causal", sizes=_GROUPED, options=(("causal", True),)),
    Case("grouped heads, boolean mask (batch, heads, Q, K)", sizes=_GROUPED, masks=("per head",)),
    # Windows where Q < K: the alignments differ
    Case("window (2, 1), Q < K (top_left)", options=(("window", (2, 1)),)),
    Case("window (2, 1) bottom_right, Q < K", options=_WINDOW_BOTTOM_RIGHT),
    # Rows with no key that no mask or bias makes: a length of 0, queries before every key
    Case("valid_lens with a 0 (an example of padding alone)", masks=("lengths with a 0",)),
    Case(
        "causal bottom_right, Q > K (the first queries keep no key)",
        sizes=(2, 4, 4, 7, 5, 8, 8),
        options=(("causal", True), ("alignment", "bottom_right")),
    ),
    # More keys than any tile size divides, each query's weight on a few of them, one on the
    # last key: a kernel losing a partial last tile or an earlier tile's rescaling shows
    Case("long rows (K = 4133)", sizes=(1, 2, 2, 3, 4133, 8, 8), inputs="long rows"),
    # Scores a softmax must take apart: exp(106) is past float32's range, and so is a product
    # of float16's rounded before it is scaled
    Case("a dominant key (its score 106, the others near 0)", inputs="dominant key"),
    Case(
        "products past float16's range (q.k near 80,000), scale 3e-5",
        options=(("scale", 3e-5),),
        inputs="large products",
    ),
)


@dataclasses.dataclass(frozen=True)
class Row:
    """A case in a dtype: status "agrees", "differs", "not taken" or "error"; difference, the
    largest absolute difference from the reference (NaN where the output holds NaN), and
    gradient_difference that of the gradients of query, key and value (None: not compared)."""

    case: str
    dtype: str
    status: str
    difference: float | None = None
    tolerance: float | None = None
    note: str = ""
    gradient_difference: float | None = None


def run(
    function: Callable,
    framework: str,
    dtypes: Sequence[str] = DTYPES,
    cases: Sequence[Case] = CASES,
    seed: int = 0,
    empty_rows: str = "zeros",
    gradients: bool = True,
    device: str | None = None,
) -> list[Row]:
    """Each case of `cases` in each dtype of `dtypes`, through `function` on `framework`'s
    tensors (an mha backend's name: numpy, torch, tensorflow, mxnet, jax). A row with no key
    is held to `empty_rows`: "zeros" (mha's and ONNX's) or "uniform" (the mean of the values,
    the softmax of equal scores: JAX's and Keras's). With `gradients`, on a framework with
    autograd, the gradients of query, key and value are held to those of mha's function of
    that framework in float64 (itself held to the reference's finite differences). `device`
    ("cpu", "gpu") places the function's tensors; None leaves them where the framework puts
    them. The references run where the framework puts them, in float64."""
    module = load_backend(framework)
    place = _placer(module, device)
    rows = []
    for case in cases:
        arrays = _inputs(case, np.random.default_rng(seed))
        for dtype in dtypes:
            row = _row(function, module, place, case, arrays, dtype, empty_rows)
            if gradients and row.status == "agrees" and module.ADAPTER.autograd:
                row = _with_gradients(row, function, module, place, case, arrays, empty_rows)
            rows.append(row)
    return rows


def _placer(module, device: str | None) -> Callable:
    """What puts a tensor on `device`; a ValueError where the backend places nothing."""
    if device is None:
        return lambda x: x
    if module.ADAPTER.to_device is None:
        raise ValueError(f"mha does not place {module.__name__.split('.')[-1]}'s tensors")
    return lambda x: module.ADAPTER.to_device(x, device)


def _with_gradients(row: Row, function, module, place, case: Case, arrays: dict, empty_rows) -> Row:
    """The row with its gradients compared (of sum(output * cotangent)); a NaN at a masked
    key is compared by outputs only: 0 x NaN makes the query's gradient NaN in any product, and
    so is a function whose backward raises NotImplementedError (the row's note says so)."""
    if case.inputs == "nan at masked keys":
        return row
    options = dict(case.options)
    cotangent = np.random.default_rng(1).standard_normal(_output_shape(arrays))
    wrt = ["query", "key", "value"]

    def gradients_of(call, dtype, place=lambda x: x):
        tensors = {
            k: _given(module, place, _rounded(v, row.dtype), dtype) for k, v in arrays.items()
        }
        _, found, _ = module.ADAPTER.value_and_gradients(
            lambda t: _call(call, t, options),
            tensors,
            wrt,
            None,
            place(module.from_numpy(_cast(cotangent, dtype))),
        )
        return {k: np.asarray(v, dtype="float64") for k, v in found.items()}

    def reference_call(query, key, value, **given):
        return module.dot_product_attention(query, key, value, **given, empty_rows=empty_rows)

    try:
        expected = gradients_of(reference_call, "float64")
    except ValueError:  # JAX without its 64-bit mode has no float64: outputs only
        return row
    try:
        got = gradients_of(function, row.dtype, place)
    except NotImplementedError as error:  # no backward: the outputs alone are compared
        return dataclasses.replace(row, note=f"gradients not taken: {_first_line(error)}")
    except Exception as error:
        return dataclasses.replace(row, status="error", note=f"gradients: {_first_line(error)}")
    worst, where = 0.0, ""
    for name in wrt:
        tolerance = TOLERANCES[row.dtype] * max(1.0, float(np.max(np.abs(expected[name]))))
        difference = float(np.max(np.abs(got[name] - expected[name])))
        if not difference <= tolerance:
            where = where or f"the gradient of {name} differs by {difference:.3g} ({tolerance:.1g})"
        worst = difference if np.isnan(difference) else max(worst, difference)
    status = "differs" if where else "agrees"
    return dataclasses.replace(row, status=status, note=where, gradient_difference=worst)


def _call(function, tensors: dict, options: dict):
    """function(query, key, value, **masks, **options): the three by position, as the
    conformance contract calls them, whatever the function names them."""
    query, key, value = (tensors[k] for k in ("query", "key", "value"))
    masks = {k: v for k, v in tensors.items() if k not in ("query", "key", "value")}
    return function(query, key, value, **masks, **options)


def _output_shape(arrays: dict) -> tuple[int, ...]:
    """The output's shape of a case's inputs: (batch, heads, queries, value head size)."""
    return (*arrays["query"].shape[:3], arrays["value"].shape[-1])


def _row(function, module, place, case: Case, arrays: dict, dtype: str, empty_rows: str) -> Row:
    rounded = {k: _rounded(v, dtype) for k, v in arrays.items()}
    expected = reference.dot_product_attention(
        **rounded, **dict(case.options), empty_rows=empty_rows
    )
    try:
        given = {k: _given(module, place, v, dtype) for k, v in arrays.items()}
        output = np.asarray(module.to_numpy(_call(function, given, dict(case.options))))
    except NotImplementedError as error:
        return Row(case.name, dtype, "not taken", note=_first_line(error))
    except TypeError as error:
        status = "not taken" if _declined(function, error, arrays, case) else "error"
        return Row(case.name, dtype, status, note=f"TypeError: {_first_line(error)}")
    except Exception as error:
        return Row(case.name, dtype, "error", note=f"{type(error).__name__}: {_first_line(error)}")
    if output.shape != expected.shape or output.dtype != numpy_dtype(dtype):
        note = (f"output shape {output.shape} and dtype {output.dtype}, expected "
                f"{expected.shape} and {dtype}")  # fmt: skip
        return Row(case.name, dtype, "differs", note=note)
    output = output.astype("float64")
    tolerance = TOLERANCES[dtype] * max(1.0, float(np.max(np.abs(expected))))
    difference = float(np.max(np.abs(output - expected)))  # NaN if the output holds NaN
    agrees = difference <= tolerance
    note = "" if agrees else _where(output, expected, tolerance)
    return Row(case.name, dtype, "agrees" if agrees else "differs", difference, tolerance, note)


def _declined(function, error: TypeError, arrays: dict, case: Case) -> bool:
    """Whether a TypeError says the function has no argument for an option or mask the case
    gives (its signature cannot take them, or the error names one as unexpected), rather than
    a failure inside it; a case that gives neither calls it as every function is called."""
    names = {*dict(case.options), *(k for k in arrays if k not in ("query", "key", "value"))}
    if not names:
        return False
    message = str(error)
    if "unexpected keyword" in message and any(repr(name) in message for name in names):
        return True
    try:
        inspect.signature(function).bind(None, None, None, **dict.fromkeys(names))
    except TypeError:
        return True
    except ValueError:  # no signature to read (a builtin): the error alone tells
        return "keyword" in message or "argument" in message
    return False


def _inputs(case: Case, rng: np.random.Generator) -> dict[str, np.ndarray]:
    """The case's query, key and value and masks, float64 (boolean and integer masks as such)."""
    batch, heads, kv_heads, queries, keys, d, dv = case.sizes
    arrays = {
        "query": rng.standard_normal((batch, heads, queries, d)),
        "key": rng.standard_normal((batch, kv_heads, keys, d)),
        "value": rng.standard_normal((batch, kv_heads, keys, dv)),
    }
    lengths = np.array([3, keys][:batch])  # fewer than the queries: the later ones keep 3
    padding = (np.arange(keys) < lengths[:, None])[:, None, None, :]
    made = {
        "key padding": ("mask", padding),
        "per head": ("mask", rng.random((batch, heads, queries, keys)) < 0.6),
        "per head, 3-D": ("mask", rng.random((heads, queries, keys)) < 0.6),
        "per query, 2-D": ("mask", rng.random((queries, keys)) < 0.6),
        "bias": ("bias", rng.standard_normal((batch, heads, queries, keys))),
        "bias with -inf": (
            "bias",
            _with_minus_infinity(rng.standard_normal((batch, heads, queries, keys))),
        ),
        "padding bias": ("bias", np.where(padding, 0.0, -np.inf)),
        "bias of each row": ("bias", 3.0 * rng.standard_normal((heads, queries, 1))),
        "lengths": ("valid_lens", lengths),
        "lengths with a 0": ("valid_lens", np.array([0, keys][:batch])),
        "lengths per query": ("valid_lens", rng.integers(1, keys + 1, (batch, queries))),
        "empty row": ("mask", _with_an_empty_row(rng.random((batch, 1, queries, keys)) < 0.6)),
        "segments": ("segment_ids", np.array([[0] * 3 + [1] * 4, [0] * 5 + [1] * 2][:batch])),
        "segment pair": ("segment_ids", _segment_pair(batch, queries, keys)),
    }
    for name in case.masks:
        argument, value = made[name]
        arrays[argument] = value
    if any(name.startswith("per ") for name in case.masks):
        arrays["mask"][..., 0] = True  # a kept key in every row
    if case.inputs == "nan at masked keys":  # padding: what a masked key holds is not read
        arrays["key"] = np.where(np.moveaxis(padding, -1, -2), arrays["key"], np.nan)
    if case.inputs == "dominant key":  # every query's score with key 0 about 106
        arrays["query"][..., 0], arrays["key"][..., 0] = 10.0, 0.0
        arrays["key"][..., 0, 0] = 10.6 * np.sqrt(d)  # times 10, over sqrt(d)
    if case.inputs == "long rows":  # scores of spread 2: a few keys hold a row's weight
        arrays["query"] *= 2.0
        arrays["key"][:, :, -1] = arrays["query"][:, :, 0]  # query 0's score with it near 11
    if case.inputs == "large products":  # entries near 100 whose products sum past 65,504
        arrays["query"] = 100.0 + 30.0 * arrays["query"]
        arrays["key"] = 100.0 + 30.0 * arrays["key"]
    return arrays


def _with_minus_infinity(bias: np.ndarray) -> np.ndarray:
    """-inf at some keys of every row, and at every key of example 0's query 1."""
    bias[..., 1::3] = -np.inf
    bias[0, :, 1] = -np.inf
    return bias


def _segment_pair(batch: int, queries: int, keys: int) -> tuple[np.ndarray, np.ndarray]:
    """Query ids and key ids: two segments in each example, cut at other places."""
    cuts = [(2, 3), (3, 4)][:batch]
    query_ids = np.array([np.arange(queries) >= q for q, _ in cuts], dtype="int32")
    key_ids = np.array([np.arange(keys) >= k for _, k in cuts], dtype="int32")
    return query_ids, key_ids


def _with_an_empty_row(mask: np.ndarray) -> np.ndarray:
    mask[..., 0] = True
    mask[0, :, 1] = False  # example 0's query 1 keeps no key
    return mask


def _each(x: Any, change: Callable) -> Any:
    """change(x), or of each array of a pair (segment ids of the queries and the keys)."""
    return tuple(map(change, x)) if isinstance(x, tuple) else change(x)


def _cast(x: np.ndarray, dtype: str) -> np.ndarray:
    """A float input in the dtype the function gets (bfloat16 as ml_dtypes'); masks as they
    are; each a copy, which a function that writes into its arguments changes alone."""
    return x.astype(numpy_dtype(dtype)) if x.dtype.kind == "f" else x.copy()


def _given(module, place, x: Any, dtype: str) -> Any:
    """An input as the function gets it: the framework's tensor (a pair, each), placed."""
    return _each(x, lambda part: place(module.from_numpy(_cast(part, dtype))))


def _rounded(x: Any, dtype: str) -> Any:
    """What the function gets, in float64 for the reference: only its arithmetic is judged."""
    return _each(
        x, lambda part: _cast(part, dtype).astype("float64") if part.dtype.kind == "f" else part
    )


def _where(output: np.ndarray, expected: np.ndarray, tolerance: float) -> str:
    """Where an output differs: NaN, or the first element out of tolerance."""
    if np.isnan(output).any():
        return f"NaN in {int(np.isnan(output).sum())} of {output.size} outputs"
    # Not within tolerance, a NaN in the reference included
    index = tuple(int(i) for i in np.argwhere(~(np.abs(output - expected) <= tolerance))[0])
    return f"at {index}: {output[index]:.6g}, reference {expected[index]:.6g}"


def _first_line(error: BaseException) -> str:
    return (str(error).strip().splitlines() or [""])[0][:160]


def format_table(rows: Sequence[Row]) -> str:
    """One line per case, one column per dtype: the largest difference when it agrees,
    DIFFERS or not taken with its note; then the count of each status."""
    dtypes = list(dict.fromkeys(row.dtype for row in rows))
    cases = list(dict.fromkeys(row.case for row in rows))
    cell = {(row.case, row.dtype): row for row in rows}
    width = max(len(case) for case in cases) + 2
    lines = ["case".ljust(width) + "".join(dtype.ljust(16) for dtype in dtypes)]
    notes = []
    for case in cases:
        texts = []
        for dtype in dtypes:
            row = cell[case, dtype]
            texts.append(_cell(row).ljust(16))
            if row.note:  # an agreeing row's note says its gradients were not compared
                notes.append(f"  {case}, {dtype}: {row.status}: {row.note}")
        lines.append(case.ljust(width) + "".join(texts).rstrip())
    counts = {
        s: sum(row.status == s for row in rows) for s in ("agrees", "differs", "not taken", "error")
    }
    summary = ", ".join(f"{count} {status}" for status, count in counts.items() if count)
    graded = sum(row.gradient_difference is not None for row in rows)
    summary += f"; gradients compared in {graded}" + (" (+grad)" if graded else "")
    return "\n".join([*lines, "", *dict.fromkeys(notes), "", f"{len(rows)} rows: {summary}"])


def _cell(row: Row) -> str:
    if row.status == "agrees":
        return f"ok {row.difference:.0e}" + (
            " +grad" if row.gradient_difference is not None else ""
        )
    return {"differs": "DIFFERS", "not taken": "not taken", "error": "ERROR"}[row.status]
