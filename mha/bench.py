"""Benchmarks: mha's MultiHeadAttention against each framework's own attention layer.

Run by `mha bench` (and `python benchmarks/run.py`). For every backend, shape, valid_lens
(with or without) and need_weights (True or False), the forward pass and the forward and
backward pass of mha's layer are timed side by side with the framework's own layer, in one
process and interleaved (one call of each per round), so that both see the same machine load:

- torch: `torch.nn.MultiheadAttention` and a layer built on `F.scaled_dot_product_attention`
  (which cannot return weights, so it runs with need_weights=False only);
- tensorflow: `keras.layers.MultiHeadAttention`;
- mxnet: the book's own Gluon multi-head attention (d2l's code, written below), imperative and
  hybridized, against mha's block in the same mode;
- numpy: no framework layer, so the forward pass is compared with the FLOP rate of a large
  matrix product (the roofline), timed in the same rounds; `ratio` is the fraction reached.

`--valid-lens`, `--need-weights`, `--pass` and `--mode` run only the rows they select: with
`--backends` and `--shapes`, one row's configuration, to time it again on its own.

Every layer is self-attention on one input X (batch_size, length, num_hiddens), projections
without bias, float32, dropout 0. Forward passes run as inference (no gradient tape); the
backward pass differentiates sum(output) with respect to X and every weight. Each time is the
median of repeated calls after warm-up; the ratio is the median, over the rounds, of mha's time
over the built-in's in the same round (a pair of neighbouring calls sees the same load), so
below 1.0 means mha is faster; each ratio comes with a 95% confidence interval, and one that
holds 1.0 is a tie. Every layer holds the same weights, and torch's and Keras's layers make
their masks from valid_lens inside the timed call, as mha does. Peak memory is the growth of
the process's peak resident set (VmHWM, reset through /proc/self/clear_refs) during one call:
it counts every allocator. `mha bench` fixes glibc's malloc thresholds and arenas first
(steady_allocator), so that no row depends on what the rows before it left in the allocator.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import itertools
import json
import math
import os
import platform
import re
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from mha.registry import BACKENDS, BackendUnavailableError, load_backend, select_backends

try:
    import resource
except ImportError:  # not on this platform (Windows): no page-fault counts
    resource = None

__all__ = ["SHAPES", "Config", "Result", "markdown_table", "run", "run_memory_scaling"]

# (batch_size, length, num_hiddens, num_heads)
SHAPES = ((32, 64, 256, 8), (8, 512, 512, 8), (1, 4096, 512, 8))
QUICK_SHAPES = ((2, 16, 32, 4),)

# The fewest rounds whose whole range is a 95% interval of their median: all n rounds lie
# on one side of it with probability 2 / 2**n, 1/16 for 5 rounds (above 5%), 1/32 for 6
CONFIDENT_ROUNDS = 6
# The verdict of a row timed in fewer rounds (a --quick run), whose range is no 95% interval
TOO_FEW_ROUNDS = "too few rounds"

PASSES = ("forward", "forward+backward")


@dataclasses.dataclass(frozen=True)
class Config:
    """One benchmarked call: self-attention on X (batch_size, length, num_hiddens)."""

    batch_size: int
    length: int
    num_hiddens: int
    num_heads: int
    valid_lens: bool
    need_weights: bool
    # Of the layers, inputs and weights; and where they run: "cpu", or "gpu" (torch's
    # "cuda", TensorFlow's "/GPU:0")
    dtype: str = "float32"
    device: str = "cpu"

    @property
    def shape(self) -> str:
        return f"({self.batch_size}, {self.length}, {self.num_hiddens}, {self.num_heads})"

    def forward_flops(self) -> float:
        """Multiply-adds x 2 of the four projections and the two attention products."""
        b, n, d = self.batch_size, self.length, self.num_hiddens
        return 2.0 * (4 * b * n * d * d + 2 * b * n * n * d)


@dataclasses.dataclass
class Result:
    """One row: mha against one built-in (or the roofline) for one config and pass."""

    backend: str
    mode: str
    config: Config
    pass_: str
    builtin: str
    mha_ms: float | None
    builtin_ms: float | None
    ratio: float | None
    mha_peak_mib: float | None = None
    builtin_peak_mib: float | None = None
    repeats: int = 0
    note: str = ""
    # The 95% confidence interval of the ratio (paired_ratio_interval)
    ratio_interval: tuple[float, float] | None = None
    # Median minor page faults per timed call (fresh memory touched), where the platform
    # counts them: a layer whose temporaries land on fresh pages pays for faulting them in
    mha_faults: float | None = None
    builtin_faults: float | None = None

    @property
    def verdict(self) -> str:
        """What the 95% interval of the ratio says. Against a built-in: "faster" when it lies
        below 1.0, "slower" above, "tie" when it holds 1.0 (the run cannot tell the two
        apart). NumPy, whose ratio is the fraction of the roofline reached, against half of
        it: "above half", "below half" or "tie with half". "-" without an interval; "too few
        rounds" from fewer than CONFIDENT_ROUNDS, whose interval is not a 95% one."""
        if self.ratio_interval is None:
            return "-"
        if self.repeats < CONFIDENT_ROUNDS:
            return TOO_FEW_ROUNDS
        low, high = self.ratio_interval
        if self.builtin == ROOFLINE:
            target, names = HALF_ROOFLINE, ("below half", "tie with half", "above half")
        else:
            target, names = 1.0, ("faster", "tie", "slower")
        return names[0] if high < target else names[2] if low > target else names[1]

    def as_dict(self) -> dict[str, Any]:
        row = dataclasses.asdict(self)
        row["pass"] = row.pop("pass_")
        row["verdict"] = self.verdict
        return row

    @classmethod
    def from_dict(cls, row: dict[str, Any]) -> Result:
        """A row of a saved report (as_dict, through JSON) as a Result."""
        fields = {field.name for field in dataclasses.fields(cls)}
        values = {key: value for key, value in row.items() if key in fields}
        values["config"] = Config(**row["config"])
        values["pass_"] = row["pass"]
        if row.get("ratio_interval") is not None:
            values["ratio_interval"] = tuple(row["ratio_interval"])
        return cls(**values)


@dataclasses.dataclass
class Budget:
    """How long to measure: at least min_repeats rounds, then stop at max_repeats or seconds."""

    warmup: int = 2
    min_repeats: int = CONFIDENT_ROUNDS
    max_repeats: int = 200
    seconds: float = 3.0


QUICK_BUDGET = Budget(warmup=1, min_repeats=2, max_repeats=3, seconds=0.2)


# ---------------------------------------------------------------------------------------------
# Measuring


def _minor_faults() -> int | None:
    # Minor page faults of the process so far: pages touched for the first time
    return None if resource is None else resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def _interleaved_times(
    calls: dict[str, Callable[[], Any]],
    budget: Budget,
    faults: dict[str, list[int]] | None = None,
) -> dict[str, list[float]]:
    """Seconds of each call in each round; one call of each per round. With `faults`, the
    minor page faults of each call go there too (counted outside the timed interval).

    The rounds take the orders of _round_orders in turn: a call's time depends on the one
    before it (measured with torch at (32, 64, 256, 8): every layer took about 1 ms more, of
    8, right after nn.MultiheadAttention, and 1.7% less right after itself), and a rotation of
    three calls always put the same one before mha's.
    """
    for call in calls.values():
        for index in range(budget.warmup):
            begin = time.perf_counter()
            call()
            if index == 0 and time.perf_counter() - begin > budget.seconds / 4:
                break  # a slow call: one warm-up is enough to build caches and graphs
    times: dict[str, list[float]] = {name: [] for name in calls}
    orders = _round_orders(list(calls))
    start = time.perf_counter()
    rounds = 0
    while rounds < budget.max_repeats:
        for name in orders[rounds % len(orders)]:
            faulted = _minor_faults() if faults is not None else None
            begin = time.perf_counter()
            calls[name]()
            times[name].append(time.perf_counter() - begin)
            if faulted is not None:
                faults.setdefault(name, []).append(_minor_faults() - faulted)
        rounds += 1
        if rounds >= budget.min_repeats and time.perf_counter() - start > budget.seconds:
            break
    return times


def _round_orders(names: Sequence[str]) -> list[tuple[str, ...]]:
    """Every order of the calls once, in a cycle in which each call comes right after each
    other one equally often and, with three calls or more, never right after itself, the
    seams between rounds counted: the last call of a round comes right before the first of
    the next, as much as any two calls within a round.

    Every order once puts each call in each place of a round equally often, and makes each
    ordered pair of calls neighbours within rounds (n - 1)! times; the seams add (n - 2)! of
    each, chosen here. Taken in the order that itertools gives them, the seams of three calls
    put the first and second call right after themselves once per cycle and the third never,
    which favoured the first (mha, 1.7% faster right after itself at (32, 64, 256, 8)). Two
    calls cannot avoid it: either each comes right after itself once per cycle (a b, b a),
    as here, or one always opens the round. Beyond five calls (720 orders and more, more than
    a measurement's rounds) the orders are itertools'.
    """
    orders = list(itertools.permutations(names))
    if not 3 <= len(names) <= 5:
        return orders
    per_pair = math.factorial(len(names) - 2)
    seams: dict[tuple[str, str], int] = {}
    chosen, left = [orders[0]], set(orders[1:])

    def fits(before: str, after: str) -> bool:
        return before != after and seams.get((before, after), 0) < per_pair

    def extend() -> bool:
        # Depth-first: the next order whose seam fits, undone when the rest cannot follow
        if not left:
            return fits(chosen[-1][-1], chosen[0][0])  # the cycle's own seam
        for order in orders:
            seam = (chosen[-1][-1], order[0])
            if order in left and fits(*seam):
                seams[seam] = seams.get(seam, 0) + 1
                left.remove(order)
                chosen.append(order)
                if extend():
                    return True
                chosen.pop()
                left.add(order)
                seams[seam] -= 1
        return False

    if not extend():
        raise AssertionError(f"no balanced cycle of the orders of {len(names)} calls")
    return chosen


def paired_ratio(ours: Sequence[float], theirs: Sequence[float]) -> float:
    """The median over rounds of ours / theirs, each pair from the same round."""
    return statistics.median(a / b for a, b in zip(ours, theirs, strict=True))


def paired_ratio_interval(
    ours: Sequence[float], theirs: Sequence[float], confidence: float = 0.95
) -> tuple[float, float]:
    """A confidence interval of paired_ratio that assumes nothing of the distribution: from
    the j-th smallest per-round ratio to the j-th largest, which hold the median between them
    with probability 1 - 2 P(Binomial(n, 1/2) < j), for the largest j that keeps this at
    least `confidence` (the 40th to the 61st of 100). With 8 rounds or fewer it is the whole
    range (which, with 5 or fewer, holds the median with less than that probability: no
    verdict is read from it, see CONFIDENT_ROUNDS). An interval that holds 1.0 is a tie: the
    two differ by less than the run can tell.
    """
    ratios = sorted(a / b for a, b in zip(ours, theirs, strict=True))
    n = len(ratios)
    j, below = 1, 1 / 2**n  # below = P(Binomial(n, 1/2) < j)
    while j < n // 2 and 2 * (below + math.comb(n, j) / 2**n) <= 1 - confidence:
        below += math.comb(n, j) / 2**n
        j += 1
    return ratios[j - 1], ratios[n - j]


def _status_kib(field: str) -> int | None:
    try:
        with open("/proc/self/status") as status:
            match = re.search(rf"^{field}:\s+(\d+) kB", status.read(), re.MULTILINE)
    except OSError:
        return None
    return int(match.group(1)) if match else None


def _trim_heap() -> None:
    # Give freed heap pages back to the system, so that a call's growth is visible again
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)


# glibc's mallopt parameters, and the values `mha bench` fixes them to: the largest mmap
# threshold glibc takes (32 MiB on 64-bit), a trim threshold above it, and one arena
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD, _M_ARENA_MAX = -1, -3, -8
STEADY_MALLOC = {
    "MALLOC_MMAP_THRESHOLD_": 32 * 2**20,
    "MALLOC_TRIM_THRESHOLD_": 64 * 2**20,
    "MALLOC_ARENA_MAX": 1,
}
MALLOC_DEFAULTS = (
    "glibc's defaults (thresholds that move with what was freed before, an arena per thread)"
)
_steadied: str | None = None  # what steady_allocator did, once it has fixed the allocator


def steady_allocator(fix: bool = True) -> str:
    """Fix glibc's malloc thresholds and arenas for the rest of this process (unless `fix` is
    False), as the environment variables of STEADY_MALLOC would from its start; returns what the
    allocator does, for the report. Call it before any framework starts its threads: a thread
    that has allocated keeps its arena. Variables the user has set are left as they are, and a
    process whose thresholds were fixed keeps them: glibc cannot make them dynamic again.

    By default glibc raises its mmap threshold to the size of each mmap-ed block freed, and its
    trim threshold to twice that: whether the next large buffer reuses pages the process holds
    or faults in fresh ones depends on what ran before. Measured with MXNet at (32, 64, 256, 8),
    that history swung a row's ratio from 0.79 to 1.22 (benchmarks/README.md). The thresholds
    govern the main arena only: a thread's own arena grows in heaps of 64 MiB and unmaps a
    whole heap as soon as it is free, whatever the thresholds, so a buffer that does not fit the
    first heap is fresh pages on every call. MXNet allocates in its engine's threads, and with
    the thresholds fixed one row still read 1.345 with 10241 page faults per mha call against
    none for the book's block, and 0.965 alone. With one arena, every thread allocates where
    the thresholds hold, and both layers of a row see the same allocator, whatever ran before.
    """
    global _steadied
    given = {name: os.environ[name] for name in STEADY_MALLOC if name in os.environ}
    if given:
        return "set from the environment: " + ", ".join(f"{k}={v}" for k, v in given.items())
    if fix and _steadied is None:
        try:
            mallopt = ctypes.CDLL("libc.so.6").mallopt
        except (OSError, AttributeError):
            return "the platform's own (not glibc: left as it is)"
        parameters = (_M_MMAP_THRESHOLD, _M_TRIM_THRESHOLD, _M_ARENA_MAX)
        values = STEADY_MALLOC.values()
        if not all(mallopt(p, v) for p, v in zip(parameters, values, strict=True)):
            return MALLOC_DEFAULTS + "; mallopt refused to fix them"
        _steadied = "fixed by mha bench: " + ", ".join(f"{k}={v}" for k, v in STEADY_MALLOC.items())
    return _steadied or MALLOC_DEFAULTS


def peak_memory_mib(call: Callable[[], Any]) -> float | None:
    """Growth of the peak resident set during one call, in MiB (None where not measurable).

    Linux only: writing 5 to /proc/self/clear_refs resets VmHWM to the current resident set.
    """
    _trim_heap()
    try:
        with open("/proc/self/clear_refs", "w") as clear_refs:
            clear_refs.write("5")
    except OSError:
        return None
    before = _status_kib("VmRSS")
    call()
    peak = _status_kib("VmHWM")
    if before is None or peak is None:
        return None
    return max(0, peak - before) / 1024


# ---------------------------------------------------------------------------------------------
# Inputs


def _inputs(config: Config, seed: int = 0) -> tuple[np.ndarray, np.ndarray | None]:
    rng = np.random.default_rng(seed)
    X = rng.standard_normal((config.batch_size, config.length, config.num_hiddens))
    X = X.astype("float32")
    valid_lens = None
    if config.valid_lens:
        # Between half the length and the full length: every row keeps some keys
        low = max(1, config.length // 2)
        valid_lens = rng.integers(low, config.length + 1, config.batch_size).astype("int64")
    return X, valid_lens


def _weights(config: Config, seed: int = 0) -> dict[str, np.ndarray]:
    from mha import random_weights

    d = config.num_hiddens
    return random_weights(
        "MultiHeadAttention",
        num_hiddens=d,
        num_heads=config.num_heads,
        query_size=d,
        key_size=d,
        value_size=d,
        seed=seed,
        dtype=config.dtype,
    )


# ---------------------------------------------------------------------------------------------
# torch


def _torch_calls(config: Config, mode: str) -> dict[str, dict[str, Callable[[], Any]]]:
    import torch
    import torch.nn.functional as F
    from torch import nn

    import mha

    module = load_backend("torch")
    device = "cuda" if config.device == "gpu" else "cpu"
    X_np, lens_np = _inputs(config)
    X = torch.from_numpy(X_np).to(device, getattr(torch, config.dtype))
    valid_lens = None if lens_np is None else torch.from_numpy(lens_np).to(device)
    d, h = config.num_hiddens, config.num_heads
    ours = module.MultiHeadAttention(
        d, h, query_size=d, key_size=d, value_size=d, dtype=config.dtype
    ).eval()
    mha.set_weights(ours, _weights(config))
    ours.to(device)
    # The built-ins hold mha's weights, so that every layer computes the same numbers
    theirs = mha.interop.to_torch(ours, batch_first=True).to(device).eval()

    # Masks are made from valid_lens inside each timed call, as mha makes its own: a batch's
    # lengths change from batch to batch
    def padding_mask():
        # key_padding_mask: True = ignore that key
        if valid_lens is None:
            return None
        return torch.arange(config.length, device=device)[None, :] >= valid_lens[:, None]

    class SDPAttention(nn.Module):
        """Multi-head self-attention on F.scaled_dot_product_attention, packed projections."""

        def __init__(self):
            super().__init__()
            # Named as nn.MultiheadAttention's packed in_proj_weight and out_proj.weight
            self.in_proj_weight = nn.Parameter(torch.empty(3 * d, d))
            self.out_proj = nn.Linear(d, d, bias=False)

        def forward(self, X, keep=None):
            b, n, _ = X.shape
            # Shape of q, k, v: (batch_size, num_heads, length, num_hiddens / num_heads)
            q, k, v = (
                F.linear(X, self.in_proj_weight).view(b, n, 3, h, d // h).permute(2, 0, 3, 1, 4)
            )
            output = F.scaled_dot_product_attention(q, k, v, attn_mask=keep)
            return self.out_proj(output.transpose(1, 2).reshape(b, n, d))

    sdpa = SDPAttention().to(device, X.dtype).eval()
    sdpa.load_state_dict(theirs.state_dict())

    def run_ours():
        return ours(X, X, X, valid_lens, need_weights=config.need_weights)

    held = {}  # the weights the built-in returns, kept until the next call as mha keeps its own

    def run_theirs():
        output, held["weights"] = theirs(
            X,
            X,
            X,
            key_padding_mask=padding_mask(),
            need_weights=config.need_weights,
            average_attn_weights=False,
        )
        return output

    def run_sdpa():
        padding = padding_mask()
        return sdpa(X, None if padding is None else (~padding)[:, None, None, :])

    layers = {"mha": (run_ours, ours), "nn.MultiheadAttention": (run_theirs, theirs)}
    if not config.need_weights:
        layers["SDPA layer"] = (run_sdpa, sdpa)

    # A GPU runs asynchronously: a timed call ends when the device has finished its work
    synchronize = torch.cuda.synchronize if device == "cuda" else lambda: None

    def inference(run):
        def call():
            with torch.no_grad():
                output = run()
            synchronize()
            return output

        return call

    def training(run, layer):
        parameters = list(layer.parameters())

        def call():
            X.requires_grad_(True)
            try:
                loss = run().sum()
                gradients = torch.autograd.grad(loss, [X, *parameters])
                synchronize()
                return gradients
            finally:
                X.requires_grad_(False)

        return call

    return {
        "forward": {name: inference(run) for name, (run, _) in layers.items()},
        "forward+backward": {name: training(run, layer) for name, (run, layer) in layers.items()},
    }


# ---------------------------------------------------------------------------------------------
# tensorflow


def _tensorflow_calls(config: Config, mode: str) -> dict[str, dict[str, Callable[[], Any]]]:
    import mha

    module = load_backend("tensorflow")
    tf = module.tf
    # Every variable, constant and op on that device: TensorFlow would pick a GPU by itself
    device = "/GPU:0" if config.device == "gpu" else "/CPU:0"
    X_np, lens_np = _inputs(config)
    with tf.device(device):
        X = tf.constant(X_np, dtype=config.dtype)
        valid_lens = None if lens_np is None else tf.constant(lens_np)
        d, h = config.num_hiddens, config.num_heads
        ours = module.MultiHeadAttention(
            d, h, query_size=d, key_size=d, value_size=d, dtype=config.dtype
        )
        mha.set_weights(ours, _weights(config))
        # The built-in holds mha's weights, so that both compute the same numbers
        theirs = mha.interop.to_keras(ours)

    # The mask is made from valid_lens inside each timed call, as mha makes its own
    def attention_mask():
        # (batch_size, queries, keys): True = attend
        if valid_lens is None:
            return None
        keep = tf.range(config.length)[None, :] < tf.cast(valid_lens, tf.int32)[:, None]
        return tf.tile(keep[:, None, :], [1, config.length, 1])

    def run_ours(training=False):
        return ours(X, X, X, valid_lens, need_weights=config.need_weights, training=training)

    held = {}  # the weights the built-in returns, kept until the next call as mha keeps its own

    def run_theirs(training=False):
        outputs = theirs(
            X,
            X,
            attention_mask=attention_mask(),
            return_attention_scores=config.need_weights,
            training=training,
        )
        if not config.need_weights:
            return outputs
        output, held["weights"] = outputs
        return output

    layers = {"mha": (run_ours, ours), "keras MultiHeadAttention": (run_theirs, theirs)}

    def compiled(run):
        return tf.function(run) if mode == "tf.function" else run

    # Reading the results to the host (.numpy()) also waits for a GPU to finish the call
    def inference(run):
        run = compiled(run)

        def call():
            with tf.device(device):
                return run().numpy()

        return call

    def training(run, layer):
        def step():
            with tf.GradientTape() as tape:
                tape.watch(X)
                loss = tf.reduce_sum(run(training=True))
            return tape.gradient(loss, [X, *layer.trainable_variables])

        step = compiled(step)

        def call():
            with tf.device(device):
                return [g.numpy() for g in step()]

        return call

    return {
        "forward": {name: inference(run) for name, (run, _) in layers.items()},
        "forward+backward": {name: training(run, layer) for name, (run, layer) in layers.items()},
    }


# ---------------------------------------------------------------------------------------------
# mxnet: the book's Gluon multi-head attention (d2l, "Multi-Head Attention"), as a HybridBlock


def _d2l_gluon_attention(mx, num_hiddens: int, num_heads: int, return_weights: bool = False):
    """d2l's Gluon MultiHeadAttention, written for hybridization (npx.reshape codes).

    valid_lens is (batch_size, no. of queries) int32, as d2l's 2-D lengths; the masked softmax
    is MXNet's own fused one, npx.softmax(..., use_length=True). The book keeps the weights as
    an attribute, which only an imperative block can hand out; `return_weights` also returns
    them, (batch_size * num_heads, no. of queries, no. of keys), the one way a hybridized
    block can, so that it does the work of mha's need_weights=True.
    """
    from mxnet.gluon import nn

    head_size = num_hiddens // num_heads

    def transpose_qkv(F, X):
        # (batch_size, n, num_hiddens) -> (batch_size * num_heads, n, num_hiddens / num_heads)
        X = F.npx.reshape(X, (-2, -2, num_heads, -1))
        X = F.np.transpose(X, (0, 2, 1, 3))
        return F.npx.reshape(X, (-5, -2, -2))

    def transpose_output(F, X):
        # Reverse transpose_qkv
        X = F.npx.reshape(X, (-6, -1, num_heads, -2, -2))
        X = F.np.transpose(X, (0, 2, 1, 3))
        return F.npx.reshape(X, (-2, -2, -1))

    @mx.util.use_np
    class DotProductAttention(nn.HybridBlock):
        def hybrid_forward(self, F, queries, keys, values, valid_lens=None):
            scores = F.npx.batch_dot(queries, keys, transpose_b=True) / math.sqrt(head_size)
            if valid_lens is None:
                weights = F.npx.softmax(scores)
            else:
                weights = F.npx.softmax(scores, valid_lens, use_length=True)
            self.attention_weights = weights
            return F.npx.batch_dot(weights, values)

    def dense():
        return nn.Dense(num_hiddens, use_bias=False, flatten=False, in_units=num_hiddens)

    @mx.util.use_np
    class MultiHeadAttention(nn.HybridBlock):
        def __init__(self):
            super().__init__()
            self.attention = DotProductAttention()
            self.W_q, self.W_k, self.W_v, self.W_o = dense(), dense(), dense(), dense()

        def hybrid_forward(self, F, queries, keys, values, valid_lens=None):
            queries = transpose_qkv(F, self.W_q(queries))
            keys = transpose_qkv(F, self.W_k(keys))
            values = transpose_qkv(F, self.W_v(values))
            if valid_lens is not None:
                # On axis 0, copy each item num_heads times (d2l)
                valid_lens = F.np.repeat(valid_lens, num_heads, axis=0)
            output = self.attention(queries, keys, values, valid_lens)
            output = self.W_o(transpose_output(F, output))
            return (output, self.attention.attention_weights) if return_weights else output

    block = MultiHeadAttention()
    block.initialize()
    return block


def _mxnet_calls(config: Config, mode: str) -> dict[str, dict[str, Callable[[], Any]]]:
    import mha

    module = load_backend("mxnet")
    mx = module.mx
    from mxnet import autograd

    X_np, lens_np = _inputs(config)
    X = mx.np.array(X_np, dtype="float32")
    valid_lens = None if lens_np is None else mx.np.array(lens_np, dtype="int64")
    d, h = config.num_hiddens, config.num_heads
    weights = _weights(config)
    ours = module.MultiHeadAttention(d, h, query_size=d, key_size=d, value_size=d)
    mha.set_weights(ours, weights)
    # Hybridized, the book's block hands out weights only as a second output
    returns_weights = config.need_weights and mode == "hybridized"
    theirs = _d2l_gluon_attention(mx, d, h, return_weights=returns_weights)
    for name in ("q", "k", "v", "o"):
        getattr(theirs, f"W_{name}").weight.set_data(mx.np.array(weights[f"W_{name}"].T))
    # d2l's 2-D valid_lens: (batch_size, no. of queries)
    their_lens = None
    if lens_np is not None:
        lengths = np.repeat(lens_np[:, None], config.length, axis=1).astype("int32")
        their_lens = mx.np.array(lengths, dtype="int32")
    if mode == "hybridized":
        ours.hybridize()
        theirs.hybridize()

    def run_ours():
        return ours(X, X, X, valid_lens, need_weights=config.need_weights)

    held = {}  # the weights the block returns, kept until the next call as mha keeps its own

    def run_theirs():
        if returns_weights:
            output, attention_weights = theirs(X, X, X, their_lens)
            held["weights"] = attention_weights
        else:
            output = theirs(X, X, X, their_lens)
            # The book's block keeps its weights as an attribute (imperatively only)
            attention_weights = theirs.attention.attention_weights
        if config.need_weights:
            attention_weights.wait_to_read()
        return output

    layers = {"mha": (run_ours, ours), "d2l Gluon MultiHeadAttention": (run_theirs, theirs)}

    def inference(run):
        def call():
            output = run()
            # Everything the call pushed to MXNet's asynchronous engine, the freeing of its
            # large temporaries included, is done inside the timed call, not in the next one
            mx.nd.waitall()
            return output

        return call

    def training(run, layer):
        parameters = list(layer.collect_params().values())

        def call():
            X.attach_grad()
            with autograd.record(train_mode=False):
                output = run()
            output.backward()
            mx.nd.waitall()
            return [X.grad, *(p.grad() for p in parameters)]

        return call

    return {
        "forward": {name: inference(run) for name, (run, _) in layers.items()},
        "forward+backward": {name: training(run, layer) for name, (run, layer) in layers.items()},
    }


# ---------------------------------------------------------------------------------------------
# numpy: the forward pass against the FLOP rate of a large matrix product


def matmul_roofline_gflops(size: int = 2048, repeats: int = 5) -> float:
    """The float32 FLOP rate of a (size x size) @ (size x size) matrix product, in GFLOP/s."""
    rng = np.random.default_rng(0)
    a = rng.standard_normal((size, size)).astype("float32")
    b = rng.standard_normal((size, size)).astype("float32")
    a @ b
    seconds = []
    for _ in range(repeats):
        begin = time.perf_counter()
        a @ b
        seconds.append(time.perf_counter() - begin)
    return 2.0 * size**3 / min(seconds) / 1e9


ROOFLINE = "matmul roofline"
# NumPy's target: half the roofline's FLOP rate at the larger shapes
HALF_ROOFLINE = 0.5
ROOFLINE_SIZE = 2048


def _numpy_calls(config: Config, mode: str) -> dict[str, dict[str, Callable[[], Any]]]:
    import mha

    module = load_backend("numpy")
    X, valid_lens = _inputs(config)
    d, h = config.num_hiddens, config.num_heads
    ours = module.MultiHeadAttention(d, h, query_size=d, key_size=d, value_size=d)
    mha.set_weights(ours, _weights(config))
    rng = np.random.default_rng(0)
    a, b = (rng.standard_normal((ROOFLINE_SIZE,) * 2).astype("float32") for _ in range(2))
    return {
        "forward": {
            "mha": lambda: ours(X, X, X, valid_lens, need_weights=config.need_weights),
            ROOFLINE: lambda: a @ b,
        }
    }


_CALLS = {
    "numpy": _numpy_calls,
    "torch": _torch_calls,
    "tensorflow": _tensorflow_calls,
    "mxnet": _mxnet_calls,
}
MODES = {
    "numpy": ("reference",),
    "torch": ("eager",),
    "tensorflow": ("eager",),
    "mxnet": ("imperative", "hybridized"),
}
# The passes each backend's calls time: numpy's row is the forward pass against the roofline
BACKEND_PASSES = {
    "numpy": ("forward",),
    "torch": PASSES,
    "tensorflow": PASSES,
    "mxnet": PASSES,
}


# ---------------------------------------------------------------------------------------------
# Running


def configs(
    shapes: Sequence[tuple[int, int, int, int]],
    dtype: str = "float32",
    device: str = "cpu",
    valid_lens: Sequence[bool] = (False, True),
    need_weights: Sequence[bool] = (True, False),
) -> list[Config]:
    return [
        Config(*shape, with_lens, weights, dtype, device)
        for shape in shapes
        for with_lens in valid_lens
        for weights in need_weights
    ]


DTYPES = ("float32", "bfloat16", "float16")
DEVICES = ("cpu", "gpu")


def unsupported(backend: str, dtype: str = "float32", device: str = "cpu") -> str | None:
    """Why `backend` cannot be benchmarked in `dtype` on `device` here; None when it can."""
    if backend in ("numpy", "mxnet") and (dtype, device) != ("float32", "cpu"):
        # numpy's row is a fraction of a float32 product; MXNet 1.9's float16 layers need a
        # GPU build of MXNet
        return "benchmarked in float32 on the CPU only"
    if device == "gpu" and backend == "torch":
        import torch

        if not torch.cuda.is_available():
            return "torch sees no GPU"
    if device == "gpu" and backend == "tensorflow":
        if not load_backend("tensorflow").tf.config.list_physical_devices("GPU"):
            return "TensorFlow sees no GPU"
    return None


def unselected(backend: str, mode: str | None = None, pass_: str | None = None) -> str | None:
    """Why `backend` has no row in `mode` and `pass_` (None: any); None when it has one."""
    if mode is not None and mode not in MODES[backend]:
        return f"has no {mode} mode (its modes: {', '.join(MODES[backend])})"
    if pass_ is not None and pass_ not in BACKEND_PASSES[backend]:
        return f"has no {pass_} pass (its passes: {', '.join(BACKEND_PASSES[backend])})"
    return None


def device_name(device: str, backends: Sequence[str]) -> str:
    """What `device` is: "cpu", or the GPU's name as torch (else TensorFlow) gives it."""
    if device == "cpu":
        return "cpu"
    if "torch" in backends:
        import torch

        return torch.cuda.get_device_name(0)
    tf = load_backend("tensorflow").tf
    details = tf.config.experimental.get_device_details(tf.config.list_physical_devices("GPU")[0])
    return details.get("device_name", "GPU")


def _peak_mib(backend: str, config: Config, call: Callable[[], Any]) -> float | None:
    """Peak memory of one call: of the process on the CPU (peak_memory_mib), of the
    framework's allocator on the GPU, above what it held before the call."""
    if config.device == "cpu":
        return peak_memory_mib(call)
    if backend == "torch":
        import torch

        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        call()
        return (torch.cuda.max_memory_allocated() - before) / 2**20
    experimental = load_backend("tensorflow").tf.config.experimental
    experimental.reset_memory_stats("GPU:0")
    before = experimental.get_memory_info("GPU:0")["current"]
    call()
    return (experimental.get_memory_info("GPU:0")["peak"] - before) / 2**20


def run(
    backends: Sequence[str] = BACKENDS,
    shapes: Sequence[tuple[int, int, int, int]] = SHAPES,
    budget: Budget | None = None,
    memory: bool = True,
    progress: Callable[[int, int, str], None] | None = None,
    dtype: str = "float32",
    device: str = "cpu",
    valid_lens: Sequence[bool] = (False, True),
    need_weights: Sequence[bool] = (True, False),
    passes: Sequence[str] = PASSES,
    modes: Sequence[str] | None = None,
) -> tuple[list[Result], dict[str, Any]]:
    """Run the benchmarks; returns the rows and facts about the machine (roofline included).
    Every backend must support `dtype` on `device` (see `unsupported`). `valid_lens`,
    `need_weights`, `passes` and `modes` (None: each backend's every mode) select the rows:
    one row's configuration, timed again on its own, is one of each."""
    budget = budget or Budget()
    cases = [
        (backend, mode, config)
        for backend in backends
        for mode in MODES[backend]
        if modes is None or mode in modes
        for config in configs(shapes, dtype, device, valid_lens, need_weights)
    ]
    results: list[Result] = []
    roofline = matmul_roofline_gflops(ROOFLINE_SIZE if budget.max_repeats > 3 else 512)
    for index, (backend, mode, config) in enumerate(cases):
        description = f"{backend} {mode} {config.shape} valid_lens={config.valid_lens} "
        description += f"need_weights={config.need_weights}"
        if progress:
            progress(index, len(cases), description)
        calls = _CALLS[backend](config, mode)
        for pass_, by_name in calls.items():
            if pass_ not in passes:
                continue
            faults: dict[str, list[int]] = {}
            times = _interleaved_times(by_name, budget, faults)
            peaks = {
                name: _peak_mib(backend, config, call) if memory else None
                for name, call in by_name.items()
                if name != ROOFLINE
            }
            rows = _rows(backend, mode, config, pass_, times, peaks)
            if faults:
                for row in rows:
                    row.mha_faults = statistics.median(faults["mha"])
                    if row.builtin != ROOFLINE:  # the product is no layer
                        row.builtin_faults = statistics.median(faults[row.builtin])
            results.extend(rows)
        del calls
    if progress:
        progress(len(cases), len(cases), "done")
    return results, machine(roofline, device_name(device, backends))


def _rows(backend, mode, config, pass_, times, peaks) -> list[Result]:
    ours = times["mha"]
    median = {name: statistics.median(values) for name, values in times.items()}
    if backend == "numpy":
        # The fraction of the roofline reached, round by round: (flops / t_mha) / (rate of
        # the product in the same round) = t_product / t_mha x (flops / product's flops)
        product = 2.0 * ROOFLINE_SIZE**3
        scale = config.forward_flops() / product
        fraction = paired_ratio(times[ROOFLINE], ours) * scale
        low, high = paired_ratio_interval(times[ROOFLINE], ours)
        achieved = config.forward_flops() / median["mha"] / 1e9
        rate = product / median[ROOFLINE] / 1e9
        return [
            Result(
                backend,
                mode,
                config,
                pass_,
                ROOFLINE,
                median["mha"] * 1e3,
                None,
                fraction,
                peaks["mha"],
                None,
                len(ours),
                note=f"{achieved:.1f} of {rate:.1f} GFLOP/s",
                ratio_interval=(low * scale, high * scale),
            )
        ]
    return [
        Result(
            backend,
            mode,
            config,
            pass_,
            name,
            median["mha"] * 1e3,
            median[name] * 1e3,
            paired_ratio(ours, theirs),
            peaks["mha"],
            peaks[name],
            len(ours),
            ratio_interval=paired_ratio_interval(ours, theirs),
        )
        for name, theirs in times.items()
        if name != "mha"
    ]


def machine(roofline: float | None = None, device: str = "cpu") -> dict[str, Any]:
    """What the numbers were measured on; `device` is "cpu" or the GPU's name."""
    cpuinfo = _read_cpuinfo()
    facts: dict[str, Any] = {
        "platform": platform.platform(),
        "processor": _cpu_name(cpuinfo),
        "vector_extensions": _vector_extensions(cpuinfo),
        "cpu_count": os.cpu_count(),
        "device": device,
        "python": platform.python_version(),
        "numpy": np.__version__,
    }
    from mha.registry import framework_version

    for name in BACKENDS:
        if name != "numpy":
            facts[name] = framework_version(name)
    if roofline is not None:
        facts["matmul_roofline_gflops"] = round(roofline, 1)
    return facts


def _cpu_name(cpuinfo: str) -> str:
    match = re.search(r"^model name\s*:\s*(.+)$", cpuinfo, re.MULTILINE)
    return match.group(1).strip() if match else platform.processor() or "unknown"


# The processor's vector extensions that decide which kernels the frameworks run: two
# processors of one name ("AMD EPYC") may differ in them, and so may every figure
VECTOR_EXTENSIONS = ("avx2", "fma", "avx512f", "avx512_bf16", "avx512_fp16", "amx_bf16", "sve")


def _vector_extensions(cpuinfo: str) -> list[str]:
    """Those of VECTOR_EXTENSIONS among the flags of /proc/cpuinfo (x86) or its features
    (Arm), in that order; none where the platform has no /proc/cpuinfo."""
    match = re.search(r"^(?:flags|Features)\s*:(.*)$", cpuinfo, re.MULTILINE)
    flags = set(match.group(1).split()) if match else set()
    return [name for name in VECTOR_EXTENSIONS if name in flags]


def _read_cpuinfo() -> str:
    with contextlib.suppress(OSError), open("/proc/cpuinfo") as cpuinfo:
        return cpuinfo.read()
    return ""


# ---------------------------------------------------------------------------------------------
# Memory at long lengths (torch, need_weights=False)


def run_memory_scaling(
    lengths: Sequence[int] = (1024, 2048, 4096, 8192),
    num_hiddens: int = 512,
    num_heads: int = 8,
    progress: Callable[[int, int, str], None] | None = None,
    dtype: str = "float32",
    device: str = "cpu",
) -> list[dict[str, Any]]:
    """Peak memory of one forward pass (batch 1, need_weights=False) at growing lengths.

    mha's torch layer against nn.MultiheadAttention and the SDPA layer. A (length x length)
    matrix per head would be num_heads * length**2 * 4 bytes in float32: 2 GiB at 8192.
    """
    itemsize = 4 if dtype == "float32" else 2
    rows = []
    for index, length in enumerate(lengths):
        if progress:
            progress(index, len(lengths), f"torch memory at length {length}")
        config = Config(1, length, num_hiddens, num_heads, True, False, dtype, device)
        calls = _torch_calls(config, "eager")["forward"]
        one_matrix_per_head = num_heads * length**2 * itemsize / 2**20
        row = {"length": length, "one_matrix_per_head_mib": one_matrix_per_head}
        for name, call in calls.items():
            call()  # warm-up: the allocator's first-use growth is not the layer's
            row[name] = _peak_mib("torch", config, call)
        rows.append(row)
    if progress:
        progress(len(lengths), len(lengths), "done")
    return rows


# ---------------------------------------------------------------------------------------------
# Output


def _number(value: float | None, digits: int = 2) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def markdown_table(results: Sequence[Result]) -> str:
    """The rows as a markdown table; ratio = mha / built-in (numpy: fraction of the roofline),
    with its 95% confidence interval and what that interval says (Result.verdict)."""
    header = (
        "| backend | mode | (B, L, d, h) | valid_lens | need_weights | pass | built-in "
        "| mha ms | built-in ms | ratio | 95% interval | verdict | mha MiB | built-in MiB |"
    )
    lines = [header, "|" + "---|" * 14]
    for r in results:
        builtin_ms = r.note if r.builtin_ms is None and r.note else _number(r.builtin_ms)
        # Three decimals: what decides a verdict is often below 1%
        interval = (
            "-"
            if r.ratio_interval is None
            else " to ".join(_number(end, 3) for end in r.ratio_interval)
        )
        lines.append(
            f"| {r.backend} | {r.mode} | {r.config.shape}"
            f" | {'yes' if r.config.valid_lens else 'no'}"
            f" | {r.config.need_weights} | {r.pass_} | {r.builtin} | {_number(r.mha_ms)}"
            f" | {builtin_ms} | {_number(r.ratio, 3)} | {interval} | {r.verdict}"
            f" | {_number(r.mha_peak_mib, 1)} | {_number(r.builtin_peak_mib, 1)} |"
        )
    return "\n".join(lines)


def summary(results: Sequence[Result]) -> list[str]:
    """One line per backend: how many of its rows have each verdict."""
    lines = []
    for backend in dict.fromkeys(r.backend for r in results):
        verdicts = [r.verdict for r in results if r.backend == backend]
        if backend == "numpy":
            against, names = "half the roofline", ["above half", "tie with half", "below half"]
        else:
            against, names = "the built-ins", ["faster", "tie", "slower"]
        names += [name for name in ("-", TOO_FEW_ROUNDS) if name in verdicts]
        counts = ", ".join(f"{name} {verdicts.count(name)}" for name in names)
        rows = f"{len(verdicts)} row" + ("s" if len(verdicts) != 1 else "")
        lines.append(f"{backend}, {rows} against {against}: {counts}")
    return lines


def memory_table(rows: Sequence[dict[str, Any]]) -> str:
    names = [k for k in rows[0] if k not in ("length", "one_matrix_per_head_mib")]
    lines = [
        "| length | (L x L) x heads, MiB | " + " | ".join(f"{n} MiB" for n in names) + " |",
        "|" + "---|" * (len(names) + 2),
    ]
    for row in rows:
        values = " | ".join(_number(row[n], 1) for n in names)
        lines.append(f"| {row['length']} | {row['one_matrix_per_head_mib']:.0f} | {values} |")
    return "\n".join(lines)


def report(results, facts, memory_rows=None) -> dict[str, Any]:
    return {
        "machine": facts,
        "results": [r.as_dict() for r in results],
        "memory_scaling": memory_rows or [],
    }


# ---------------------------------------------------------------------------------------------
# Command line (`mha bench`, `python benchmarks/run.py`)


def add_arguments(parser) -> None:
    """The options of `mha bench`."""
    parser.add_argument(
        "--backends", help="comma-separated backends (default: every installed one)"
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help="one tiny shape, few repeats: a smoke run of every code path in seconds",
    )
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    parser.add_argument("--output", help="also write the JSON report to this file")
    parser.add_argument(
        "--shapes",
        help="semicolon-separated B,L,d,h shapes (default: 32,64,256,8;8,512,512,8;1,4096,512,8)",
    )
    parser.add_argument("--seconds", type=float, help="time budget per measurement")
    # Row selection: one of each times one row's configuration again on its own
    parser.add_argument(
        "--valid-lens",
        choices=("yes", "no"),
        help="only the rows with (yes) or without (no) valid_lens (default: both)",
    )
    parser.add_argument(
        "--need-weights",
        choices=("true", "false"),
        help="only the rows with need_weights True or False (default: both)",
    )
    parser.add_argument(
        "--pass",
        dest="pass_",
        choices=PASSES,
        help="only the forward or the forward+backward rows (default: both)",
    )
    parser.add_argument(
        "--mode",
        choices=sorted({mode for modes in MODES.values() for mode in modes}),
        help="only the rows of this mode, as the table's mode column names it: MXNet's "
        "imperative or hybridized (default: every mode)",
    )
    parser.add_argument(
        "--memory-scaling",
        action="store_true",
        help="also measure torch peak memory at lengths 1024 to 8192 (need_weights=False)",
    )
    parser.add_argument("--no-memory", action="store_true", help="skip the peak-memory calls")
    parser.add_argument(
        "--dtype", choices=DTYPES, help="of the layers, inputs and weights (default: float32)"
    )
    parser.add_argument(
        "--device",
        choices=DEVICES,
        help="where torch and TensorFlow run (default: cpu); numpy and mxnet: cpu only",
    )
    parser.add_argument(
        "--malloc-defaults",
        action="store_true",
        help="leave glibc's malloc thresholds dynamic and its arenas one per thread, as in a "
        "process that does not fix them (default: fixed, so that no row depends on what ran "
        "before it)",
    )
    parser.add_argument(
        "--report",
        metavar="FILE",
        help="show the tables of a saved JSON report (from --output) instead of running",
    )


def _parse_shapes(text: str) -> list[tuple[int, int, int, int]]:
    shapes = []
    for part in text.split(";"):
        values = tuple(int(v) for v in part.split(","))
        if len(values) != 4 or min(values) <= 0 or values[2] % values[3]:
            raise ValueError(
                f"a shape is four positive integers B,L,d,h with h dividing d. Received: {part!r}"
            )
        shapes.append(values)
    return shapes


def execute(arguments, out, err, progress=None) -> int:
    """Run `mha bench` with parsed arguments; raises ValueError/BackendUnavailableError on
    usage errors."""
    if arguments.report:
        return _show_saved_report(arguments, out)
    # Before any framework is imported: see steady_allocator
    allocator = steady_allocator(fix=not arguments.malloc_defaults)
    names, skipped = select_backends(arguments.backends)
    dtype, device = arguments.dtype or "float32", arguments.device or "cpu"
    _drop_backends(
        names,
        skipped,
        lambda name: unsupported(name, dtype, device),
        named=bool(arguments.backends),
        asked=f" (asked: {dtype} on the {device})",
        none_left=f"no backend can run in {dtype} on the {device} here",
    )
    _drop_backends(
        names,
        skipped,
        lambda name: unselected(name, arguments.mode, arguments.pass_),
        named=bool(arguments.backends),
        asked="",
        none_left="no backend has the rows asked for",
    )
    if arguments.shapes:
        shapes = _parse_shapes(arguments.shapes)
    else:
        shapes = QUICK_SHAPES if arguments.quick else SHAPES
    budget = dataclasses.replace(QUICK_BUDGET) if arguments.quick else Budget()
    if arguments.seconds is not None:
        budget.seconds = arguments.seconds
    results, facts = run(
        names,
        shapes,
        budget,
        not arguments.no_memory,
        progress,
        dtype=dtype,
        device=device,
        valid_lens=_chosen(arguments.valid_lens, {"no": False, "yes": True}),
        need_weights=_chosen(arguments.need_weights, {"true": True, "false": False}),
        passes=PASSES if arguments.pass_ is None else (arguments.pass_,),
        modes=None if arguments.mode is None else (arguments.mode,),
    )
    memory_rows = None
    if arguments.memory_scaling and "torch" in names:
        lengths = (64, 128) if arguments.quick else (1024, 2048, 4096, 8192)
        memory_rows = run_memory_scaling(lengths, progress=progress, dtype=dtype, device=device)
    facts["malloc"] = allocator
    document = report(results, facts, memory_rows)
    document["skipped"] = skipped
    _write_or_print(document, arguments, out)
    return 0


def _drop_backends(
    names: list[str],
    skipped: dict[str, str],
    reason_of: Callable[[str], str | None],
    *,
    named: bool,
    asked: str,
    none_left: str,
) -> None:
    """Move each backend that `reason_of` gives a reason for from `names` to `skipped`. One
    named in --backends (`named`) is a usage error instead, and so is none left."""
    for name in list(names):
        reason = reason_of(name)
        if reason and named:
            raise ValueError(f"--backends {name}: {reason}{asked}")
        if reason:
            names.remove(name)
            skipped[name] = reason
    if not names:
        reasons = "; ".join(f"{name}: {reason}" for name, reason in skipped.items())
        raise ValueError(f"{none_left} ({reasons})")


def _chosen(option: str | None, values: dict[str, Any]) -> tuple:
    """The values that --valid-lens or --need-weights leaves: both when it is not given."""
    return tuple(values.values()) if option is None else (values[option],)


# Options that choose what to run: they mean nothing with --report
_RUN_OPTIONS = (
    "backends",
    "quick",
    "shapes",
    "seconds",
    "valid_lens",
    "need_weights",
    "pass_",
    "mode",
    "memory_scaling",
    "no_memory",
    "dtype",
    "device",
    "malloc_defaults",
)


def _show_saved_report(arguments, out) -> int:
    """`mha bench --report FILE`: a saved JSON report's tables and verdicts, without running
    (with --output, the report is written again, each row with its verdict)."""
    values = {name: getattr(arguments, name) for name in _RUN_OPTIONS}
    given = [name for name, value in values.items() if value is not None and value is not False]
    if given:
        options = ", ".join("--" + name.strip("_").replace("_", "-") for name in given)
        raise ValueError(f"--report shows a saved report and runs nothing: drop {options}")
    try:
        with open(arguments.report) as file:
            document = json.load(file)
        results = [Result.from_dict(row) for row in document["results"]]
    except (OSError, ValueError, KeyError, TypeError) as error:
        raise ValueError(
            f"{arguments.report} is not a report written by `mha bench --output`: {error}"
        ) from None
    document["results"] = [r.as_dict() for r in results]
    _write_or_print(document, arguments, out)
    return 0


def _write_or_print(document: dict[str, Any], arguments, out) -> None:
    """Write the report to --output if given; print it as JSON (--json) or as tables."""
    if arguments.output:
        with open(arguments.output, "w") as file:
            json.dump(document, file, indent=2)
            file.write("\n")
    if arguments.json:
        print(json.dumps(document, indent=2), file=out)
        return
    facts = document["machine"]
    results = [Result.from_dict(row) for row in document["results"]]
    extensions = facts.get("vector_extensions")
    if extensions is None:  # reports written before they were recorded lack them
        vector = "vector extensions not recorded"
    else:
        vector = ", ".join(extensions) or "none of " + ", ".join(VECTOR_EXTENSIONS)
    print(
        f"Machine: {facts['processor']} ({vector}), {facts['cpu_count']} CPU cores; matmul "
        f"roofline {facts['matmul_roofline_gflops']} GFLOP/s (float32)",
        file=out,
    )
    if facts.get("malloc"):  # reports written before the allocator was recorded lack it
        print(f"malloc: {facts['malloc']}", file=out)
    settings = sorted({(r.config.dtype, r.config.device) for r in results})
    on = {"cpu": "the CPU", "gpu": facts.get("device", "a GPU")}
    print(
        "Layers, inputs and weights in "
        + ", ".join(f"{dtype} on {on[device]}" for dtype, device in settings),
        file=out,
    )
    print(
        "ratio = mha / built-in (below 1.0: mha is faster); numpy: fraction of the roofline. "
        "An interval that holds 1.0 is a tie. Each interval is a 95% one: a row whose layers\n"
        "truly tie still reads slower in 1 run of 40, so time a row marked slower again on its\n"
        "own before reading it as slower (benchmarks/README.md, 'Many rows, one chance each').",
        file=out,
    )
    print(markdown_table(results), file=out)
    print("\n" + "\n".join(summary(results)), file=out)
    if document.get("memory_scaling"):
        print("\nPeak memory of one torch forward pass, batch 1, need_weights=False:", file=out)
        print(memory_table(document["memory_scaling"]), file=out)
    for name, reason in document.get("skipped", {}).items():
        print(f"skipped {name}: {reason}", file=out)


def main(argv: Sequence[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(prog="benchmarks/run.py", description=__doc__.split("\n")[0])
    add_arguments(parser)
    arguments = parser.parse_args(argv)

    def progress(done: int, total: int, description: str) -> None:
        print(f"[{done}/{total}] {description}", file=sys.stderr, flush=True)

    try:
        return execute(arguments, sys.stdout, sys.stderr, progress)
    except (ValueError, BackendUnavailableError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
