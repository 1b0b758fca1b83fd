"""The GPU lane's checks, one step per run, from the repository's root:
`PYTHONPATH=. python tests/gpu_lane.py STEP [--device gpu]` (PYTHONPATH where mha is not
installed).

`python3 lanes.py gpu` runs every step in its own process under a time limit, in the Python
that runs it, with the packages a GPU machine has (torch and jax with CUDA, flax; no
TensorFlow, no MXNet, no pytest) and nothing to download:

- agreement: the tests' case matrix (`harness.compare` of agreement_cases.all_cases) for torch
  and jax placed on the device, each framework in a process of its own, whole in float32 and
  its first 12 cases in float64, against the NumPy reference on the CPU;
- masked_keys: NaN and inf at a masked key change no row that does not attend to it, for every
  kind of mask, with and without weights, float32 and bfloat16 (whose calls without weights
  reach the fused kernels), and torch's float32 layers inside torch.autocast (float16);
- sync: no call reads the device's memory from the host: torch's sync debug mode set to
  "error", JAX's device-to-host transfer guard set to "disallow", around every layer and mask
  (the latent layer's, expanded and absorbed, among them), forward and backward, float32 and
  bfloat16, and torch inside torch.autocast;
- conform: the frameworks' own attention functions (`mha conform`'s adapters: torch's SDPA
  kernels and FlexAttention, JAX's XLA and cuDNN implementations) held to the reference on the
  device, float32, float16 and bfloat16: a survey, each table printed; it fails only when an
  adapter cannot run at all;
- bench: `mha bench` on the device, each framework in its own run, bfloat16 (8, 2048, 2048,
  16) with valid_lens and grouped-query heads first, then float32 at the small and decoding
  shapes; with MHA_GPU_LANE_OUT set, each run's JSON report in that folder.

Each line is printed as it is known; a step's last line says "ok" or "FAILED". `--device cpu`
runs the same checks on the CPU (the tests run the quick form so that the lane stays working).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import os
import subprocess
import sys
import time

import numpy as np
from masked_key_cases import LAST, MASKS, K, Q

import mha
from agreement_cases import all_cases  # the tests' full case matrix, beside this file
from mha import harness
from mha.backends import numpy as N

BACKENDS = tuple(name for name in ("torch", "jax") if importlib.util.find_spec(name))
B, D, H, KV = 2, 32, 4, 2  # head size 8, which the fused GPU kernels take


def say(*parts) -> None:
    print(*parts, flush=True)


def versions(device: str) -> None:
    say("python", sys.version.split()[0], "numpy", np.__version__, "mha", mha.__version__)
    for name in BACKENDS:
        module = __import__(name)
        say(name, module.__version__)
    if "torch" in BACKENDS and device == "gpu":
        import torch

        say("torch device:", torch.cuda.get_device_name(0), "CUDA", torch.version.cuda)
    if "jax" in BACKENDS:
        import jax

        say("jax devices:", jax.devices(device))


def agreement(device: str, quick: bool, backends=BACKENDS, part: str = "1/1") -> bool:
    """The case matrix on the device, whole in float32, then its first 12 cases in float64
    (the whole matrix in float64 is the CPU lanes'); every row must agree. `part` "K/N" runs
    every Nth case from the Kth, so that N processes share the matrix."""
    index, count = (int(number) for number in part.split("/"))
    passed = True
    for dtype in ("float32", "float64"):
        cases = all_cases()[:12] if quick or dtype == "float64" else all_cases()
        cases = cases[index - 1 :: count]
        if dtype == "float64" and "jax" in backends:
            import jax

            jax.config.update("jax_enable_x64", True)
        begin = time.perf_counter()
        rows = harness.compare(backends, dtype, cases=cases, device=device, progress=_every(20))
        for name in backends:
            mine = [row for row in rows if row.backend == name]
            failed = [row for row in mine if not row.passed]
            worst = max((row.output_difference or 0.0 for row in mine), default=0.0)
            say(
                f"agreement {name} {dtype} on {device} (part {part}): {len(mine) - len(failed)} "
                f"of {len(mine)} rows agree, largest output difference {worst:.2g}"
            )
            for row in failed:
                say(
                    f"  FAILED {row.case}: output {row.output_difference}, weights "
                    f"{row.weights_difference}, gradients {row.gradient_difference}, zeros "
                    f"{row.zero_difference}, {row.error or ''}"
                )
            passed = passed and not failed
        say(f"  ({time.perf_counter() - begin:.0f} s)")
    return passed


def _every(step: int):
    """A progress callback that prints every `step` runs, so that a killed step shows how far
    it got."""

    def progress(done: int, total: int, description: str) -> None:
        if done % step == 0:
            say(f"  {done} of {total}: {description}")

    return progress


KINDS = ("dot", "multihead", "multihead_no_weights", "grouped_no_weights")


# The sync step's layers besides KINDS': the latent layer (self-attention, its one input the
# queries'), expanded with weights and absorbed without
SYNC_KINDS = (*KINDS, "latent", "latent_absorbed")
LATENT_SIZES = dict(kv_lora_rank=8, qk_nope_head_dim=4, qk_rope_head_dim=4, v_head_dim=8)


def _layers(module, kind: str, dtype: str, device: str):
    """The float64 reference and the backend's layer of `kind` with its weights, placed."""
    if kind == "dot":
        reference, layer = (
            N.DotProductAttention(dtype="float64"),
            module.DotProductAttention(dtype=dtype),
        )
        return reference, module.to_device(layer, device)
    if kind.startswith("latent"):
        name, sizes = "MultiHeadLatentAttention", LATENT_SIZES
    else:
        name, sizes = "MultiHeadAttention", dict(query_size=D, key_size=D, value_size=D)
        sizes["num_kv_heads"] = KV if kind.startswith("grouped") else None
    reference = getattr(N, name)(D, H, **sizes, dtype="float64")
    layer = getattr(module, name)(D, H, **sizes, dtype=dtype)
    weights = mha.get_weights(reference)
    mha.set_weights(layer, {k: v.astype(dtype) for k, v in weights.items()})
    return reference, module.to_device(layer, device)


def _inputs(seed: int = 0):
    rng = np.random.default_rng(seed)
    return [rng.standard_normal((B, n, D)) for n in (Q, K, K)]


def _arguments(module, masks: str, dtype: str, device: str, need_weights: bool | None) -> dict:
    """The call's masks on the device; a float window mask in the layer's dtype."""
    arguments = {
        key: (
            _as(module, value, dtype, device)
            if value.dtype.kind == "f"
            else module.to_device(module.from_numpy(value), device)
        )
        if isinstance(value, np.ndarray)
        else value
        for key, value in MASKS[masks].items()
    }
    if need_weights is not None:
        arguments["need_weights"] = need_weights
    return arguments


def _as(module, array: np.ndarray, dtype: str, device: str):
    from mha.weights import numpy_dtype

    return module.to_device(module.from_numpy(array.astype(numpy_dtype(dtype))), device)


def _dtypes(name: str, quick: bool) -> tuple[str, ...]:
    """The dtypes of the masked-key and sync steps: "autocast" is torch's float32 layer called
    inside torch.autocast (float16 on a GPU, bfloat16 on the CPU)."""
    if quick:
        return ("float32",)
    return ("float32", "bfloat16", "autocast") if name == "torch" else ("float32", "bfloat16")


def _autocast(dtype: str, device: str):
    """torch.autocast on the device for the dtype "autocast"; for the others nothing."""
    if dtype != "autocast":
        return contextlib.nullcontext()
    import torch

    if device == "gpu":
        return torch.autocast("cuda", dtype=torch.float16)
    return torch.autocast("cpu", dtype=torch.bfloat16)


def one_masked_key(
    name: str, kind: str, masks: str, poison: float, dtype: str, device: str
) -> str | None:
    """What went wrong when key LAST holds `poison`, or None: the rows that give it no weight
    must be those of the call on clean keys (and near the reference's), its weights 0."""
    module = mha.load_backend(name)
    casting, dtype = dtype, "float32" if dtype == "autocast" else dtype
    reference, layer = _layers(module, kind, dtype, device)
    queries, keys, values = _inputs()
    expected = reference(queries, keys, values, **MASKS[masks])
    masked = reference.attention_weights[..., LAST] == 0
    rows = masked.all(axis=1) if masked.ndim == 3 and kind != "dot" else masked
    poisoned = keys.copy()
    poisoned[:, LAST] = poison
    need_weights = None if kind == "dot" else kind == "multihead"
    arguments = _arguments(module, masks, dtype, device, need_weights)
    outputs = []
    for each in (keys, poisoned):
        tensors = [_as(module, x, dtype, device) for x in (queries, each, values)]
        with _autocast(casting, device):
            output = layer(*tensors, **arguments)
        outputs.append(module.to_numpy(output).astype(np.float64))
        if need_weights is not False:
            weights = module.to_numpy(layer.attention_weights).astype(np.float64)
            if np.any(weights[..., LAST][masked] != 0):
                return "a masked key has weight"
    clean, got = (output[rows] for output in outputs)
    # The clean keys may take another path (a fused kernel for keys known to be finite)
    low = dtype != "float32" or casting == "autocast"
    tolerance = (5e-2 if low else 1e-5) * max(np.max(np.abs(expected)), 1.0)
    if not np.all(np.isfinite(got)) or np.max(np.abs(got - clean)) > tolerance:
        return f"the poison reached a row: largest change {np.max(np.abs(got - clean))}"
    if np.max(np.abs(clean - expected[rows])) > tolerance:
        return f"off the reference by {np.max(np.abs(clean - expected[rows])):.2g}"
    return None


def masked_keys(device: str, quick: bool) -> bool:
    everything = 0
    for name in BACKENDS:
        failures = total = 0
        for dtype in _dtypes(name, quick):
            for kind in KINDS:
                for masks in MASKS:
                    for poison in (np.nan, np.inf):
                        total += 1
                        problem = one_masked_key(name, kind, masks, poison, dtype, device)
                        if problem:
                            failures += 1
                            say(f"  FAILED {name} {dtype} {kind} {masks} {poison}: {problem}")
        say(f"masked keys {name} on {device}: {total - failures} of {total} cases keep out NaN/inf")
        everything += failures
    return everything == 0


def _torch_no_sync(device: str):
    import torch

    if device == "gpu":
        torch.cuda.set_sync_debug_mode("error")
        return lambda: torch.cuda.set_sync_debug_mode("default")
    return lambda: None


def sync(device: str, quick: bool) -> bool:
    """Every layer and mask, forward and backward, with the device's reads of the host off;
    bfloat16 too, whose calls without weights reach the fused kernels."""
    problems = []
    for name in BACKENDS:
        module = mha.load_backend(name)
        calls = 0
        for casting in _dtypes(name, quick):
            dtype = "float32" if casting == "autocast" else casting
            for kind in SYNC_KINDS:
                for masks in MASKS:
                    _, layer = _layers(module, kind, dtype, device)
                    need_weights = None if kind == "dot" else kind in ("multihead", "latent")
                    arguments = _arguments(module, masks, dtype, device, need_weights)
                    tensors = [_as(module, x, dtype, device) for x in _inputs()]
                    if kind.startswith("latent"):
                        tensors = tensors[:1]  # self-attention: X alone
                        arguments["absorbed"] = kind == "latent_absorbed"
                    try:
                        with _autocast(casting, device):
                            _call_without_reads(name, layer, tensors, arguments, device)
                        calls += 1
                    except Exception as error:  # the framework's own sync error, reported
                        problems.append(
                            f"{name} {casting} {kind} {masks}: {type(error).__name__}: {error}"
                        )
                        say("  FAILED", problems[-1])
        if device == "cpu":  # neither guard sees a read of the host's own memory
            say(f"sync {name} on cpu: {calls} calls ran under the guards (a GPU's run checks)")
        else:
            say(f"sync {name} on {device}: {calls} calls read nothing from the device")
    return not problems


def _call_without_reads(name, layer, tensors, arguments, device) -> None:
    if name == "torch":
        for x in tensors:
            x.requires_grad_(True)
        restore = _torch_no_sync(device)
        try:
            layer(*tensors, **arguments).sum().backward()
        finally:
            restore()
        return
    import jax
    from flax import nnx

    # The masks go into the jitted call as arguments: arrays a jitted function closes over
    # are constants of its program, read from the device to build it
    arrays = {k: v for k, v in arguments.items() if isinstance(v, jax.Array)}
    flags = {k: v for k, v in arguments.items() if k not in arrays}
    with jax.transfer_guard_device_to_host("disallow"):
        layer(*tensors, **arguments)
        nnx.jit(lambda layer, x, masks: layer(*x, **masks, **flags))(layer, tensors, arrays)


# The adapters the conform step runs on a GPU, by framework; on the CPU, the first of each
CONFORM = {
    "torch": (
        "torch-sdpa-math",
        "torch-sdpa",
        "torch-sdpa-flash",
        "torch-sdpa-efficient",
        "torch-sdpa-cudnn",
        "torch-flex",
    ),
    "jax": ("jax", "jax-cudnn"),
}
# mha's own function of each framework, its fused kernels taken on the device where they apply
MHA_FUNCTIONS = {name: f"mha.backends.{name}:dot_product_attention" for name in ("torch", "jax")}


def conform(device: str, quick: bool, backends=BACKENDS, part: str = "1/1") -> bool:
    """Each framework's own attention functions through mha's conformance kit on `device`;
    `part` "K/N" runs every Nth target of the backends' from the Kth."""
    from mha import cli, conformance, conformance_adapters

    quick = quick or device == "cpu"
    dtypes = ("float32",) if quick else ("float32", "float16", "bfloat16")
    if "jax" in backends and not quick:  # gradients held to mha's function in float64
        import jax

        jax.config.update("jax_enable_x64", True)
    passed = True
    index, count = (int(number) for number in part.split("/"))
    chosen = [
        (name, target)
        for name in backends
        for target in (CONFORM[name][:1] if quick else (*CONFORM[name], MHA_FUNCTIONS[name]))
    ][index - 1 :: count]
    for name, target in chosen:
        try:
            function = (
                cli._conform_target(target, name)[0]
                if ":" in target
                else conformance_adapters.ADAPTERS[target][1]()
            )
            rows = conformance.run(function, name, dtypes, device=device)
        except Exception as error:  # the adapter itself, not a case, broke
            say(f"conform {target} on {device}: FAILED to run: {type(error).__name__}: {error}")
            passed = False
            continue
        say(f"conform {target} on {device}:")
        say(conformance.format_table(rows))
    return passed


SMALL_AND_DECODING = "32,64,256,8;1,1,512,8;1,1,512,8+512;1,1,512,8+4096"


def bench(device: str, quick: bool) -> bool:
    """mha bench on the device, each framework in a run of its own (one that sees no GPU stops
    only its own): bfloat16 at (8, 2048, 2048, 16) with valid_lens and grouped-query heads
    first (benchmarks/README.md's GPU table), then float32 at the default shapes' first, the
    small shape and one decoding step after 512 and 4,096 cached positions; a tiny shape on
    the CPU. MHA_GPU_LANE_OUT names a folder for each run's JSON report."""
    quick = quick or device == "cpu"
    runs = [
        ("bfloat16", "2,16,32,4" if quick else "8,2048,2048,16;8,2048,2048,16,4", "false"),
        ("float32", "2,16,32,4" if quick else SMALL_AND_DECODING, None),
    ]
    out, codes = os.environ.get("MHA_GPU_LANE_OUT"), []
    for dtype, shapes, need_weights in runs:
        for name in BACKENDS:
            command = [sys.executable, "-m", "mha", "bench", "--backends", name]
            command += ["--device", device, "--seconds", "0.5" if quick else "1"]
            command += ["--dtype", dtype, "--shapes", shapes]
            command += ["--need-weights", need_weights] if need_weights else []
            command += ["--output", os.path.join(out, f"bench-{dtype}-{name}.json")] if out else []
            say("+", " ".join(command[1:]))
            codes.append(subprocess.run(command, check=False).returncode)
    return all(code == 0 for code in codes)


STEPS = {
    "agreement": agreement,
    "masked_keys": masked_keys,
    "sync": sync,
    "conform": conform,
    "bench": bench,
}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("step", choices=(*STEPS, "versions"))
    parser.add_argument("--device", choices=("cpu", "gpu"), default="gpu")
    parser.add_argument("--quick", action="store_true", help="a few cases of each step")
    parser.add_argument("--backends", help="agreement, conform: comma-separated, of torch and jax")
    parser.add_argument(
        "--part", default="1/1", help="agreement, conform: K/N, every Nth from the Kth"
    )
    options = parser.parse_args(argv)
    if options.step == "versions":
        versions(options.device)
        return 0
    arguments = [options.device, options.quick]
    if options.step in ("agreement", "conform"):
        arguments += [tuple(options.backends.split(",")) if options.backends else BACKENDS]
        arguments += [options.part]
    passed = STEPS[options.step](*arguments)
    say(f"{options.step} on {options.device}: {'ok' if passed else 'FAILED'}")
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
