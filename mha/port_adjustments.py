"""What a port does to a source's weights where the source computes mha's numbers by other
means: a gate inside the query projection or one per head (Qwen3-Next's, LFM3's), norms with
no weight (Llama 4's, nanochat's), a rotary embedding turned the other way (nanochat's), layer
norms of the whole projection (ESM C's); CANINE's chunks of its initial character encoder; and
the rotary frequencies an older checkpoint keeps beside the attention, checked against the
options and used. `mha.porting` applies them and notes each.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from mha.encoding import rotary_frequencies
from mha.interop.common import as_numpy
from mha.layouts import Layout

__all__ = [
    "CENTERED",
    "HALVES_SWAPPED",
    "INV_FREQS",
    "LOCAL_CHUNKS",
    "UNIT_QK_NORMS",
    "centered_projections",
    "halves_swapped",
    "head_gate",
    "local_chunks_untold",
    "split_gate",
    "unit_qk_norms",
    "use_inv_freq",
    "use_local_chunks",
]


def split_gate(layout: Layout, arrays, num_heads: int | None, where: str):
    """Qwen3-Next's query projection: each head's query rows, then as many gate rows. The
    arrays with the queries' rows alone, and the gate's canonical W_g (and b_g)."""
    path = layout.paths.get("q")
    if layout.kind != "linear" or not isinstance(num_heads, int) or num_heads < 1:
        raise ValueError(
            f"output_gate reads each head's queries and gate from the query projection of "
            f"separate q, k, v and o projections, given num_heads; the {layout.name} weights "
            f"{where} have " + ("another layout" if layout.kind != "linear" else "no num_heads")
        )
    rows = arrays[f"{path}.weight"].shape[0]  # torch's Linear: (out, in)
    if rows % (2 * num_heads):
        raise ValueError(
            f"{path}.weight {where} has {rows} rows: not a query and a gate of equal size for "
            f"each of {num_heads} heads (output_gate)"
        )

    def split(array):  # (2n, ...) -> each head's queries (n, ...), each head's gate (n, ...)
        grouped = array.reshape(num_heads, 2, rows // (2 * num_heads), *array.shape[1:])
        return [grouped[:, i].reshape(-1, *array.shape[1:]) for i in (0, 1)]

    arrays = dict(arrays)
    arrays[f"{path}.weight"], W_g = split(arrays[f"{path}.weight"])
    gate = {"W_g": np.ascontiguousarray(W_g.T)}
    if f"{path}.bias" in arrays:
        arrays[f"{path}.bias"], b_g = split(arrays[f"{path}.bias"])
        gate["b_g"] = np.ascontiguousarray(b_g)
    return arrays, gate


def head_gate(g_proj: np.ndarray, config, where: str, name: str = "g_proj.weight") -> np.ndarray:
    """A gate projection beside the projections as the canonical W_g (in, num_hiddens) of
    output_gate: LFM3's g_proj (num_heads, in), each head's row for every feature of the head,
    which gives each feature its head's gate; AFMoE's gate_proj (num_hiddens, in), a row for
    each feature, transposed."""
    num_heads, num_hiddens = config["num_heads"], config["num_hiddens"]
    rows = num_heads if name == "g_proj.weight" else num_hiddens
    if g_proj.ndim != 2 or g_proj.shape[0] != rows or num_hiddens % num_heads:
        each = f"each of {num_heads} heads" if rows == num_heads else f"each of {rows} features"
        raise ValueError(
            f"{name} {where} has shape {g_proj.shape}: not one gate row for {each} (output_gate)"
        )
    return np.ascontiguousarray(np.repeat(g_proj, num_hiddens // rows, axis=0).T)


UNIT_QK_NORMS = "q_norm and k_norm are ones: the source's QK-norms have no weight"


def unit_qk_norms(qk_norm: str | None, W_q: np.ndarray, num_heads: int) -> dict[str, np.ndarray]:
    """The scales of norms of each head that have no weight (Llama 4's L2Norm, qk_norm "head"
    or "head_after_rotary"): ones of the head size, in W_q's dtype; an error for another
    qk_norm."""
    if qk_norm not in ("head", "head_after_rotary"):
        raise ValueError(
            'weightless_qk_norm=True is qk_norm="head" or "head_after_rotary" norms with no '
            f"weight. Received: qk_norm={qk_norm!r}"
        )
    ones = np.ones(W_q.shape[1] // num_heads, W_q.dtype)
    return {"q_norm": ones, "k_norm": ones.copy()}


HALVES_SWAPPED = (
    "each head's two halves of query and key features are swapped: the source turns them the "
    "other way, which gives the same scores"
)


def halves_swapped(weights: dict[str, np.ndarray], config, where: str) -> dict[str, np.ndarray]:
    """The weights of a source that turns each head's pairs (i, i + d/2) by minus their angle
    (nanochat's rotate_half gives (x2, -x1)), for mha's turn: each head's two halves of the
    query and key features swapped (W_q, W_k, their biases, QK-norm's scales). mha's rotation
    of the swapped features is the swap of the source's rotation, and a swap of both the
    queries and the keys leaves their products, so the scores, as they are."""
    head = config["num_hiddens"] // config["num_heads"]
    if not config["rope_theta"] or config["rope_interleaved"] or config["rope_dim"] or head % 2:
        raise ValueError(
            f"reversed_rotary=True turns the halves of the whole head of the layer {where}: it "
            "needs rope_theta, no rope_interleaved or rope_dim, and an even head size"
        )

    def swapped(x: np.ndarray) -> np.ndarray:
        halves = x.reshape(*x.shape[:-1], -1, 2, head // 2)[..., ::-1, :]
        return np.ascontiguousarray(halves.reshape(x.shape))

    names = ("W_q", "W_k", "b_q", "b_k", "q_norm", "k_norm")
    return {name: swapped(w) if name in names else w for name, w in weights.items()}


CENTERED = (
    "W_q, W_k and their biases are centered over their outputs: the source's QK-norms are layer "
    "norms of the projection, an RMSNorm of the centered projection"
)


def centered_projections(weights: dict[str, np.ndarray], config, where: str) -> dict:
    """The weights of a source whose QK-norms are layer norms of the whole projection without
    a shift (ESM C), for qk_norm="projection": W_q and W_k (and biases) less their mean over
    the outputs. A projection centered so is the source's less its mean, whose mean square is
    the source's variance: the RMSNorm of it is the layer norm, with the same scales."""
    if config["qk_norm"] != "projection":
        raise ValueError(
            "centered_qk_norm=True is a layer norm of the projection: qk_norm='projection' "
            f"with the norms' weights. Received for the layer {where}: "
            f"qk_norm={config['qk_norm']!r}"
        )
    names = ("W_q", "W_k", "b_q", "b_k")
    return {
        name: w - w.mean(axis=-1, keepdims=True) if name in names else w
        for name, w in weights.items()
    }


# Rotary frequencies kept under the attention by older checkpoints: Hugging Face's, ESM-2's
# in transformers, ESM-2's in fair-esm
INV_FREQS = ("rotary_emb.inv_freq", "self.rotary_embeddings.inv_freq", "rot_emb.inv_freq")


def use_inv_freq(names, config, where: str, used: list[str], left_out: list[str]) -> None:
    """An older checkpoint's rotary frequencies, once checked, are used, not left out."""
    for name in [name for name in left_out if name in INV_FREQS]:
        _check_inv_freq(name, names[name], config, where)
        left_out.remove(name)
        used.append(name)


def _check_inv_freq(name: str, inv_freq: Any, config: Mapping[str, Any], where: str) -> None:
    """A checkpoint's rotary frequencies are those of the layer's rope_theta, rope_dim and
    rope_scaling: a layer without rotary embeddings, or with other ones, would give other
    numbers."""
    theta = config["rope_theta"]
    if theta is None:
        raise ValueError(
            f"{name} {where} says the layer rotates its queries and keys: give rope_theta "
            "(or the model's config to options_from_config)"
        )
    head = config["num_hiddens"] // config["num_heads"]
    rotated, scaling = config.get("rope_dim") or head, config.get("rope_scaling")
    expected = rotary_frequencies(rotated, theta, scaling)
    found = as_numpy(inv_freq)
    # Kept in the model's dtype: half precision rounds the frequencies to 3 digits
    rtol = 1e-2 if found.dtype.itemsize < 4 else 1e-6
    found = np.asarray(found, dtype=np.float64).reshape(-1)
    if found.shape != expected.shape or not np.allclose(found, expected, rtol=rtol, atol=0):
        raise ValueError(
            f"{name} {where} holds other frequencies than those of rope_theta={theta} "
            f"over {rotated} features of each head, rope_scaling={scaling}: give the model's "
            "rope_dim and rope_scaling (or its config to options_from_config)"
        )


# CANINE's initial character encoder attends within chunks of its config's
# local_transformer_stride positions (its model's local attention), its other encoders to
# every key, which a layer's index does not tell apart: options_from_config gives the size as
# this port option, and the port of a layer under initial_char_encoder takes it as the layer's
# attention_chunk_size
LOCAL_CHUNKS = "local_chunk_size"


def use_local_chunks(options: dict[str, Any], prefix: str) -> None:
    """Take LOCAL_CHUNKS out of a port's options, as attention_chunk_size where the prefix is
    CANINE's initial character encoder's; a prefix of none of its encoders is an error."""
    size = options.pop(LOCAL_CHUNKS, None)
    parts = prefix.split(".")
    if size is None or {"encoder", "final_char_encoder"} & set(parts):
        return
    if "initial_char_encoder" not in parts:
        raise local_chunks_untold(size, f"the prefix {prefix!r}")
    options.setdefault("attention_chunk_size", size)


def local_chunks_untold(size: int, what: str) -> ValueError:
    """The error for CANINE's config beside a layer that does not tell its encoder."""
    return ValueError(
        f"the config is CANINE's, whose initial character encoder attends within chunks of "
        f"{size} positions and whose other encoders attend to every key; {what} does not tell "
        "which encoder the layer is: port the model's weights under the layer's prefix "
        "(initial_char_encoder..., encoder..., final_char_encoder...)"
    )
