"""`mha convert` and `mha inspect`: the file commands, on a layer's file or, with --prefix,
on the attention layer under a path of a whole model's weights.

`mha.cli` adds their arguments to its parser (`add_file_commands`) and runs them
(`file_command`); the files themselves are read and written by `mha.conversion`.
"""

from __future__ import annotations

import json
import os

from mha import conversion, model_config, porting, stored
from mha.checkpoints import read_checkpoint
from mha.cli_common import UsageError, finite_float, positive_int
from mha.registry import BackendUnavailableError, load_backend

__all__ = ["add_file_commands", "file_command"]


def add_file_commands(commands) -> None:
    """Add `mha convert` and `mha inspect` to the parser's `commands`."""
    kinds = "; ".join(conversion.FILE_KINDS.values())
    convert = commands.add_parser(
        "convert",
        help="convert MultiHeadAttention weights between mha, torch, Keras and Flax files",
        description="Convert MultiHeadAttention weights from SRC to DST, the kinds told by the "
        f"file names: {kinds}. The configuration is read off the weights; a torch state_dict "
        "does not tell the number of heads, so give --num-heads with one. DST is read back and "
        "must give the same weights before it replaces a file already there (a failure leaves DST "
        "as it was); the config printed is the one DST holds, and a note names what of SRC's it "
        "does not hold. Exit 0 on success, 1 when a file cannot be read or written or the "
        "destination cannot express the layer, 2 on a usage error.",
    )
    convert.add_argument("source", metavar="SRC")
    convert.add_argument("destination", metavar="DST")
    convert.add_argument(
        "--num-heads",
        type=positive_int,
        help="number of heads (needed for a torch state_dict source)",
    )
    _add_port_arguments(convert)
    inspect = commands.add_parser(
        "inspect",
        help="print the class, config and weight shapes of a checkpoint",
        description=f"Print the layer class, config and weight shapes of PATH ({kinds}).",
    )
    inspect.add_argument("path", metavar="PATH")
    inspect.add_argument(
        "--num-heads", type=positive_int, help="number of heads, for a torch state_dict"
    )
    _add_port_arguments(inspect)


def _add_port_arguments(parser) -> None:
    parser.add_argument(
        "--prefix",
        metavar="MODULE.PATH",
        help="read the file as a whole model's weights (.pt, .pth, .safetensors, .msgpack, a "
        "folder or its model.safetensors.index.json) and take the attention layer under this "
        "path, e.g. bert.encoder.layer.0.attention, its layout (BERT, ViT, Llama, BART, T5, "
        "timm, GPT-2, Keras, Flax, torch) told by the names there ('' for a one-layer file)",
    )
    parser.add_argument(
        "--scale",
        type=finite_float,
        help="the score scale, when the model's differs from its layout's default",
    )
    parser.add_argument(
        "--config",
        metavar="CONFIG.JSON",
        help="a Hugging Face config.json: its heads (which the weights must have), rope_theta, "
        "sliding_window and score scale (the options below override it)",
    )
    parser.add_argument(
        "--config-part",
        metavar="KEY",
        help="the part of a --config that nests its models' configs the layer belongs to "
        "(text_config, vision_config, ...)",
    )
    parser.add_argument(
        "--rope-theta",
        type=finite_float,
        help="rotary position embeddings of this base (Llama 2: 10000, Llama 3: 500000)",
    )
    parser.add_argument(
        "--rope-interleaved",
        action="store_true",
        help="rotate feature pairs (2i, 2i + 1), as GPT-J and Meta's original Llama weights",
    )
    parser.add_argument(
        "--sliding-window",
        type=positive_int,
        help="attend only to keys within this many positions (Mistral's window, with causal)",
    )
    parser.add_argument(
        "--layer",
        type=int,
        help="the layer's index in the model, for a --config whose layers differ (Gemma 2 and "
        "3, gpt-oss: sliding and full attention); by default the one number in --prefix",
    )
    _add_layer_arguments(parser)


def _add_layer_arguments(parser) -> None:
    """The arguments of a --prefix port that say what its layer holds beside the weights."""
    parser.add_argument(
        "--dtype",
        choices=("float16", "bfloat16", "float32", "float64"),
        help="with --prefix: the layer's dtype (default: the weights'); bfloat16 weights "
        "widen to float32 exactly, and Gemma's 1 + norm weight is summed in it",
    )
    parser.add_argument(
        "--without-positions",
        action="store_true",
        help="the layer adds no rotary embeddings or ALiBi, in a layout whose models all do "
        "(GPT-NeoX, Falcon, BLOOM, MPT, Phi-3): it has none, or its biases come at each call",
    )
    parser.add_argument(
        "--values-from-keys",
        action="store_true",
        help="the layer has no v_proj, its values being k_proj's output (Gemma 4's full "
        "layers, attention_k_eq_v; --config says so)",
    )
    parser.add_argument(
        "--keys-values-of",
        metavar="LAYER",
        help="the layer reuses another's keys and values (Gemma 3n's and 4's last "
        "num_kv_shared_layers; --config says so): its k_proj, v_proj and k_norm, by that "
        "layer's index (the prefix's number) or prefix",
    )


def _whole_model(path: str, from_model: bool) -> bool:
    """Whether `path` is a folder or an index of shards, a model's safetensors: a source for
    --prefix alone."""
    whole = stored.is_whole_model(path)
    if whole and not from_model:
        what = "a folder" if os.path.isdir(path) else "an index of a model's shards"
        raise UsageError(
            f"{path} is {what}, read as a whole model's weights: give --prefix, the path of "
            "its attention layer"
        )
    return whole


def file_command(arguments, out, err) -> int:
    """Run `mha convert` or `mha inspect`; returns the exit code (a UsageError for 2)."""
    paths = [arguments.path] if arguments.command == "inspect" else [arguments.source]
    if arguments.command == "convert":
        paths.append(arguments.destination)
    from_model = arguments.prefix is not None
    whole = _whole_model(paths[0], from_model)
    try:
        kinds = [conversion.file_kind(path) for path in paths[whole:]]
    except ValueError as error:
        raise UsageError(str(error)) from None
    kinds = ["mha"] * whole + kinds
    if not os.path.isfile(paths[0]) and not (whole and os.path.exists(paths[0])):
        raise UsageError(f"{paths[0]} does not exist or is not a file")
    options = _check_file_arguments(arguments, paths, kinds)
    try:
        if arguments.command == "inspect":
            if from_model:
                return _inspect_port(paths[0], arguments, options, out)
            return _inspect(paths[0], kinds[0], arguments.num_heads, out)
        config = conversion.convert(
            *paths,
            num_heads=arguments.num_heads,
            prefix=arguments.prefix,
            scale=arguments.scale,
            **options,
        )
    except (ValueError, OSError) as error:
        print(f"mha {arguments.command}: error: {error}{stored.shard_hint(paths[0])}", file=err)
        return 1
    layout, left_out = config.pop("layout", None), config.pop("left_out", None)
    notes = config.pop("notes", None) or []
    layer = config.pop("layer", "MultiHeadAttention")
    described = ", ".join(f"{key}={value!r}" for key, value in config.items())
    source = (
        f"{arguments.prefix!r} of {paths[0]} ({layout})"
        if from_model
        else f"{paths[0]} ({conversion.FILE_KINDS[kinds[0]]})"
    )
    print(
        f"{source} -> {paths[1]} ({conversion.FILE_KINDS[kinds[1]]})\n"
        f"{layer}({described}); read back: the same weights",
        file=out,
    )
    if left_out:
        left_out = porting.described_left_out(layout, left_out)
        print(f"left out (not attention weights): {left_out}", file=out)
    for note in notes:
        print(f"note: {note}", file=out)
    return 0


def _refuse_config_left_beside(arguments, source: str) -> None:
    """A UsageError where a model's config.json lies beside its weights and no option says
    what the weights do not tell: a port without it would leave out its rotary embedding or
    windows, and compute other numbers without a word."""
    folder = source if os.path.isdir(source) else os.path.dirname(os.path.abspath(source))
    beside = os.path.join(folder, "config.json")
    given = (arguments.config, arguments.rope_theta, arguments.without_positions or None)
    if os.path.isfile(beside) and all(value is None for value in given):
        raise UsageError(
            f"{beside} lies beside the weights: give it as --config for what the weights do "
            "not tell (the rotary embedding, windows, ...; with --config-part text_config, "
            "say, where it nests its models' configs), or --without-positions to port the "
            "weights alone"
        )


def _check_file_arguments(arguments, paths, kinds) -> dict:
    """A usage error for arguments of `mha convert` and `mha inspect` that do not go together,
    or a file kind whose framework does not import; else the layer options given."""
    from_model = arguments.prefix is not None
    if from_model and kinds[0] == "keras":
        raise UsageError("--prefix reads .pt, .pth, .safetensors or .msgpack files")
    for flag in ("without_positions", "values_from_keys", "keys_values_of", "dtype"):
        if getattr(arguments, flag) and not from_model:
            raise UsageError(f"--{flag.replace('_', '-')} goes with --prefix")
    if from_model:
        _refuse_config_left_beside(arguments, paths[0])
    options = _layer_options(arguments)
    if options and arguments.command == "inspect" and not from_model:
        flags = {"rope_theta": arguments.rope_theta, "rope_interleaved": arguments.rope_interleaved,
                 "sliding_window": arguments.sliding_window}  # fmt: skip
        named = [f"--{name.replace('_', '-')}" for name, value in flags.items() if value]
        named += [f"--config's {name}" for name in options if not flags.get(name)]
        raise UsageError(f"{', '.join(named)}: layer options, which go with --prefix")
    if not from_model and arguments.scale is not None and kinds[0] != "mha":
        raise UsageError("--scale goes with --prefix, or with an mha checkpoint")
    if not from_model and arguments.scale is not None and arguments.command == "inspect":
        raise UsageError("mha inspect takes --scale with --prefix: a file records its own")
    torch_source = arguments.command == "convert" and kinds[0] == "torch" != kinds[1]
    if torch_source and not from_model and arguments.num_heads is None:
        raise UsageError(
            f"{paths[0]} is a torch state_dict, which does not tell the number of heads: "
            "give --num-heads"
        )
    needed = {"mha": None, "torch": "torch", "keras": "tensorflow", "flax": "jax"}
    for kind in kinds:
        if needed[kind] is not None:
            try:
                load_backend(needed[kind])
            except BackendUnavailableError as error:
                raise UsageError(f"{conversion.FILE_KINDS[kind]} files need {error}") from None
    return options


def _config_part(config: dict, key: str) -> dict:
    """The part `key` of a config that nests its models' (a multimodal model's text_config)."""
    part = config.get(key)
    if not isinstance(part, dict):
        nested = [name for name, value in config.items() if isinstance(value, dict)]
        raise ValueError(
            f"the config has no part {key!r}; its parts: {', '.join(nested) or 'none'}"
        )
    return part


def _layer_of_prefix(arguments) -> None:
    """--layer from the one number in --prefix (model.layers.3.self_attn: 3) where it is not
    given; a --layer other than that number is a UsageError (the other layer's options)."""
    numbers = [part for part in (arguments.prefix or "").split(".") if part.isdecimal()]
    if len(numbers) != 1:  # none, or several (T5's block.2.layer.0): --layer says which
        return
    if arguments.layer is None:
        arguments.layer = int(numbers[0])
    elif arguments.layer != int(numbers[0]):
        raise UsageError(
            f"--layer {arguments.layer} is not the layer of --prefix {arguments.prefix} "
            f"({int(numbers[0])}): its options would be another layer's"
        )


def _layer_options(arguments) -> dict:
    """The layer options of --config, --rope-theta, --rope-interleaved and --sliding-window;
    num_heads from --config too, unless --num-heads gives it."""
    options = {}
    if arguments.config_part is not None and arguments.config is None:
        raise UsageError("--config-part goes with --config")
    if arguments.config is not None:
        _layer_of_prefix(arguments)
        try:
            config = model_config.read_config(arguments.config)
            if arguments.config_part is not None:
                config = _config_part(config, arguments.config_part)
            options = model_config.options_from_config(config, arguments.layer)
        except ValueError as error:
            hint = " (--config-part KEY)" if "nests the configs" in str(error) else ""
            raise UsageError(f"{error}{hint}") from None
        if arguments.num_heads is None:
            arguments.num_heads = options.get("num_heads")
        if arguments.scale is None:
            arguments.scale = options.get("scale")
        options.pop("num_heads", None)
        options.pop("scale", None)
    elif arguments.layer is not None:
        raise UsageError("--layer goes with --config")
    given = {
        "rope_theta": arguments.rope_theta,
        "rope_interleaved": arguments.rope_interleaved or None,
        "sliding_window": arguments.sliding_window,
    }
    options.update({key: value for key, value in given.items() if value is not None})
    if options.get("rope_interleaved") and "rope_theta" not in options:
        raise UsageError("--rope-interleaved goes with --rope-theta (or a --config giving it)")
    if arguments.without_positions:
        options["without_positions"] = True
    if arguments.values_from_keys:
        options["values_from_keys"] = True
    if arguments.dtype is not None:
        options["dtype"] = arguments.dtype
    if arguments.keys_values_of is not None:
        source = arguments.keys_values_of
        options["keys_values_of"] = int(source) if source.isdecimal() else source
    return options


def _inspect_port(path: str, arguments, options, out) -> int:
    port = porting.canonical_from_state_dict(
        conversion.read_state(path, lazily=True),
        arguments.prefix,
        num_heads=arguments.num_heads,
        scale=arguments.scale,
        **options,
    )
    print(f"{path}, under {arguments.prefix!r}: {port.layout}", file=out)
    told = "the weights and --config" if arguments.config is not None else "the weights"
    print(f"class: {port.layer} (config inferred from {told})", file=out)
    print(f"config: {json.dumps(port.config, sort_keys=True)}", file=out)
    print("weights:", file=out)
    for name, value in port.weights.items():
        print(f"  {name:<4} {tuple(value.shape)!s:<12} {value.dtype}", file=out)
    print(f"read: {', '.join(port.used)}", file=out)
    if port.left_out:
        left_out = porting.described_left_out(port.layout, port.left_out)
        print(f"left out (not attention weights): {left_out}", file=out)
    for note in port.notes:
        print(f"note: {note}", file=out)
    return 0


def _inspect(path: str, kind: str, num_heads: int | None, out) -> int:
    # Read whole before the first line: a file that fails prints the error alone
    if kind == "mha":
        checkpoint = read_checkpoint(path)
        class_name, config, weights = (
            checkpoint.class_name,
            checkpoint.config,
            checkpoint.weights,
        )
        if num_heads is not None and config.get("num_heads") != num_heads:
            raise ValueError(
                f"{path} holds a layer with num_heads={config.get('num_heads')}. "
                f"Received: num_heads={num_heads}"
            )
        saved_from = checkpoint.metadata.get("backend", "-")
        told = f"{class_name} (saved from the {saved_from} backend)"
    else:
        weights, config = conversion.read_file(path, num_heads=num_heads)
        told = "MultiHeadAttention (config inferred from the weights)"
    print(f"{path}: {conversion.FILE_KINDS[kind]}", file=out)
    print(f"class: {told}", file=out)
    print(f"config: {json.dumps(config, sort_keys=True)}", file=out)
    print("weights:", file=out)
    for name, value in weights.items():
        print(f"  {name:<4} {tuple(value.shape)!s:<12} {value.dtype}", file=out)
    return 0
