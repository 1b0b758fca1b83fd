"""Attention layers that hold part of their keys and values elsewhere (Gemma 3n's and 4's).

Gemma 4's full layers have no v_proj: their values are the key projection's output
(`values_from_keys`). The last layers of Gemma 3n and 4 (`num_kv_shared_layers`) have no key
or value projection: they attend over the keys and values of an earlier layer, computed from
that layer's input (`keys_values_of`). A port reads the missing weights from where they are;
the layer is then called with the earlier layer's input as keys and values.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

__all__ = [
    "KEYS_AS_VALUES",
    "KEYS_VALUES_ELSEWHERE",
    "VALUES_FROM_KEYS",
    "keys_values_elsewhere",
    "keys_values_note",
    "values_are_keys",
    "with_keys_values_of",
    "with_values_from_keys",
]

# The note of a port whose values are its keys' projection
VALUES_FROM_KEYS = "v_proj is k_proj: the values are the key projection's output"

# Gemma 4's full layers (attention_k_eq_v): q_proj, k_proj and o_proj, the values being the
# key projection's output; ported with values_from_keys=True
KEYS_AS_VALUES = (
    "q/k/o_proj, the values from k_proj (Gemma 4: values_from_keys=True, --values-from-keys)"
)

# Gemma 3n's and 4's KV-shared layers: q_proj (and q_norm) and o_proj alone
KEYS_VALUES_ELSEWHERE = (
    "q_proj and o_proj, keys and values from an earlier layer (Gemma 3n and 4: "
    "keys_values_of=, --keys-values-of)"
)

# What a KV-shared layer takes from the layer whose keys and values it reuses
_KEYS_VALUES = ("k_proj.", "v_proj.", "k_norm.")


def with_values_from_keys(names, values_from_keys: bool, where: str):
    """The names under the prefix, with k_proj's tensors also as v_proj's where
    values_from_keys says (Gemma 4's full layers: their values are the keys' projection,
    before any norm); and the names so added."""
    if not values_from_keys:
        return names, ()
    if any(name.startswith("v_proj.") for name in names) or "k_proj.weight" not in names:
        raise ValueError(
            "values_from_keys=True reads the values from k_proj, where the layer has no "
            f"v_proj; the weights {where} have "
            + ("a v_proj" if "k_proj.weight" in names else "no k_proj.weight")
        )
    copied = {"v" + name[1:]: value for name, value in names.items() if name.startswith("k_proj.")}
    return {**names, **copied}, tuple(copied)


def values_are_keys(names: Mapping[str, Any]) -> bool:
    """Whether the names under a prefix are those of a layer whose values are its keys'
    projection: q_proj, k_proj and o_proj, and no v_proj."""
    held = {name.rsplit(".", 1)[0] for name in names}
    return {"q_proj", "k_proj", "o_proj"} <= held and "v_proj" not in held


def keys_values_elsewhere(names: Mapping[str, Any]) -> bool:
    """Whether the names under a prefix are those of a KV-shared layer: q_proj and o_proj (and
    q_norm), no key or value projection."""
    held = {name.rsplit(".", 1)[0] for name in names}
    return held in ({"q_proj", "o_proj"}, {"q_proj", "o_proj", "q_norm"})


def with_keys_values_of(names, under_source, source: int | str | None, prefix: str, where: str):
    """The names under the prefix with k_proj's, v_proj's and k_norm's from the layer whose
    keys and values the layer reuses (source: its index, or its prefix; under_source(prefix)
    gives the names there); and the names so added. None: the names as they are."""
    if source is None:
        return names, ()
    other = source_prefix(prefix, source)
    own = sorted(name for name in names if name.startswith(_KEYS_VALUES))
    if own:
        raise ValueError(
            f"keys_values_of={source!r} reads the keys and values of another layer, and the "
            f"layer {where} has its own: {', '.join(own)}"
        )
    taken = {
        name: value for name, value in under_source(other).items() if name.startswith(_KEYS_VALUES)
    }
    if "k_proj.weight" not in taken:
        raise ValueError(f"keys_values_of={source!r}: there is no k_proj.weight under {other!r}")
    return {**names, **taken}, tuple(taken)


def source_prefix(prefix: str, source: int | str) -> str:
    """The prefix of the layer whose keys and values a layer reuses: given, or the layer's
    prefix with its one number (its index) changed to `source`."""
    if isinstance(source, str):
        return source
    if isinstance(source, bool) or not isinstance(source, int) or source < 0:
        raise ValueError(f"keys_values_of is a layer's index or prefix. Received: {source!r}")
    parts = prefix.replace("/", ".").split(".")
    numbers = [i for i, part in enumerate(parts) if part.isdecimal()]
    if len(numbers) != 1:
        raise ValueError(
            f"keys_values_of={source} changes the layer's index in its prefix, and {prefix!r} "
            f"holds {len(numbers)} numbers: give the prefix of the layer whose keys and "
            "values it reuses"
        )
    parts[numbers[0]] = str(source)
    return ".".join(parts)


def keys_values_note(prefix: str, source: int | str) -> str:
    """The note of a port whose keys and values are another layer's."""
    other = source_prefix(prefix, source)
    return (
        f"k_proj, v_proj and k_norm are those under {other!r}: call the layer with that "
        "layer's input as keys and values"
    )
