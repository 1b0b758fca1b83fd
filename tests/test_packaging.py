"""The published extras install into the environments users already have.

pip itself answers, in dry runs with no index (`pip install --dry-run --report`): what would
`pip install "mha[torch,tensorflow]"` change in this environment, one that already has the
frameworks of its lane? Nothing but mha, or the extras are pinned where they should be ranges.
The metadata comes from pyproject.toml as pip builds it now, not from an earlier install.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import os
import pathlib
import re
import shutil
import subprocess
import sys
import tarfile
import venv

import pytest
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet

from conftest import required_backends

ROOT = pathlib.Path(__file__).resolve().parents[1]

# Backend -> the extra that installs its framework. TensorFlow has two, one per build.
EXTRA_OF_BACKEND = {"torch": "torch", "tensorflow": "tensorflow", "mxnet": "mxnet", "jax": "jax"}
TENSORFLOW_BUILDS = {"tensorflow": "tensorflow", "tensorflow-cpu": "tensorflow-cpu"}


def pip_install(*arguments, python=None):
    """`pip install --dry-run --no-index` here, or in the environment of `python`."""
    target = ["--python", str(python)] if python else []
    command = [sys.executable, "-m", "pip", *target, "install", "--dry-run", "--no-index"]
    return subprocess.run(
        [*command, *arguments], capture_output=True, text=True, check=False, cwd=ROOT
    )


def dry_run(*requirements, python=None):
    """The packages that `pip install` of `requirements` would install (none: it changes
    nothing). Without an index, a package that would be downloaded fails the test."""
    completed = pip_install(
        "--no-build-isolation", "--report", "-", "-q", *requirements, python=python
    )
    assert completed.returncode == 0, f"pip would need to download: {completed.stderr[-2000:]}"
    return json.loads(completed.stdout)["install"]


@pytest.fixture(scope="module")
def requirements():
    """{extra: [Requirement]} of mha's metadata, built from pyproject.toml as it is now."""
    (project,) = dry_run("--no-deps", "-e", ".")
    by_extra: dict[str, list[Requirement]] = {}
    for line in project["metadata"]["requires_dist"]:
        requirement = Requirement(line)
        extras = [
            extra
            for extra in project["metadata"]["provides_extra"]
            if requirement.marker is not None and requirement.marker.evaluate({"extra": extra})
        ]
        for extra in extras or [None]:
            by_extra.setdefault(extra, []).append(requirement)
    return by_extra


def without_marker(requirement):
    """The requirement as a user would type it: `name[extras]specifier`."""
    plain = Requirement(str(requirement))
    plain.marker = None
    return str(plain)


def installed(name):
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def lane_extras():
    """The extras that install the frameworks this run requires, TensorFlow's as installed."""
    extras = [EXTRA_OF_BACKEND[name] for name in required_backends() if name != "numpy"]
    if "tensorflow" in extras and installed("tensorflow") is None:
        extras[extras.index("tensorflow")] = "tensorflow-cpu"
    return extras


def test_extras_are_ranges_with_lower_bounds(requirements):
    for extra in ("torch", "tensorflow", "tensorflow-cpu", "mxnet", "jax"):
        for requirement in requirements[extra]:
            operators = {spec.operator for spec in requirement.specifier}
            if extra == "mxnet":  # 1.9.1 is MXNet's last release, and it predates numpy 2
                assert str(requirement) in (
                    'mxnet==1.9.1; extra == "mxnet"',
                    'numpy<2; extra == "mxnet"',
                )
            else:
                assert ">=" in operators and "==" not in operators, f"{extra}: {requirement}"
    (every,) = requirements["all"]
    assert every.name == "mha" and every.extras == {"torch", "tensorflow", "mxnet", "jax"}
    # mha itself needs numpy alone, and any numpy from 1.23 on, numpy 2 included
    (numpy,) = requirements[None]
    assert numpy.name == "numpy" and numpy.specifier.contains("2.4.0")
    assert numpy.specifier.contains("1.26.4")


def test_each_tensorflow_extra_names_one_build(requirements):
    # Installing one build over the other would overwrite the user's TensorFlow
    for extra, build in TENSORFLOW_BUILDS.items():
        names = {requirement.name for requirement in requirements[extra]}
        assert build in names and (set(TENSORFLOW_BUILDS.values()) - {build}).isdisjoint(names)
    # MXNet's numpy < 2 comes only with the mxnet extra (and so with all)
    for extra in ("torch", "tensorflow", "tensorflow-cpu", "jax"):
        assert "numpy" not in {requirement.name for requirement in requirements[extra]}


def test_installing_the_lanes_extras_here_changes_no_package():
    extras = lane_extras()
    to_install = dry_run("-e", f".[{','.join(extras)}]")
    assert [package["metadata"]["name"] for package in to_install] == ["mha"], extras


def _environment_like_this_one(tmp_path, rename):
    """A new environment whose installed packages are this one's, by metadata alone, with the
    distributions in `rename` installed under another name (a user's other TensorFlow build)."""
    environment = tmp_path / "environment"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", environment], check=True)
    python = environment / "bin" / "python"
    site_packages = pathlib.Path(
        subprocess.run(
            [python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
    )
    written = {"mha"}
    for distribution in importlib.metadata.distributions():
        name = distribution.metadata["Name"]
        if name in written:  # the first on sys.path is the one imported
            continue
        written.add(name)
        metadata = distribution.read_text("METADATA")
        new_name = rename.get(name.lower().replace("_", "-"), name)
        metadata = metadata.replace(f"Name: {name}\n", f"Name: {new_name}\n", 1)
        folder = site_packages / f"{new_name.replace('-', '_')}-{distribution.version}.dist-info"
        folder.mkdir()
        (folder / "METADATA").write_text(metadata)
    return python


@pytest.mark.tensorflow
def test_a_user_with_the_standard_tensorflow_build_keeps_it(requirements, tmp_path):
    # This lane has the CPU-only build; the user's environment has the standard one instead
    if installed("tensorflow-cpu") is None or "tensorflow" not in required_backends():
        pytest.skip("this lane installs no tensorflow-cpu to stand for the standard build")
    python = _environment_like_this_one(tmp_path, {"tensorflow-cpu": "tensorflow"})
    # mha[torch,tensorflow], and mha[all] = mha[torch,tensorflow,mxnet] where MXNet is here
    extras = [extra.replace("tensorflow-cpu", "tensorflow") for extra in lane_extras()]
    wanted = {
        without_marker(requirement) for extra in extras for requirement in requirements[extra]
    }
    assert dry_run(*sorted(wanted), python=python) == []
    # The CPU-only extra would install the other build: the two are not interchangeable
    completed = pip_install(*map(without_marker, requirements["tensorflow-cpu"]), python=python)
    assert completed.returncode != 0 and "tensorflow-cpu" in completed.stderr


def _load_lanes():
    spec = importlib.util.spec_from_file_location("lanes", ROOT / "lanes.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def _pins(path):
    lines = (line.strip() for line in path.read_text().splitlines())
    return dict(line.split("==") for line in lines if line and not line.startswith("#"))


def test_each_lanes_constraints_pin_what_the_lane_is():
    lanes = _load_lanes().LANES
    assert set(lanes) == {"legacy", "current"}
    legacy, current = (
        _pins(ROOT / lanes["legacy"].constraints),
        _pins(ROOT / lanes["current"].constraints),
    )
    assert legacy["numpy"].startswith("1.26.") and legacy["mxnet"] == "1.9.1"
    assert int(current["numpy"].split(".")[0]) >= 2 and "mxnet" not in current
    assert legacy["torch"] == current["torch"] == "2.13.0"
    for lane, pins in (("legacy", legacy), ("current", current)):
        backends = lanes[lane].backends.split(",")
        assert ("mxnet" in backends) == ("mxnet" in pins), lane
        assert {"torch", "tensorflow-cpu", "jax", "flax"} <= {
            name.lower().replace("_", "-") for name in pins
        }
        assert "jax" in backends, lane
    # jax 0.7.1 is the newest that installs beside numpy 1.26 (and so beside MXNet)
    assert legacy["jax"] == "0.7.1" and legacy["flax"].startswith("0.12.")


def test_the_tests_the_legacy_lane_leaves_out_run_on_the_same_releases():
    # lanes.py runs the tests of torch or TensorFlow alone in the current lane only: that
    # holds while the lanes differ in numpy, its dtype extension, JAX and MXNet alone
    module = _load_lanes()
    lanes = module.LANES
    assert lanes["legacy"].select == module.SAME_IN_BOTH_ONCE
    assert lanes["current"].select == "not mxnet"  # MXNet needs numpy < 2
    legacy, current = (_pins(ROOT / lanes[name].constraints) for name in ("legacy", "current"))
    # The current lane alone installs the documentation site's packages (the docs extra),
    # which no test of torch or TensorFlow imports
    both = set(legacy) & set(current)
    differ = {name for name in both if legacy[name] != current[name]} | (set(legacy) - both)
    numpy_and_its_own = {"numpy", "ml_dtypes", "jax", "jaxlib", "flax", "mxnet", "graphviz"}
    assert differ <= numpy_and_its_own, sorted(differ - numpy_and_its_own)
    assert {"torch", "tensorflow_cpu", "keras", "onnx", "onnxruntime"} <= set(legacy)


def test_every_package_of_the_lane_installs_on_the_python_the_readme_names():
    # The packages' own Requires-Python, not a list kept by hand: a new pin that needs a newer
    # Python fails here until lanes.py and the README say so
    module = _load_lanes()
    lanes = module.LANES
    here = pathlib.Path(sys.prefix).resolve()
    mine = [lane for lane in lanes.values() if (ROOT / lane.environment).resolve() == here]
    oldest = max(lane.python for lane in (mine or lanes.values()))
    version = ".".join(map(str, oldest + (0,) * (3 - len(oldest))))
    for distribution in importlib.metadata.distributions():
        needs = distribution.metadata["Requires-Python"]
        if needs:
            assert version in SpecifierSet(needs), (distribution.metadata["Name"], needs)
    readme = " ".join((ROOT / "README.md").read_text().split())
    legacy, current = (module.span(lanes[name]) for name in ("legacy", "current"))
    assert f"with only Python {legacy} installed" in readme
    assert f"current lane takes {current};" in readme


@pytest.mark.skipif(os.name == "nt", reason="the stand-in Pythons are POSIX shell scripts")
def test_a_lanes_environment_is_made_with_a_python_in_its_span(tmp_path, monkeypatch):
    # Where the running Python is outside the span the lane's pins install on, the newest
    # python3.X on the PATH inside it makes the environment; with none, lanes.py stops first
    module = _load_lanes()
    assert module.python_for("legacy", running=(3, 11, 7)) == sys.executable
    assert module.python_for("current", running=(3, 13, 0)) == sys.executable
    found = tmp_path / "bin"
    found.mkdir()
    for version in ("3 11 9", "3 12 4", "3 13 1"):
        stub = found / f"python3.{version.split()[1]}"  # prints its version, as version_of asks
        stub.write_text(f"#!/bin/sh\necho {version}\n")
        stub.chmod(0o755)
    monkeypatch.setenv("PATH", str(found))
    assert module.python_for("legacy", running=(3, 13, 0)) == str(found / "python3.12")
    assert module.python_for("current", running=(3, 14, 2)) == str(found / "python3.13")
    assert module.python_for("current", running=(3, 11, 4)) == str(found / "python3.13")
    (found / "python3.12").unlink()
    (found / "python3.11").write_text("#!/bin/sh\nexit 1\n")  # a Python that does not run
    with pytest.raises(SystemExit, match=r"legacy lane needs Python 3\.11 to 3\.12.* 3\.13\.0,"):
        module.python_for("legacy", running=(3, 13, 0))


def test_ci_runs_the_readmes_test_command():
    readme = (ROOT / "README.md").read_text()
    commands = re.findall(r"```sh\n(.*?)\n```", readme, re.S)
    ci = [
        line
        for line in (ROOT / ".ci" / "run").read_text().splitlines()
        if line and not line.startswith(("#", "set ", "cd "))
    ]
    assert [line.split("  #")[0] for line in ci] == [commands[1]]
    assert "mha compare" in commands[0]


def _run(*command, cwd=None):
    completed = subprocess.run(
        [str(part) for part in command], capture_output=True, text=True, timeout=300, cwd=cwd
    )
    assert completed.returncode == 0, completed.stdout + completed.stderr
    return completed


@pytest.mark.slow
def test_the_built_wheel_installs_and_runs_in_a_new_environment(tmp_path):
    # What a package index takes: `python -m build` makes the sdist and the wheel of what the
    # package is (pyproject.toml, README.md, LICENSE, MANIFEST.in, mha/), twine checks them as
    # the index would, and the wheel, installed into an environment of its own with its dependencies
    # alone, runs `mha compare --backends numpy`
    source = tmp_path / "source"
    source.mkdir()
    for name in ("pyproject.toml", "README.md", "LICENSE", "MANIFEST.in"):
        (source / name).write_bytes((ROOT / name).read_bytes())
    ignored = shutil.ignore_patterns("__pycache__", "*.pyc")
    shutil.copytree(ROOT / "mha", source / "mha", ignore=ignored)
    # A test beside the package, as in a clone: setuptools would ship it, without the helpers
    # it imports (conftest.py, the case tables), where MANIFEST.in leaves the tests out
    (source / "tests").mkdir()
    shutil.copyfile(ROOT / "tests" / "test_harness.py", source / "tests" / "test_harness.py")
    dist = tmp_path / "dist"
    _run(sys.executable, "-m", "build", "--outdir", dist, source)
    version = importlib.metadata.version("mha")
    wheel, sdist = f"mha-{version}-py3-none-any.whl", f"mha-{version}.tar.gz"
    assert sorted(path.name for path in dist.iterdir()) == [wheel, sdist]
    with tarfile.open(dist / sdist) as archive:
        assert not [name for name in archive.getnames() if "/tests" in name]
    checked = _run(sys.executable, "-m", "twine", "check", "--strict", dist / wheel, dist / sdist)
    assert checked.stdout.count("PASSED") == 2, checked.stdout
    environment = tmp_path / "environment"
    venv.create(environment, with_pip=True)
    bin_folder = environment / ("Scripts" if os.name == "nt" else "bin")
    _run(bin_folder / "python", "-m", "pip", "install", "-q", dist / wheel)
    completed = subprocess.run(
        [str(bin_folder / "mha"), "compare", "--backends", "numpy"],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,  # not the repository: the installed package is the one imported
    )
    assert completed.returncode == 3, completed.stdout + completed.stderr
    assert "nothing was compared across frameworks" in completed.stdout


def test_the_install_hints_name_what_each_extra_requires():
    # A missing backend's hint installs its framework as mha's extra of that name requires it
    # (mha itself comes from its folder or wheel, which no package index holds)
    import tomllib

    from mha import registry

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    for name, hint in registry.INSTALL.items():
        if hint is None:
            continue
        for requirement in project["optional-dependencies"][name]:
            if Requirement(requirement).name != "ml_dtypes":  # bfloat16 weights alone need it
                assert f'"{requirement}"' in hint, (name, requirement)
