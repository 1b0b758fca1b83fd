"""Files are written so that nothing a user had is lost: a failed `mha convert` or `mha.save`
leaves the destination as it was, permissions are kept, and weights holding NaN convert."""

import os
import stat
import subprocess
import sys

import numpy as np
import pytest

import mha
from conftest import framework_import
from mha import interop
from mha.backends import numpy as N

D, H = 8, 2


def saved(tmp_path, name="a.safetensors", query_size=D, nan=False):
    layer = N.MultiHeadAttention(D, H, bias=True, query_size=query_size, key_size=D, value_size=D)
    if nan:
        weights = mha.get_weights(layer)
        weights["W_q"][0, 0] = np.nan
        mha.set_weights(layer, weights)
    path = tmp_path / name
    mha.save(layer, path)
    return path


def mode(path):
    return stat.S_IMODE(os.stat(path).st_mode)


@pytest.mark.torch
def test_a_failed_convert_leaves_the_destination_as_it_was(tmp_path):
    framework_import("torch")
    old = tmp_path / "old.pt"
    interop.convert(saved(tmp_path, "good.safetensors"), old)
    before = old.read_bytes()
    # torch's layer cannot hold a query size other than num_hiddens: nothing is written
    with pytest.raises(ValueError, match="query"):
        interop.convert(saved(tmp_path, "wide.safetensors", query_size=5), old)
    assert old.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "good.safetensors",
        "old.pt",
        "wide.safetensors",
    ]


# Every kind mha writes, and what writing it needs
ENDINGS = {".safetensors": None, ".pt": "torch", ".weights.h5": "tensorflow", ".msgpack": "flax"}
# Below every file these tests write: the first write that crosses it fails with EFBIG, as on
# a full disk or over a quota (Python ignores SIGXFSZ), after the file has begun to grow
LIMIT = 1024


def run_limited(statements: str) -> subprocess.CompletedProcess:
    """Run `statements` in a new Python whose files may not grow past LIMIT bytes."""
    code = f"import resource, sys\nresource.setrlimit(resource.RLIMIT_FSIZE, ({LIMIT}, {LIMIT}))\n"
    environment = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3"}
    return subprocess.run(
        [sys.executable, "-c", code + statements],
        capture_output=True,
        text=True,
        check=False,
        env=environment,
    )


def old_destination(tmp_path, source, ending):
    if ENDINGS[ending] is not None:
        framework_import(ENDINGS[ending])
    destination = tmp_path / f"old{ending}"
    interop.convert(source, destination)
    assert destination.stat().st_size > LIMIT
    return destination


@pytest.mark.parametrize("ending", list(ENDINGS))
def test_a_write_the_disk_refuses_exits_1_and_leaves_nothing(tmp_path, ending):
    # h5py crashed the process (SIGSEGV) when Keras's writer closed a file the disk refused
    source = saved(tmp_path)
    destination = old_destination(tmp_path, source, ending)
    before = destination.read_bytes()
    completed = run_limited(
        "from mha import cli\n"
        f"sys.exit(cli.main(['convert', {str(source)!r}, {str(destination)!r}]))\n"
    )
    assert completed.returncode == 1, completed.stderr[-2000:]
    assert "Traceback" not in completed.stderr, completed.stderr[-2000:]
    errors = [line for line in completed.stderr.splitlines() if line.startswith("mha ")]
    assert len(errors) == 1 and "left as it was" in errors[0], completed.stderr[-2000:]
    assert destination.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([source.name, destination.name])


WRITERS = {
    "mha.save": "mha.save(layer, path)",
    "mha.save_weights": "mha.save_weights(layer, path)",
    "golden.record": "golden.record(path, [golden.case_of(layer, {'queries': X}, layer(X, X, X))])",
    "interop.write_file": "interop.write_file(path, mha.get_weights(layer), num_heads=2)",
}


@pytest.mark.parametrize(
    "writer, ending",
    [(writer, ".safetensors") for writer in WRITERS]
    + [("interop.write_file", ending) for ending in ENDINGS if ending != ".safetensors"],
)
def test_a_write_the_disk_refuses_is_an_oserror_and_leaves_nothing(tmp_path, writer, ending):
    source = saved(tmp_path)
    destination = old_destination(tmp_path, source, ending)
    before = destination.read_bytes()
    completed = run_limited(
        "import numpy as np\n"
        "import mha\n"
        "from mha import golden, interop\n"
        f"layer, path = mha.load({str(source)!r}, backend='numpy'), {str(destination)!r}\n"
        "X = np.ones((1, 2, 8), 'float32')\n"
        "try:\n"
        f"    {WRITERS[writer]}\n"
        "except OSError as error:\n"
        "    print(f'{type(error).__name__}: {error}')\n"
        "    sys.exit(3)\n"
    )
    assert completed.returncode == 3, completed.stderr[-2000:]
    assert completed.stdout.startswith("OSError: writing ") and "left as it was" in completed.stdout
    assert destination.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([source.name, destination.name])


def test_a_bench_report_the_disk_refuses_exits_1_and_leaves_nothing(tmp_path):
    report = os.path.join(os.path.dirname(__file__), "..", "benchmarks", "results.json")
    destination = tmp_path / "old.json"
    destination.write_bytes(b"{}\n" * LIMIT)
    completed = run_limited(
        "from mha import cli\n"
        f"sys.exit(cli.main(['bench', '--report', {report!r}, '--output', {str(destination)!r}]))\n"
    )
    assert completed.returncode == 1, completed.stderr[-2000:]
    assert "Traceback" not in completed.stderr, completed.stderr[-2000:]
    errors = [line for line in completed.stderr.splitlines() if line.startswith("mha ")]
    assert len(errors) == 1 and "left as it was" in errors[0], completed.stderr[-2000:]
    assert destination.read_bytes() == b"{}\n" * LIMIT
    assert [p.name for p in tmp_path.iterdir()] == [destination.name]


def test_destinations_that_cannot_be_written_are_one_error_line(tmp_path):
    source = saved(tmp_path)
    (tmp_path / "folder.safetensors").mkdir()
    for destination, reason in (
        (tmp_path / "folder.safetensors", "is a directory"),
        (tmp_path / "missing" / "b.safetensors", "does not exist"),
    ):
        completed = subprocess.run(
            [sys.executable, "-m", "mha", "convert", str(source), str(destination)],
            capture_output=True,
            text=True,
            check=False,
        )
        assert completed.returncode == 1 and reason in completed.stderr
        assert "Traceback" not in completed.stderr, completed.stderr


def test_permissions_are_kept_and_new_files_follow_the_umask(tmp_path):
    path = saved(tmp_path)
    umask = os.umask(0o022)
    os.umask(umask)
    assert mode(path) == 0o666 & ~umask
    os.chmod(path, 0o640)
    mha.save(N.MultiHeadAttention(D, H, query_size=D, key_size=D, value_size=D), path)
    assert mode(path) == 0o640
    copy = tmp_path / "copy.safetensors"
    copy.write_bytes(b"")
    os.chmod(copy, 0o604)
    interop.convert(path, copy)
    assert mode(copy) == 0o604
    # A file no one may write is protected: a rename would replace it all the same
    os.chmod(copy, 0o444)
    before = copy.read_bytes()
    with pytest.raises(ValueError, match="is read-only; it is left as it was"):
        interop.convert(path, copy)
    with pytest.raises(ValueError, match="is read-only"):
        mha.save(N.MultiHeadAttention(D, H, query_size=D, key_size=D, value_size=D), copy)
    assert copy.read_bytes() == before and mode(copy) == 0o444


def test_weights_holding_nan_convert_bit_for_bit(tmp_path):
    source = saved(tmp_path, nan=True)
    destination = tmp_path / "b.safetensors"
    interop.convert(source, destination)
    a, _ = interop.read_file(source)
    b, _ = interop.read_file(destination)
    assert np.isnan(b["W_q"][0, 0])
    for name in a:
        assert a[name].tobytes() == b[name].tobytes()


@pytest.mark.parametrize("private_store", [True, False], ids=["in_memory", "public_api"])
def test_keras_files_are_written_the_same_by_either_way(tmp_path, monkeypatch, private_store):
    # Keras's in-memory store is private: where it differs, the public save_weights in a scratch
    # folder writes the file instead, and both load back into Keras's own layer as the weights
    framework_import("keras")
    from keras.src.saving import saving_lib

    class PathsOnly(saving_lib.H5IOStore):
        # A Keras whose store opens paths only, as a release may
        def __init__(self, path, *args, **kwargs):
            if not isinstance(path, str | os.PathLike):
                raise TypeError("a path")
            super().__init__(path, *args, **kwargs)

    if not private_store:
        monkeypatch.setattr(saving_lib, "H5IOStore", PathsOnly)
    weights = mha.random_weights(
        N.MultiHeadAttention(8, 2, query_size=8, key_size=8, value_size=8), seed=3
    )
    destination = tmp_path / "a.weights.h5"
    interop.write_file(destination, weights, num_heads=2)
    read, _ = interop.read_file(destination, num_heads=2)
    for name in weights:
        np.testing.assert_array_equal(read[name], weights[name], err_msg=name)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.weights.h5"]


@pytest.mark.parametrize("change", ["a weight lost", "another dtype", "one ulp"])
def test_a_file_that_would_not_read_back_the_same_is_not_written(tmp_path, monkeypatch, change):
    # The read-back check compares names, dtypes and bits: each change of what comes back
    # keeps the user's file as it was and leaves nothing beside it
    from mha import conversion

    layer = N.MultiHeadAttention(8, 2, bias=True, query_size=8, key_size=8, value_size=8)
    weights = mha.random_weights(layer, seed=4)
    destination = tmp_path / "a.safetensors"
    destination.write_bytes(b"what the user had")
    original = conversion.read_file

    def changed(path, **kwargs):
        read, config = original(path, **kwargs)
        if change == "a weight lost":
            del read["b_o"]
        else:
            W_q = read["W_q"]
            read["W_q"] = (
                W_q.astype(np.float64) if change == "another dtype" else (np.nextafter(W_q, np.inf))
            )
        return read, config

    monkeypatch.setattr(conversion, "read_file", changed)
    with pytest.raises(ValueError, match="would not read back as the same weights"):
        interop.write_file(destination, weights, num_heads=2)
    assert destination.read_bytes() == b"what the user had"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.safetensors"]


def test_a_header_larger_than_the_file_is_refused_before_reading_it(tmp_path):
    path = tmp_path / "hostile.safetensors"
    path.write_bytes((2**40).to_bytes(8, "little") + b"{}")
    with pytest.raises(ValueError, match="header claims"):
        mha.load(path)
    path.write_bytes((1000).to_bytes(8, "little") + b"{}")
    with pytest.raises(ValueError, match="truncated"):
        mha.load(path)


def test_a_checkpoint_may_not_ask_for_an_unbounded_positional_table(tmp_path):
    import json

    from mha.checkpoints import FORMAT, write_safetensors

    path = tmp_path / "table.safetensors"
    config = {"num_hiddens": 1024, "dropout": 0.0, "max_len": 2**40, "dtype": "float32"}
    metadata = {"format": FORMAT, "class": "PositionalEncoding", "config": json.dumps(config)}
    write_safetensors(path, {}, metadata)
    assert path.stat().st_size < 1000
    with pytest.raises(ValueError, match="asks for a positional table"):
        mha.load(path)
    # A rotary embedding's table too: num_hiddens alone makes it
    config = {"num_hiddens": 2**34, "theta": 1e4, "interleaved": False, "dtype": "float32"}
    config.update(rotary_dim=None, scaling=None)
    metadata = {"format": FORMAT, "class": "RotaryEmbedding", "config": json.dumps(config)}
    write_safetensors(path, {}, metadata)
    with pytest.raises(ValueError, match="asks for a rotary table"):
        mha.load(path)


def test_booleans_other_than_0_and_1_and_too_many_axes_are_refused(tmp_path):
    import json

    from mha.checkpoints import read_safetensors

    def file(entry, data):
        header = json.dumps({"m": entry}).encode()
        path = tmp_path / "m.safetensors"
        path.write_bytes(len(header).to_bytes(8, "little") + header + data)
        return path

    # numpy would keep the byte 2 as a True whose negation is True too
    mask = {"dtype": "BOOL", "shape": [3], "data_offsets": [0, 3]}
    with pytest.raises(ValueError, match="bytes other than 0 and 1"):
        read_safetensors(file(mask, bytes([0, 1, 2])))
    tensors, _ = read_safetensors(file(mask, bytes([0, 1, 1])))
    np.testing.assert_array_equal(tensors["m"], [False, True, True])
    deep = {"dtype": "F32", "shape": [1] * 70, "data_offsets": [0, 4]}
    with pytest.raises(ValueError, match="not a valid safetensors file: 'm' has shape"):
        read_safetensors(file(deep, bytes(4)))


def test_a_header_nested_deeper_than_the_parser_goes_is_refused(tmp_path):
    # Python's JSON parser raises RecursionError there: the file is corrupt, not mha broken
    header = b"[" * 100_000 + b"]" * 100_000
    path = tmp_path / "deep.safetensors"
    path.write_bytes(len(header).to_bytes(8, "little") + header)
    with pytest.raises(ValueError, match="not JSON"):
        mha.load(path)


@pytest.mark.tensorflow
def test_keras_files_that_declare_more_than_they_hold_are_refused(tmp_path):
    framework_import("tensorflow")
    import h5py  # Keras's own file library

    huge = tmp_path / "huge.weights.h5"
    with h5py.File(huge, "w") as file:
        for dense in ("query_dense", "key_dense", "value_dense", "output_dense"):
            # Chunked and never written: a few KB on disk that claim 4 TiB
            file.create_dataset(
                f"{dense}/vars/0", shape=(2**20, 2**10, 2**10), dtype="f4", chunks=(1, 1, 1024)
            )
    assert huge.stat().st_size < 100_000
    with pytest.raises(ValueError, match="more than the file has"):
        interop.read_file(huge)
    groups = tmp_path / "groups.weights.h5"
    with h5py.File(groups, "w") as file:
        for dense in ("query_dense", "key_dense", "value_dense", "output_dense"):
            file.create_group(f"{dense}/vars/0")
    completed = subprocess.run(
        [sys.executable, "-m", "mha", "inspect", str(groups)],
        capture_output=True,
        text=True,
        check=False,
    )
    assert completed.returncode == 1 and "not an array" in completed.stderr
    assert "Traceback" not in completed.stderr
    assert [line for line in completed.stderr.splitlines() if line.startswith("mha ")] == [
        line for line in completed.stderr.splitlines() if "not an array" in line
    ]


def test_keras_files_whose_arrays_keras_would_cast_or_fetch_are_refused(tmp_path):
    # Keras casts every array to the layer's dtype and follows links as it loads: a file
    # of mixed dtypes would load as other numbers, a link would read another file's
    framework_import("tensorflow")
    import h5py  # Keras's own file library

    weights = mha.random_weights(
        N.MultiHeadAttention(D, H, query_size=D, key_size=D, value_size=D), seed=4
    )
    good = tmp_path / "good.weights.h5"
    interop.write_file(good, weights, num_heads=H)
    other = tmp_path / "other.h5"
    with h5py.File(other, "w") as file:
        file["data"] = np.full((D, H, D // H), 42.0, "f4")

    def changed(name, change):
        path = tmp_path / f"{name}.weights.h5"
        path.write_bytes(good.read_bytes())
        with h5py.File(path, "r+") as file:
            kernel = file["key_dense/vars/0"]
            data, attributes = kernel[...], dict(kernel.attrs)
            del file["key_dense/vars/0"]
            change(file, "key_dense/vars/0", data, attributes)
        return path

    def retyped(dtype, named=None):
        def change(file, name, data, attributes):
            file[name] = data.astype(dtype)
            for key, value in attributes.items():
                file[name].attrs[key] = value
            if named is not None:
                file[name].attrs["dtype"] = named

        return change

    cases = {
        "float64": (retyped("f8"), "different dtypes, which Keras would cast"),
        "int32": (retyped("i4"), "different dtypes"),
        "named float16": (retyped("f4", "float16"), "holds float32 numbers named float16"),
        "external link": (
            lambda file, name, *_: file.__setitem__(name, h5py.ExternalLink(str(other), "data")),
            "is a ExternalLink",
        ),
        "soft link": (
            lambda file, name, *_: file.__setitem__(name, h5py.SoftLink("/query_dense/vars/0")),
            "is a SoftLink",
        ),
        # Raw bytes: Keras writes them for bfloat16 alone, 2 each
        "raw float32": (
            lambda file, name, data, attributes: file.__setitem__(name, data.view("V4")),
            "holds raw 4-byte items named void32; Keras writes raw bytes for bfloat16 alone",
        ),
        # Parts that are not there, or not of one layer: named, not Keras's own messages
        "no kernel": (lambda *_: None, r"it has no key_dense/vars/0 \(the kernels\)"),
        "other head size": (
            lambda file, name, data, _: file.__setitem__(name, data[..., :1]),
            r"kernels that are not one layer's: query \(8, 2, 4\), key \(8, 2, 1\)",
        ),
        "one bias": (
            lambda file, name, data, _: file.update({name: data, "key_dense/vars/1": data[0]}),
            "only some projections have biases: key_dense",
        ),
    }
    for case, (change, message) in cases.items():
        with pytest.raises(ValueError, match=message):
            interop.read_file(changed(case.replace(" ", "_"), change), num_heads=H)
    read, _ = interop.read_file(good, num_heads=H)
    np.testing.assert_array_equal(read["W_k"], weights["W_k"])


@pytest.mark.torch
@pytest.mark.filterwarnings("ignore:.*(quantized|TypedStorage).*:UserWarning")
@pytest.mark.parametrize("kind", ["sparse", "quantized", "meta", "float8", "int64"])
def test_torch_files_of_foreign_tensors_are_one_error(tmp_path, kind):
    torch = framework_import("torch")
    weight = torch.ones(3 * D, D)
    tensor = {
        "sparse": lambda: weight.to_sparse(),
        "quantized": lambda: torch.quantize_per_tensor(weight, 0.1, 0, torch.qint8),
        "meta": lambda: torch.empty(3 * D, D, device="meta"),
        "float8": lambda: weight.to(torch.float8_e4m3fn),
        "int64": lambda: weight.to(torch.int64),
    }[kind]()
    path = tmp_path / f"{kind}.pt"
    torch.save({"in_proj_weight": tensor, "out_proj.weight": torch.ones(D, D)}, path)
    with pytest.raises(ValueError, match="mha reads dense float"):
        interop.read_file(path, num_heads=H)


def test_a_header_naming_a_key_twice_or_a_newer_format_is_refused(tmp_path):
    import json
    import struct

    from mha.checkpoints import FORMAT, write_safetensors

    path = saved(tmp_path)
    content = path.read_bytes()
    (size,) = struct.unpack("<Q", content[:8])
    header = content[8 : 8 + size].decode()
    # A second __metadata__ object, which the reference parser refuses: the last would win
    doubled = header.replace("{", '{"__metadata__":{"format":"other"},', 1).encode()
    doubled += b" " * (-len(doubled) % 8)
    path.write_bytes(struct.pack("<Q", len(doubled)) + doubled + content[8 + size :])
    with pytest.raises(ValueError, match="'__metadata__' more than once"):
        mha.load(path)
    newer = tmp_path / "newer.safetensors"
    config = {"num_hiddens": 4, "dropout": 0.0, "max_len": 8, "dtype": "float32"}
    metadata = {
        "format": FORMAT,
        "format_version": "2",
        "class": "PositionalEncoding",
        "config": json.dumps(config),
    }
    write_safetensors(newer, {}, metadata)
    with pytest.raises(ValueError, match="format version '2'"):
        mha.load(newer)


def metadata_file(tmp_path, name, metadata):
    from mha.checkpoints import write_safetensors

    path = tmp_path / name
    write_safetensors(path, {}, metadata)
    return path


def test_json_inside_a_file_naming_a_key_twice_or_nested_too_deep_is_refused(tmp_path):
    # The JSON inside a file is read by the header's rules: the last of two keys would win
    from mha.checkpoints import FORMAT, FORMAT_VERSION

    once = '{"num_hiddens": 4, "dropout": 0.0, "max_len": 8, "dtype": "float32"}'
    configs = {
        "twice": (once.replace("}", ', "max_len": 16}'), "'max_len' more than once"),
        "deep": ("[" * 100_000 + "]" * 100_000, "nests deeper"),
    }
    for name, (config, message) in configs.items():
        metadata = {"format": FORMAT, "format_version": FORMAT_VERSION}
        metadata.update({"class": "PositionalEncoding", "config": config})
        with pytest.raises(ValueError, match=f"corrupted config in its metadata: .*{message}"):
            mha.load(metadata_file(tmp_path, f"{name}.safetensors", metadata))
        cases = {"format": mha.golden.FORMAT, "format_version": mha.golden.FORMAT_VERSION}
        golden = metadata_file(tmp_path, f"{name}-cases.safetensors", {**cases, "cases": config})
        with pytest.raises(ValueError, match=f"not a valid golden-case file: .*{message}"):
            mha.golden.read(golden)
        model = tmp_path / name / "config.json"
        model.parent.mkdir()
        model.write_text(config)
        with pytest.raises(ValueError, match=f"cannot read the config .*{message}"):
            mha.porting.options_from_config(model)


@pytest.mark.parametrize("seed", ["-1", "4294967296", "x"])
def test_compare_with_a_bad_seed_is_a_usage_error(seed):
    completed = subprocess.run(
        [sys.executable, "-m", "mha", "compare", "--backends", "numpy", "--seed", seed],
        capture_output=True,
        text=True,
        check=False,
    )
    assert completed.returncode == 2 and "--seed" in completed.stderr
    assert "Traceback" not in completed.stderr


def _a_torch_file(tmp_path):
    """good.pt, a layer's weights as torch writes them, and those weights."""
    weights = mha.random_weights(
        N.MultiHeadAttention(D, H, query_size=D, key_size=D, value_size=D), seed=5
    )
    good = tmp_path / "good.pt"
    interop.write_file(good, weights)
    return good, weights


def test_a_torch_file_whose_entries_claim_more_than_it_holds_is_refused_unread(tmp_path):
    # The central directory says 2**31 bytes for the data: refused before any entry is read
    import zipfile

    framework_import("torch")
    good, _ = _a_torch_file(tmp_path)
    with zipfile.ZipFile(good) as archive:
        name = next(e for e in archive.infolist() if e.filename.endswith("/data/0")).filename
    raw = bytearray(good.read_bytes())
    start = raw.find(b"PK\x01\x02")  # each central directory record
    while start != -1:
        name_length = int(np.frombuffer(raw[start + 28 : start + 30], "<u2")[0])
        if raw[start + 46 : start + 46 + name_length] == name.encode():
            raw[start + 20 : start + 28] = np.array([2**31, 2**31], "<u4").tobytes()
        start = raw.find(b"PK\x01\x02", start + 1)
    claiming = tmp_path / "claiming.pt"
    claiming.write_bytes(bytes(raw))
    with pytest.raises(ValueError, match="its entries declare more bytes than the file holds"):
        interop.read_file(claiming, num_heads=H)


def test_a_damaged_or_compressed_torch_file_is_refused(tmp_path):
    # torch checks no CRC-32 of its zip entries: a flipped bit would load as another weight
    import zipfile

    torch = framework_import("torch")
    good, weights = _a_torch_file(tmp_path)
    with zipfile.ZipFile(good) as archive:
        entry = next(e for e in archive.infolist() if e.filename.endswith("/data/0"))
    flipped = bytearray(good.read_bytes())
    # The data follow the local header (30 bytes), its name and its own extra field
    header = entry.header_offset
    name_length, extra_length = np.frombuffer(flipped[header + 26 : header + 30], "<u2")
    start = header + 30 + int(name_length) + int(extra_length)
    flipped[start + 2] ^= 0x40
    damaged = tmp_path / "damaged.pt"
    damaged.write_bytes(bytes(flipped))
    states = [torch.load(path, weights_only=True) for path in (good, damaged)]
    assert any(not torch.equal(states[0][key], states[1][key]) for key in states[0])
    with pytest.raises(
        ValueError, match=r"entry .*/data/0 fails its checksum: the file is damaged"
    ):
        interop.read_file(damaged, num_heads=H)
    # A compressed entry may unpack to far more than the file holds; torch writes none
    compressed = tmp_path / "compressed.pt"
    with zipfile.ZipFile(good) as source, zipfile.ZipFile(compressed, "w") as target:
        for entry in source.infolist():
            target.writestr(entry, source.read(entry), compress_type=zipfile.ZIP_DEFLATED)
    assert (
        torch.load(compressed, weights_only=True).keys()
        == torch.load(good, weights_only=True).keys()
    )
    with pytest.raises(ValueError, match=r"its entry \S+ is compressed; torch stores each"):
        interop.read_file(compressed, num_heads=H)
    read, _ = interop.read_file(good, num_heads=H)
    np.testing.assert_array_equal(read["W_q"], weights["W_q"])


@pytest.mark.filterwarnings("ignore:`torch.jit.*deprecated:DeprecationWarning")
def test_a_torch_file_of_a_whole_module_or_a_torchscript_one_says_what_it_is(tmp_path):
    # Neither is a state_dict; torch's own first line names neither, and holds terminal bold
    torch = framework_import("torch")
    module = torch.nn.MultiheadAttention(D, H)
    torch.save(module, tmp_path / "module.pt")
    torch.jit.save(torch.jit.script(torch.nn.Linear(D, D)), tmp_path / "script.pt")
    for name, message in [
        ("module.pt", r"It would import torch\.nn\.modules\.activation\.MultiheadAttention"),
        ("script.pt", r"it is a TorchScript archive \(torch\.jit\.save\), not a state_dict"),
    ]:
        with pytest.raises(ValueError, match=message) as raised:
            interop.read_file(tmp_path / name, num_heads=H)
        assert "\x1b" not in str(raised.value) and "nothing in it was executed" in str(raised.value)


def test_a_torch_file_with_an_entry_named_twice_is_refused(tmp_path):
    # Two data/0 entries of valid checksums: torch reads one of them, and nothing says which
    import warnings
    import zipfile

    torch = framework_import("torch")
    good, _ = _a_torch_file(tmp_path)
    twice = tmp_path / "twice.pt"
    with zipfile.ZipFile(good) as source, zipfile.ZipFile(twice, "w") as target:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # zipfile's "Duplicate name"
            for entry in source.infolist():
                data = source.read(entry)
                target.writestr(entry, data)
                if entry.filename.endswith("/data/0"):
                    target.writestr(entry, bytes(len(data)))  # zeros in its place
    loaded = torch.load(twice, weights_only=True)
    assert loaded.keys() == torch.load(good, weights_only=True).keys()
    with pytest.raises(ValueError, match=r"more than one entry named \S+/data/0"):
        interop.read_file(twice, num_heads=H)


def test_a_header_entry_whose_dtype_or_metadata_is_of_another_type_is_refused(tmp_path):
    import json
    import struct

    def written(header):
        encoded = json.dumps(header).encode()
        path = tmp_path / "header.safetensors"
        path.write_bytes(struct.pack("<Q", len(encoded)) + encoded + bytes(4))
        return path

    entry = {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}
    for dtype in (["F32"], {"F32": 1}, 32):
        with pytest.raises(ValueError, match=r"'W_q' has dtype .*, which mha does not read"):
            mha.load(written({"W_q": {**entry, "dtype": dtype}}))
    # Metadata that is not a map is not an empty one
    for metadata in ([], 0, ""):
        with pytest.raises(ValueError, match=r"its __metadata__ is not a map of strings"):
            mha.load(written({"__metadata__": metadata, "W_q": entry}))


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="FIFOs are POSIX's")
@pytest.mark.torch
def test_a_torch_file_of_views_repeating_their_storage_is_refused(tmp_path):
    # torch.save keeps an expanded view as one element and a stride of 0: a file of a few
    # hundred bytes whose tensors would be gigabytes read
    torch = framework_import("torch")
    one = torch.zeros(1)
    state = {
        "in_proj_weight": one.expand(3 * 4096, 4096),
        "out_proj.weight": one.expand(4096, 4096),
    }
    torch.save(state, tmp_path / "views.pt")
    with pytest.raises(ValueError, match=r"repeats a storage of 4 .* stride of 0"):
        interop.read_file(tmp_path / "views.pt", num_heads=H)
    # Views sharing one storage whole, as a layer's q, k and v of one in_proj, are read
    whole = torch.randn(3 * D, D, dtype=torch.float64)
    state = {"in_proj_weight": whole, "out_proj.weight": whole[:D].t()}
    torch.save(state, tmp_path / "shared.pt")
    weights, _ = interop.read_file(tmp_path / "shared.pt", num_heads=H)
    np.testing.assert_array_equal(weights["W_o"], whole[:D].numpy())  # (in, out): W^T


def test_a_path_that_is_not_a_regular_file_is_one_error(tmp_path):
    # A FIFO would wait for a writer and a device read without end: refused before opening
    folder = tmp_path / "folder.safetensors"
    folder.mkdir()
    fifo = tmp_path / "fifo.safetensors"
    os.mkfifo(fifo)
    endless = tmp_path / "endless.msgpack"
    endless.symlink_to("/dev/zero")
    for path in (folder, fifo):
        with pytest.raises(ValueError, match="is not a regular file"):
            mha.load(path)
    for path in (folder, fifo, endless):
        with pytest.raises(ValueError, match="is not a regular file"):
            interop.read_file(path)
        with pytest.raises(ValueError, match="is not a regular file"):
            mha.porting.options_from_config(path)
    with pytest.raises(FileNotFoundError):
        mha.load(tmp_path / "missing.safetensors")


def test_a_destination_that_is_not_a_regular_file_is_left_as_it_is(tmp_path):
    # A rename would put a file in place of a FIFO or a device (/dev/null): refused, unwritten
    source = saved(tmp_path)
    fifo = tmp_path / "fifo.safetensors"
    os.mkfifo(fifo)
    with pytest.raises(ValueError, match="is not a regular file"):
        mha.save(N.MultiHeadAttention(D, H, query_size=D, key_size=D, value_size=D), fifo)
    completed = subprocess.run(
        [sys.executable, "-m", "mha", "convert", str(source), str(fifo)],
        capture_output=True,
        text=True,
        check=False,
    )
    assert completed.returncode == 1 and "is not a regular file" in completed.stderr
    assert stat.S_ISFIFO(os.lstat(fifo).st_mode)
    assert not [p for p in os.listdir(tmp_path) if p.startswith(".mha-")]


def test_a_file_replaced_by_root_stays_its_owners(tmp_path):
    if not hasattr(os, "geteuid") or os.geteuid() != 0:
        pytest.skip("only root may give a file to another user")
    path = saved(tmp_path)
    os.chown(path, 12345, 23456)
    os.chmod(path, 0o600)
    interop.convert(saved(tmp_path, "b.safetensors"), path)
    assert (os.stat(path).st_uid, os.stat(path).st_gid, mode(path)) == (12345, 23456, 0o600)


def test_a_file_holding_no_attention_layer_is_named_in_the_error(tmp_path):
    torch = framework_import("torch")
    path = tmp_path / "other.pt"
    torch.save({"linear.weight": torch.zeros(2, 2)}, path)
    with pytest.raises(ValueError) as caught:
        interop.read_file(path, num_heads=H)
    assert str(caught.value).startswith(f"{path}: Not a torch.nn.MultiheadAttention state_dict")


@pytest.mark.parametrize("refused", ["mkstemp", "replace"])
def test_a_refused_step_of_the_write_names_the_destination(tmp_path, monkeypatch, refused):
    # A read-only folder refuses the temporary file, another file system the rename: the
    # error names the file the user asked for, never the temporary one
    import errno
    import re
    import tempfile

    path = saved(tmp_path)
    before = path.read_bytes()

    def refuse(*args, **kwargs):
        raise PermissionError(errno.EACCES, "Permission denied", ".mha-temporary")

    monkeypatch.setattr(
        *((tempfile, "mkstemp") if refused == "mkstemp" else (os, "replace")), refuse
    )
    with pytest.raises(
        OSError,
        match=f"writing {re.escape(str(path))} failed: Permission denied; .* left as it was",
    ):
        mha.save(N.MultiHeadAttention(D, H, query_size=D, key_size=D, value_size=D), path)
    assert path.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == [path.name]


def test_a_file_one_byte_over_the_limit_is_refused_not_cut(tmp_path):
    # read_bytes checks the size before reading: a file of limit + 1 bytes whose first limit
    # bytes are a whole JSON document is refused, never read as that cut document; a file of
    # exactly limit bytes is read whole
    from mha.files import parse_json, read_bytes

    document = b'{"num_heads": 4}'
    whole = tmp_path / "whole.json"
    whole.write_bytes(document)
    assert parse_json(read_bytes(whole, len(document))) == {"num_heads": 4}
    longer = tmp_path / "longer.json"
    longer.write_bytes(document + b"x")
    with pytest.raises(ValueError, match=f"holds {len(document) + 1} bytes, more than"):
        read_bytes(longer, len(document))


def test_the_new_bytes_reach_the_disk_before_they_replace_the_old(tmp_path, monkeypatch):
    # The module's promise: the temporary file is flushed to the disk (fsync of a regular
    # file), then moved over the destination, then the folder is synced; seen here by
    # recording the calls the write makes
    from mha.files import write_atomically

    destination = tmp_path / "a.json"
    destination.write_bytes(b"old")
    events = []
    fsync, replace = os.fsync, os.replace

    def recorded_fsync(handle):
        kind = "file" if stat.S_ISREG(os.fstat(handle).st_mode) else "folder"
        events.append(("fsync", kind))
        return fsync(handle)

    def recorded_replace(source, target):
        with open(source, "rb") as file:
            events.append(("replace", os.fspath(target), file.read()))
        return replace(source, target)

    monkeypatch.setattr(os, "fsync", recorded_fsync)
    monkeypatch.setattr(os, "replace", recorded_replace)
    write_atomically(destination, b"new")
    assert events == [
        ("fsync", "file"),
        ("replace", os.fspath(destination), b"new"),
        ("fsync", "folder"),
    ]
    assert destination.read_bytes() == b"new"


def test_an_interrupted_write_leaves_the_destination_and_no_temporary_file(tmp_path):
    # Ctrl-C (KeyboardInterrupt, no Exception) while the new file is checked: it propagates,
    # the destination keeps its bytes, and the folder holds nothing else
    from mha.files import write_atomically

    destination = tmp_path / "a.json"
    destination.write_bytes(b"old")

    def interrupted(temporary):
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        write_atomically(destination, b"new", check=interrupted)
    assert destination.read_bytes() == b"old"
    assert os.listdir(tmp_path) == ["a.json"]
