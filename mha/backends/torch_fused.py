"""torch's fast paths for DotProductAttention.attend, apart from the layers a learner reads:
F.scaled_dot_product_attention (with its own causal mask, or with mha's mask) and the mask
added inside one batched product, and which of them may compute a call without letting what a
masked key holds reach an output.

`choose_path` decides once per call; `pairs_heads` whether fewer key-value heads reach SDPA as
they are; `attend` computes the fused paths (None when the path is not one of them);
`masked_product` gives the scores of the masked-product path, which the layer then pools as
the book does.
"""

from __future__ import annotations

import contextlib
import math
import sys

import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensor
from torch.nn.attention import SDPBackend

__all__ = [
    "attend",
    "choose_path",
    "keep_every_row",
    "masked_product",
    "may_have_empty_rows",
    "pairs_heads",
    "takes_is_causal",
]


def masked_product(queries, keys, keep, rows_kept=False):
    """The scores of the "masked product" path from the scaled queries, (..., Q, K), with -inf
    where keep is False, and the rows to zero after pooling (keep_every_row's; None when no
    row is empty)."""
    keys = _without_masked_keys(keys, keep)
    keep, attended = (None, None) if keep is None else keep_every_row(keep, rows_kept)
    return _masked_scores(keep, queries, keys), attended


def attend(queries, keys, values, keep, bias, dropout, path: str,
           rows_kept: bool = False) -> torch.Tensor | None:
    """The output of a call whose `path` (choose_path's) is "is_causal" or "fused", from its
    scaled queries; None for the other paths, which the layer computes itself. rows_kept:
    every row of keep is known to keep a key (masks.every_row_keeps_a_key)."""
    if path == "is_causal":
        if exporting():
            keys = _without_unreached_keys(queries, keys)
        return _sdpa(queries, keys, values, None, None, dropout, is_causal=True)
    if path == "fused":
        # The mask is added to the scores: keys masked for every query are zeroed first
        keys = _without_masked_keys(keys, keep)
        return _sdpa(queries, keys, values, keep, bias, dropout, rows_kept=rows_kept)
    return None


def _without_unreached_keys(queries: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """The keys, with 0 after the last query's position (top-left causal: keys Q and on),
    which no query attends. A decomposed exported program (run_decompositions, ExecuTorch's
    lowering) adds is_causal's -inf to the scores, and NaN + -inf is NaN; 0 + -inf is -inf."""
    reached = torch.arange(keys.shape[-2], device=keys.device) < queries.shape[-2]
    return torch.where(reached[:, None], keys, 0.0)


def keep_every_row(keep: torch.Tensor,
                   rows_kept: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A row with no kept key would be all -inf, NaN in softmax and in fused kernels: it keeps
    every key instead. Returns (keep, attended): attended, (..., Q or 1, 1), marks the rows to
    zero afterwards; None when no row is empty, or when rows_kept says none is."""
    if rows_kept:
        return keep, None
    attended = keep.any(dim=-1, keepdim=True)
    if not may_have_empty_rows(attended):
        return keep, None
    return keep | ~attended, attended


def building_a_graph() -> bool:
    """Whether this call is being made into a graph (torch.compile, torch.export, whose traced
    tensors have no values, or torch.jit.trace, whose graph keeps every branch its example
    took): no path may then hang on one input's values."""
    return torch.compiler.is_compiling() or torch.jit.is_tracing()


def functorch_wrapped(x: torch.Tensor) -> bool:
    """Whether x is one of torch.func's wrapped tensors (vmap, grad): a batched one has no
    values of its own to read, nor a storage for an out= argument. Dynamo traces only the
    test of a batched one (the others' warns), and a graph it builds holds no other."""
    if torch.compiler.is_compiling():
        return torch._C._functorch.is_batchedtensor(x)
    return _is_functorch_wrapped(x)


def values_unread(x: torch.Tensor) -> bool:
    """Whether no path may hang on x's values: off the CPU a read would wait for the device,
    a graph being built would keep one input's answer, and torch.func's tensors and fake
    ones (FakeTensorMode's, which say "cpu") have none."""
    return (x.device.type != "cpu" or building_a_graph() or functorch_wrapped(x)
            or isinstance(x, FakeTensor))


# torch.func has no public test of its tensors
_is_functorch_wrapped = getattr(torch._C._functorch, "is_functorch_wrapped_tensor",
                                lambda x: False)


def exporting_to_onnx() -> bool:
    """Whether this call is being exported to ONNX (by torch.export or by tracing)."""
    # torch.onnx is imported by its exporter: a process that never loaded it is not exporting
    onnx = sys.modules.get("torch.onnx")
    return building_a_graph() and onnx is not None and onnx.is_in_onnx_export()


def exporting() -> bool:
    """Whether torch.export traces this call (strict or not), read from its flag: before
    pytorch#176347 Dynamo answered torch.compiler.is_exporting() True in torch.compile too."""
    flag = getattr(torch.compiler, "_is_exporting_flag", None)
    return torch.compiler.is_exporting() if flag is None else bool(flag)


def may_have_empty_rows(attended: torch.Tensor) -> bool:
    """Whether a row has no kept key, or might. On the CPU one host read of the small
    `attended` answers it; elsewhere (GPU, meta, a graph being built) the answer is yes
    without reading: no call waits for the device, and no graph keeps one input's answer."""
    if values_unread(attended):
        return True
    return not bool(attended.all())


def _sdpa(queries, keys, values, keep, bias, dropout, is_causal=False, rows_kept=False):
    """What DotProductAttention.attend computes from its scaled queries, by
    F.scaled_dot_product_attention with scale 1 (with is_causal, its own causal mask and no
    other: see choose_path).

    Its boolean attn_mask means True = attend, like `keep`; its float attn_mask is added to the
    scores, so keep and bias combine into one float mask when both are given. Keys and values
    may have fewer heads (axis -3) than the queries where pairs_heads says so, query head h
    attending with key-value head h // group: its enable_gqa pairs them, or they are
    repeated first (the layers fold the other grouped calls' query heads before).
    """
    attended = None
    if keep is not None:
        # Rows with no kept key attend to every key (finite values and gradients), and their
        # output is zeroed after, as _softmax does
        keep, attended = keep_every_row(keep, rows_kept)
    attn_mask = keep
    if bias is not None and attended is not None:
        # An empty row keeps every key: its bias, which may hold anything at the keys the
        # other masks leave out (NaN, +inf), is 0 there, or the kernel's backward gives
        # every gradient 0 x NaN
        bias = torch.where(attended, bias, 0.0)
    if bias is not None:
        attn_mask = bias if keep is None else torch.where(keep, bias, float("-inf"))
    if attn_mask is not None and torch.compiler.is_compiling():
        # A graph being exported gets a mask row for every query: ONNX Runtime's Attention
        # kernel, which the ONNX exporter makes of this call, broadcasts no other
        rows = (*attn_mask.shape[:-2], queries.shape[-2], attn_mask.shape[-1])
        attn_mask = attn_mask.expand(rows)
    dropout_p = dropout.p if dropout.training else 0.0
    group = queries.shape[-3] // keys.shape[-3] if keys.dim() > 2 else 1
    # bool: torch.jit.trace gives sizes as tensors, which SDPA's flag may not be
    enable_gqa = bool(group > 1 and _kernel_pairs_heads(queries, keys, values, attn_mask,
                                                        dropout_p, is_causal))
    if group > 1 and not enable_gqa:
        keys, values = (x.repeat_interleave(group, dim=-3) for x in (keys, values))
    output = F.scaled_dot_product_attention(
        queries, keys, values, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal,
        scale=1.0, enable_gqa=enable_gqa,
    )
    return output if attended is None else torch.where(attended, output, 0.0)


def _kernel_pairs_heads(queries, keys, values, attn_mask, dropout_p, is_causal) -> bool:
    """Whether F.scaled_dot_product_attention pairs fewer key-value heads with the query heads
    (enable_gqa) in a kernel of its own: every kernel does on the CPU; elsewhere SDPA's own
    choice says (on CUDA flash without a mask, cuDNN with one). Its math fallback would be
    slower, and under is_causal would let a NaN key through: the heads are repeated then.
    While a graph is built, or where torch cannot say, half precision without a mask."""
    if queries.device.type == "cpu":
        return True
    if not building_a_graph():
        try:
            choice = torch._fused_sdp_choice(queries, keys, values, attn_mask, dropout_p,
                                             is_causal, enable_gqa=True)
            return choice in _OWN_KERNELS
        except (AttributeError, TypeError, RuntimeError, NotImplementedError):
            pass  # a torch without the choice, or without enable_gqa in it
    return attn_mask is None and queries.dtype in (torch.float16, torch.bfloat16)


# SDPA's kernels of its own, as _fused_sdp_choice names them (an older torch lacks cuDNN's)
_OWN_KERNELS = tuple(
    int(getattr(SDPBackend, name))
    for name in ("FLASH_ATTENTION", "EFFICIENT_ATTENTION", "CUDNN_ATTENTION")
    if hasattr(SDPBackend, name)
)


def autocasting(device: str) -> bool:
    """Whether torch.autocast casts operations on this device type now."""
    try:
        return torch.is_autocast_enabled(device)
    except RuntimeError:  # a device type without autocast (meta) has no state of it
        return False


def _why_not_fused(keep: torch.Tensor | None, bias: torch.Tensor | None, empty_rows: str,
                   adds_exactly: bool) -> str | None:
    """Why F.scaled_dot_product_attention cannot compute this call, or None when it can;
    adds_exactly: _mask_adds_exactly's answer."""
    if bias is not None and bias.dtype in (torch.float16, torch.bfloat16):
        # a bias of -1e4 rounds the float16 sum of every score to one number: uniform weights
        return "the kernel adds a half-precision bias in float32, the reference in its dtype"
    if bias is not None and bias.dtype == torch.float32 and autocasting(bias.device.type):
        # autocast casts the kernel's mask with its inputs: a float32 bias rounded to half
        # (a float64 one it leaves, as it leaves the float64 layer)
        return "inside torch.autocast the kernel's float32 bias would be rounded to its dtype"
    if keep is not None and empty_rows == "uniform":
        return "a row with no key takes uniform weights, which the kernel does not give"
    if not adds_exactly:
        return "a masked key may hold NaN or inf, and the kernel adds the mask to its score"
    return None


def _why_not_masked_product(queries, keep, bias, empty_rows, adds_exactly) -> str | None:
    """Why the mask cannot be added inside the scaled product, or None when it can."""
    if keep is not None and empty_rows == "uniform":
        return "a row with no key takes uniform weights, which the masked product does not give"
    if bias is not None:
        return "an additive window mask is added to the scores on its own"
    if keep is not None and not _mask_fits_product(keep, queries):
        return "the mask varies along the leading axes and along the queries"
    if not adds_exactly:
        return "a masked key may hold NaN or inf: added to the mask, its score would stay NaN"
    return None


def choose_path(queries, keys, values, keep, bias, need_weights, empty_rows, dropout,
                causal=False, softcap=None, sinks=False) -> str:
    """Which of DotProductAttention.attend's ways computes the call, decided once per call:

    - "is_causal": F.scaled_dot_product_attention's own causal mask, `causal` saying that the
      mask is mha's causal one alone, nothing cached (top-left aligned, as is_causal is);
    - "fused": F.scaled_dot_product_attention with the mask (see _why_not_fused);
    - "masked product": the mask added inside one batched product (_why_not_masked_product),
      when the scores are not few (_few_scores);
    - "scores": the masked scores replaced by -inf, whatever the keys hold; also the cheapest
      for one query under a mask, and the only one with a soft cap (`softcap`) or sinks,
      which the kernels do not take.
    """
    if softcap is not None or sinks:
        return "scores"
    if takes_is_causal(queries, keys, values, need_weights, dropout, causal, softcap, sinks):
        return "is_causal"
    if keep is not None and queries.shape[-2] == 1 and queries.shape[:-2] == keys.shape[:-2]:
        # One query (a decoding step), as many heads as the keys: replacing its masked scores
        # (K per head) costs less than the pass over the keys (K x d) that the mask needs on
        # the other paths, zeroing them or reading whether they are finite
        return "scores"
    few = _few_scores(queries, keys)
    if need_weights and few:
        return "scores"
    adds_exactly = keep is None or _mask_adds_exactly(keep, queries, keys)
    if not need_weights and _why_not_fused(keep, bias, empty_rows, adds_exactly) is None:
        return "fused"
    if few:
        return "scores"
    if _why_not_masked_product(queries, keep, bias, empty_rows, adds_exactly) is None:
        return "masked product"
    return "scores"


def pairs_heads(queries, keys, values, keep, bias, need_weights, empty_rows, dropout,
                causal=False, softcap=None, sinks=False) -> bool:
    """Whether a call whose keys and values have fewer heads than its queries reaches
    F.scaled_dot_product_attention with them as they are, the kernel pairing the heads: under
    is_causal, and off the CPU on the "fused" path where a kernel of SDPA's own takes them with
    the mask (cuDNN's on CUDA). Otherwise the layers make each group of query heads one head's
    rows first (masks.grouped_rows)."""
    if takes_is_causal(queries, keys, values, need_weights, dropout, causal, softcap, sinks):
        return True
    if queries.device.type == "cpu":
        return False
    path = choose_path(queries, keys, values, keep, bias, need_weights, empty_rows, dropout,
                       causal, softcap, sinks)
    dropout_p = dropout.p if dropout.training else 0.0
    mask = keep if bias is None else bias
    return path == "fused" and _kernel_pairs_heads(queries, keys, values, mask, dropout_p, False)


def takes_is_causal(queries, keys, values, need_weights, dropout, causal, softcap,
                    sinks) -> bool:
    """Whether choose_path gives the call "is_causal": `causal`, mha's causal mask alone,
    without weights, soft cap or sinks, on a kernel with a causal mask of its own."""
    return (softcap is None and not sinks and not need_weights and causal
            and _kernel_takes_causal(queries, keys, values, dropout))


# The masked product saves a pass over the scores, and copies the queries and keys into one
# batch and builds an additive mask: on the CPU, below this many scores the copies cost more
SMALL_SCORES = 2**15


def _few_scores(queries, keys) -> bool:
    """Whether the call's scores, (..., Q, K), are too few for the masked product to pay."""
    count = math.prod(queries.shape[:-1]) * keys.shape[-2]
    # A count left free by torch.export is taken as many: a program's path may not hang on it
    return queries.device.type == "cpu" and isinstance(count, int) and count < SMALL_SCORES


def _kernel_takes_causal(queries, keys, values, dropout) -> bool:
    """Whether F.scaled_dot_product_attention computes is_causal in a kernel of its own (flash,
    memory-efficient, cuDNN), which leaves the keys above the diagonal out of the scores; its
    math fallback adds -inf to them, and a NaN key would stay NaN, as it would in a program
    exported to ONNX. The kernels take 4-D inputs of one head size: on the CPU any float
    dtype, on CUDA no float64 and head sizes that are a multiple of 8 up to 256; outside a
    graph, SDPA's own choice, which follows sdpa_kernel() and torch.backends' switches, says
    too. Dropout, which changes their choice, goes the other ways."""
    head_size, device = queries.shape[-1], queries.device.type
    if queries.dim() != 4 or values.shape[-1] != head_size or (dropout.training and dropout.p):
        return False
    if exporting_to_onnx():
        # The ONNX exporter makes is_causal a mask added to the scores (so does ONNX's own
        # Attention node): a NaN at a future key would reach every output
        return False
    if device == "cuda":
        fits = queries.dtype != torch.float64 and head_size % 8 == 0 and head_size <= 256
    else:
        fits = device == "cpu"
    return fits and _causal_kernel_chosen(queries, keys, values)


def _causal_kernel_chosen(queries, keys, values) -> bool:
    """Whether SDPA runs a kernel of its own for this causal call: its own choice, the heads
    of grouped keys paired by it, or else repeated (as _sdpa gives them); where it cannot be
    asked (torch.jit.trace, torch.func's tensors), whether its switches (sdpa_kernel(),
    torch.backends') leave one on. torch.compile reads neither (docs/backends.md)."""
    if torch.compiler.is_compiling():
        return True
    if not (building_a_graph() or functorch_wrapped(queries)):
        with contextlib.suppress(AttributeError, TypeError, RuntimeError, NotImplementedError):
            return _sdpa_chooses_a_kernel(queries, keys, values)
    switches = torch.backends.cuda
    others = switches.mem_efficient_sdp_enabled() or switches.cudnn_sdp_enabled()
    return switches.flash_sdp_enabled() or (queries.device.type == "cuda" and others)


def _sdpa_chooses_a_kernel(queries, keys, values) -> bool:
    """torch._fused_sdp_choice for a causal call, grouped heads paired by the kernel or, where
    none pairs them, repeated first."""
    grouped = keys.shape[-3] != queries.shape[-3]
    choice = torch._fused_sdp_choice(queries, keys, values, None, 0.0, True, enable_gqa=grouped)
    if choice in _OWN_KERNELS or not grouped:
        return choice in _OWN_KERNELS
    # Uninitialized stand-ins of the repeated heads: the choice reads no values
    keys, values = (x.new_empty((*x.shape[:-3], queries.shape[-3], *x.shape[-2:]))
                    for x in (keys, values))
    return torch._fused_sdp_choice(queries, keys, values, None, 0.0, True) in _OWN_KERNELS


def _mask_adds_exactly(keep: torch.Tensor, queries: torch.Tensor, keys: torch.Tensor) -> bool:
    """Whether adding keep's -inf to the scores leaves out whatever a masked key holds, as
    replacing the masked scores does: a key masked for every query is zeroed first
    (_without_masked_keys), else every score must be known to be finite (NaN + -inf is NaN)."""
    return _masks_whole_keys(keep, keys) or _scores_known_finite(queries, keys)


def _masks_whole_keys(keep: torch.Tensor, keys: torch.Tensor) -> bool:
    """Whether keep is the same for every query (key padding: 1-D valid_lens, a mask of
    keys), each of its leading axes 1 or the keys': then its masked keys can be zeroed."""
    if keep.shape[-2] != 1 or keep.dim() != keys.dim():
        return False
    return all(m in (1, n) for m, n in zip(keep.shape[:-2], keys.shape[:-2], strict=True))


def _without_masked_keys(keys: torch.Tensor, keep: torch.Tensor | None) -> torch.Tensor:
    """The keys, with 0 at every key that keep masks for every query: a zeroed key's score is
    0, and 0 + -inf is -inf whatever the key held. Decided by the mask's shape, not by reading
    the keys."""
    if keep is None or not _masks_whole_keys(keep, keys):
        return keys
    # Shape of keep.mT: (..., no. of keys, 1), against keys (..., no. of keys, d)
    return torch.where(keep.mT, keys, 0.0)


def _scores_known_finite(queries: torch.Tensor, keys: torch.Tensor) -> bool:
    """Whether every score is known to be finite, for a mask that is not key padding alone:
    |q . k| <= d max|q| max|k|, below the dtype's largest number. On the CPU one read answers
    it (a pass over the queries and keys, not the scores); on other devices and while
    compiling or exporting a read would wait for the device or has no values, so the answer
    is no: such masks then take the path that replaces the masked scores."""
    if values_unread(keys) or values_unread(queries):
        return False
    if not (queries.numel() and keys.numel()):  # no score at all (an empty batch)
        return True
    # A finite key can still score +inf (3e38 and -3e38), and +inf + -inf is NaN. A NaN or
    # inf entry makes the bound NaN or inf: the answer is no
    extremes = torch.stack([queries.amax(), queries.amin(), keys.amax(), keys.amin()])
    q_max, q_min, k_max, k_min = extremes.tolist()
    bound = queries.shape[-1] * max(q_max, -q_min) * max(k_max, -k_min)
    return math.isfinite(bound) and bound < torch.finfo(queries.dtype).max


def _mask_fits_product(keep: torch.Tensor, queries: torch.Tensor) -> bool:
    """Whether keep, as an additive mask, can be the input of one batched product: one mask
    for every leading index, or one mask row per leading index (lengths, key padding)."""
    if keep.dim() > queries.dim():
        return False
    return all(size == 1 for size in keep.shape[:-2]) or keep.shape[-2] == 1


def _masked_scores(keep: torch.Tensor | None, queries: torch.Tensor,
                   keys: torch.Tensor) -> torch.Tensor:
    """queries @ keys^T, -inf where keep is False, in one torch.baddbmm over the leading axes
    flattened. Shape: (..., no. of queries, no. of keys)."""
    *leading, num_queries, d = queries.shape
    num_keys = keys.shape[-2]
    queries = queries.reshape(math.prod(leading), num_queries, d)
    keys = keys.reshape(math.prod(leading), num_keys, d).transpose(1, 2)
    if keep is None:
        # beta=0: the zero input is not read, only broadcast
        scores = torch.baddbmm(queries.new_zeros(()), queries, keys, beta=0)
        return scores.view(*leading, num_queries, num_keys)
    # Shape of additive: keep's, then (1 or leading size, 1 or no. of queries, no. of keys)
    additive = torch.zeros(keep.shape, dtype=queries.dtype, device=queries.device)
    additive = additive.masked_fill_(~keep, float("-inf"))
    additive = additive.reshape((1,) * (len(leading) + 2 - additive.dim()) + additive.shape)
    if any(n != 1 for n in additive.shape[:-2]):
        additive = additive.expand(*leading, *additive.shape[-2:])
    additive = additive.reshape(math.prod(additive.shape[:-2]), *additive.shape[-2:])
    scores = torch.baddbmm(additive, queries, keys)
    return scores.view(*leading, num_queries, num_keys)
