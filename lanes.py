"""Run the whole test suite in each lane, each lane in its own virtual environment.

    python3 lanes.py                           # set up both lanes (once) and run the tests in each
    python3 lanes.py current                   # one lane
    python3 lanes.py legacy -- -m torch -x     # arguments after -- go to pytest
    python3 lanes.py --lock current            # regenerate the lane's constraints file
    python3 lanes.py gpu                       # the GPU lane, in this Python (see below)

A lane is a set of frameworks that install together, pinned by its constraints file:

- legacy: every backend in one process, MXNet 1.9.1 included, so numpy 1.26 (MXNet's last
  release predates NumPy 2) and the newest JAX and Flax that install beside it (jax 0.7.1).
  Its environment is `.venv`, the README's quick start.
- current: numpy 2 with the newest torch, TensorFlow, JAX and Flax that install on the lane's
  Python (3.11 here: numpy 2.4, jax 0.10; 3.12 on gets newer ones); no MXNet. Its environment
  is `.venv-current`.

A lane's environment is made with the Python that runs lanes.py where the lane's pins install
on it (legacy: 3.11 and 3.12, as on 3.13 ml_dtypes asks for numpy 2, which MXNet cannot take;
current: 3.11.5 to 3.13, TensorFlow 2.21 having no build for 3.14), otherwise with the newest
python3.X on the PATH that fits; with none, lanes.py stops and names the Pythons to install.

torch and TensorFlow are the same releases in both lanes, so the tests of those two alone run
once, in the current lane; the legacy lane runs the rest (SAME_IN_BOTH_ONCE below). The
current lane leaves out the tests marked mxnet, which only the legacy lane can run.

Each run installs the project into each lane's environment with the lane's constraints, the
lanes side by side (quick when nothing changed), then runs pytest in each with
MHA_TEST_BACKENDS naming the lane's backends, so a backend of the lane that does not import
fails its tests. pytest-xdist spreads the tests over one worker per core (up to 4), each with
one thread per framework (ONE_THREAD_EACH), the tests marked slow first and those of one
xdist_group (a case of the agreement matrix) in one worker; arguments after -- that choose
their own (-n 0, -p no:xdist) turn that off. XLA compiles without LLVM's optimizations
(QUICK_XLA). The suite's own options name the 25 slowest tests at the end. The processes of a
run share JAX's compilation cache, in a folder removed after it. `--lock` installs the lane's
extras into a new environment with no constraints, that is the newest releases that fit the
lane, and writes what was installed as the lane's constraints file.

The gpu lane runs on a machine with an accelerator, in the Python that runs lanes.py, with the
packages such a machine has (torch and jax with CUDA, flax; no TensorFlow, MXNet or pytest)
and nothing to download: each step of tests/gpu_lane.py in its own process under a time limit,
the checks side by side (the agreement matrix, the masked-key and synchronization checks, the
frameworks' own attention functions held to the reference), then a short benchmark alone. With no
GPU visible it says so and exits 0 (3 where MHA_GPU_LANE_OUT asks for its reports);
`python3 lanes.py gpu --device cpu` runs it on the CPU,
each phase given four times as long (CPU_SLOWER). With MHA_GPU_LANE_OUT naming a folder,
the benchmark also writes its JSON reports there.
It uses only the standard library, so that it runs with nothing but Python 3.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import os
import pathlib
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import venv

ROOT = pathlib.Path(__file__).resolve().parent


@dataclasses.dataclass(frozen=True)
class Lane:
    environment: str  # folder of the virtual environment, in the repository
    constraints: str  # the lane's exact versions
    extras: str  # the extras of mha the lane installs
    backends: str  # MHA_TEST_BACKENDS: the backends the lane requires
    # What --lock asks for beyond the extras. torch stays 2.13.0 in both lanes: it is the only
    # CPU build this project's machines have, and any other release pulls in CUDA wheels.
    lock: tuple[str, ...]
    # pytest's -m expression of the tests the lane runs; "" runs them all
    select: str = ""
    # The oldest Python every pin of the lane installs on (mha's own code takes 3.10)
    python: tuple[int, ...] = (3, 11)
    # The first Python the lane's pins do not install on
    python_below: tuple[int, ...] = (3, 14)  # TensorFlow 2.21: none for 3.14


# torch, TensorFlow, Keras, ONNX and LiteRT are the same releases in both lanes
# (tests/test_packaging.py holds them equal): a test of torch or TensorFlow alone, naming none
# of the backends whose release differs (numpy, MXNet, JAX), runs in the current lane only,
# unless marked every_lane (the notebooks run with every backend); the documentation site's
# tests (marked docs) run in the current lane, which installs the docs extra
SAME_IN_BOTH_ONCE = (
    "(every_lane or numpy or mxnet or jax or not (torch or tensorflow)) and not docs"
)

LANES = {
    "legacy": Lane(
        environment=".venv",
        constraints="constraints.txt",
        extras="torch,tensorflow-cpu,mxnet,jax,test,notebooks",
        backends="numpy,torch,tensorflow,mxnet,jax",
        # jax 0.7.2 and later need numpy 2
        lock=("numpy<2", "torch==2.13.0", "jax<0.7.2"),
        select=SAME_IN_BOTH_ONCE,
        python_below=(3, 13),  # on 3.13 ml_dtypes asks for numpy 2, which MXNet cannot take
    ),
    "current": Lane(
        environment=".venv-current",
        constraints="constraints-current.txt",
        extras="torch,tensorflow-cpu,jax,test,notebooks,docs",
        backends="numpy,torch,tensorflow,jax",
        lock=("numpy>=2", "torch==2.13.0"),
        # MXNet needs numpy < 2: its tests are the legacy lane's, not skips here
        select="not mxnet",
        python=(3, 11, 5),  # the documentation site's soupsieve and pymdown-extensions
    ),
}


# The browsers the documentation site's test drives (tests/test_website.py), by command name
BROWSERS = ("chromium", "chromium-browser", "google-chrome")


def browser() -> None:
    """Chromium, from the operating system's packages, for the documentation site's browser
    test: installed with apt-get where it is missing and lanes.py runs as root (CI, a
    container); elsewhere a line says how to get it, and the test says so too."""
    if any(shutil.which(name) for name in BROWSERS):
        return
    if os.name != "posix" or os.geteuid() != 0 or shutil.which("apt-get") is None:
        print(
            "== no Chromium here: the documentation site's test needs it (apt-get install chromium)"
        )
        return
    print("== installing Chromium (apt-get) for the documentation site's test", flush=True)
    quiet = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    if run("apt-get", "update", "-qq", env=quiet) or run(
        "apt-get", "install", "-y", "-qq", "chromium", env=quiet
    ):
        print("== Chromium did not install: the documentation site's test will say so")


def python_of(environment: pathlib.Path) -> pathlib.Path:
    return environment / ("Scripts/python.exe" if os.name == "nt" else "bin/python")


def run(*command, **options) -> int:
    return subprocess.run(_shown(command), check=False, **options).returncode


def _shown(command) -> list[str]:
    """The command as strings, printed as a line starting "+ " first."""
    parts = [str(part) for part in command]
    print("+", " ".join(parts), flush=True)
    return parts


def set_up(names: list[str]) -> dict[str, pathlib.Path]:
    """Each lane's environment with mha installed as its constraints file pins it.

    The lanes install side by side: pip keeps about one core busy. `--no-compile`: Python
    compiles a module's bytecode when it is first imported, which is a small part of torch,
    TensorFlow and JAX; compiling every file up front took longer than the rest of the install.
    """
    installs = {}
    for name in names:
        lane = LANES[name]
        python = environment_of(name)
        print(f"== {name}: installing into {lane.environment} (minutes the first time)", flush=True)
        pins, project = ROOT / lane.constraints, f"{ROOT}[{lane.extras}]"
        command = [python, "-m", "pip", "install", "-q", "--no-compile", "-c", pins, "-e", project]
        installs[name] = python, subprocess.Popen(_shown(command))
    codes = {name: process.wait() for name, (_, process) in installs.items()}
    for name, code in codes.items():
        if code != 0:
            raise SystemExit(f"{name}: installing the lane failed (pip exited {code})")
    return {name: python for name, (python, _) in installs.items()}


def environment_of(name: str) -> pathlib.Path:
    """The Python of the lane's environment, made where it is missing with a Python that the
    lane's pins install on; one made with another Python is refused, saying what to do."""
    lane = LANES[name]
    environment = ROOT / lane.environment
    python = python_of(environment)
    if not python.exists():
        maker = python_for(name)
        print(f"== {name}: creating {lane.environment} with {maker}", flush=True)
        if run(maker, "-m", "venv", environment) != 0:
            raise SystemExit(f"{name}: {maker} could not make {lane.environment}")
    elif not fits(lane, made := version_of(python)):
        raise SystemExit(
            f"{name}: {lane.environment} has Python {dotted(made)}, and the lane needs "
            f"{span(lane)}: remove {lane.environment} and run again"
        )
    return python


def python_for(name: str, running: tuple[int, ...] = tuple(sys.version_info[:3])) -> str:
    """This Python where the lane's pins install on it, otherwise the newest python3.X on the
    PATH that they do; with none, an error naming the Pythons to install."""
    lane = LANES[name]
    if fits(lane, running):
        return sys.executable
    for minor in reversed(range(lane.python[1], lane.python_below[1])):
        found = shutil.which(f"python3.{minor}")
        if found and fits(lane, version_of(found)):
            return found
    raise SystemExit(
        f"the {name} lane needs Python {span(lane)}, which its pinned packages install "
        f"on; this is {dotted(running)}, and the PATH has no python3.X that fits"
    )


def fits(lane: Lane, version: tuple[int, ...]) -> bool:
    return lane.python <= version < lane.python_below


def version_of(python) -> tuple[int, ...]:
    """The version of the Python at `python`; () where it does not run."""
    command = [str(python), "-c", "import sys; print(*sys.version_info[:3])"]
    printed = subprocess.run(command, capture_output=True, text=True, check=False).stdout
    return tuple(int(part) for part in printed.split())


def span(lane: Lane) -> str:
    last = (*lane.python_below[:-1], lane.python_below[-1] - 1)
    return f"{dotted(lane.python)} to {dotted(last)}"


def dotted(version: tuple[int, ...]) -> str:
    return ".".join(map(str, version))


# One thread per framework in each pytest-xdist worker, there being a worker per core: more
# would wait on each other (a notebook training in torch ran 13 times slower beside another
# worker). A variable the caller set is kept
ONE_THREAD_EACH = {
    "OMP_NUM_THREADS": "1",
    "MKL_NUM_THREADS": "1",
    "TF_NUM_INTRAOP_THREADS": "1",
    "TF_NUM_INTEROP_THREADS": "2",
}


def test(name: str, python: pathlib.Path, pytest_args: list[str]) -> int:
    lane = LANES[name]
    print(f"== {name}: pytest with MHA_TEST_BACKENDS={lane.backends}", flush=True)
    parallel = _parallel(pytest_args)
    threads = ONE_THREAD_EACH if parallel else {}
    select = ["-m", lane.select] if lane.select else []
    with tempfile.TemporaryDirectory(prefix="mha-jax-cache-") as cache:
        environment = {
            **threads,
            **_shared_jax_cache(cache),
            **QUICK_XLA,
            **os.environ,
            "MHA_TEST_BACKENDS": lane.backends,
        }
        command = [python, "-m", "pytest", *parallel, *select, *pytest_args]
        return run(*command, cwd=ROOT, env=environment)


# XLA compiles for the CPU without LLVM's optimizations: the tests' arrays are tiny, so a JAX
# test's time is mostly compiling (eager JAX compiles each operation for each new shape). The
# numbers meet the same tolerances; tests/test_backend_jax.py runs the whole case matrix once
# at XLA's default level, as users compile. A variable the caller set is kept
QUICK_XLA = {"XLA_FLAGS": "--xla_backend_optimization_level=0"}


def _shared_jax_cache(folder: str) -> dict[str, str]:
    """JAX's persistent compilation cache in `folder`, for every program: JAX compiles each
    operation for each new shape, and the workers, and the kernels and processes the tests
    start, compile many of the same. A variable the caller set is kept."""
    return {
        "JAX_COMPILATION_CACHE_DIR": folder,
        "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
        "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "0",
    }


def _parallel(pytest_args: list[str]) -> list[str]:
    """pytest-xdist's workers, one per core up to 4 (each imports every framework); none
    where the arguments choose their own."""
    chosen = (
        arg.startswith(("-n", "--numprocesses")) or arg.endswith("no:xdist") for arg in pytest_args
    )
    if any(chosen):
        return []
    # loadgroup: the tests of an xdist_group in one worker; in the order collected, slow first
    groups = ["--dist", "loadgroup", "--no-loadscope-reorder"]
    return ["-n", str(min(4, os.cpu_count() or 1)), *groups]


def lock(name: str, lane: Lane) -> None:
    """Write the lane's constraints file from a new environment of the newest releases."""
    with tempfile.TemporaryDirectory() as scratch:
        environment = pathlib.Path(scratch) / "lock"
        venv.create(environment, with_pip=True)
        python = python_of(environment)
        code = run(python, "-m", "pip", "install", "-q", f"{ROOT}[{lane.extras}]", *lane.lock)
        if code != 0:
            raise SystemExit(f"{name}: installing the newest releases failed (pip exited {code})")
        frozen = subprocess.run(
            [python, "-m", "pip", "freeze", "--exclude", "mha"],
            check=True,
            capture_output=True,
            text=True,
        ).stdout
    # A local version label (torch's "+cpu") names a wheel that no index serves.
    pins = [line.split("+")[0] for line in frozen.splitlines() if "==" in line]
    pins.sort(key=lambda pin: pin.split("==")[0].lower())
    header = (
        f"# The {name} lane's exact versions (see lanes.py): python3 lanes.py {name}\n"
        f"# Regenerate with: python3 lanes.py --lock {name}\n"
    )
    target = ROOT / lane.constraints
    partial = target.with_name(target.name + ".partial")
    partial.write_text(header + "".join(pin + "\n" for pin in pins))
    os.replace(partial, target)  # the old file stays whole until the new one is
    print(f"== {name}: wrote {len(pins)} pins to {lane.constraints}")


# The checks run side by side, then the benchmark alone; seconds each phase may take (the
# whole lane fits in ten minutes on one GPU)
GPU_PHASES = ((("agreement", "masked_keys", "sync", "conform"), 240), (("bench",), 260))
# On the CPU (--device cpu, a check of the lane itself) the checks' processes share its cores
# and JAX compiles for them: each phase may take this many times as long
CPU_SLOWER = 4
# JAX compiles each case's programs on the CPU, so its share of a step is split among
# processes: its agreement matrix among as many as a GPU machine's cores run beside the other
# steps, its conform targets (XLA's, cuDNN's, mha's function) one each
JAX_PARTS = 6
GPU_PARTS = {"agreement": {"torch": 1, "jax": JAX_PARTS}, "conform": {"torch": 1, "jax": 3}}


def gpu_lane(device: str = "gpu") -> int:
    """Every step of tests/gpu_lane.py on `device`, each in its own process and time limit:
    the checks side by side (the agreement matrix of each framework in processes of its own),
    then the benchmark alone, so that nothing else runs while it times."""
    environment = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]),
    }
    # torch and JAX share the GPU: JAX takes its memory as it needs it
    environment.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    script = [sys.executable, str(ROOT / "tests" / "gpu_lane.py")]
    if device == "gpu" and not _sees_gpu(environment):
        print("== gpu: neither torch nor jax sees a GPU here; nothing to run")
        # A run that asked for reports (a lent GPU machine whose driver failed) is no pass
        return 3 if os.environ.get("MHA_GPU_LANE_OUT") else 0
    run(*script, "versions", "--device", device, env=environment)
    codes = {}
    for steps, limit in GPU_PHASES:
        limit *= CPU_SLOWER if device == "cpu" else 1
        print(f"== gpu: {', '.join(steps)} (at most {limit} s)", flush=True)
        processes = [
            # A session of its own, so that a step past its limit is killed with its children
            (
                step,
                subprocess.Popen(
                    [*script, step, "--device", device, *more],
                    env=environment,
                    start_new_session=True,
                ),
            )
            for step in steps
            for more in _gpu_parts(step)
        ]
        deadline = time.monotonic() + limit
        for step, process in processes:
            codes[step] = max(codes.get(step, 0), _wait(process, deadline))
    print(
        "== gpu lane: "
        + ", ".join(
            f"{step} {'passed' if code == 0 else 'TIMED OUT' if code == 124 else 'FAILED'}"
            for step, code in codes.items()
        )
    )
    return max(codes.values())


def _gpu_parts(step: str) -> list[list[str]]:
    """The arguments of each process of `step`: the agreement matrix and the conform step split
    by framework, and JAX's share into GPU_PARTS processes; one process for every other step."""
    if step not in GPU_PARTS:
        return [[]]
    frameworks = [name for name in ("torch", "jax") if importlib.util.find_spec(name)]
    return [
        ["--backends", name, "--part", f"{k}/{GPU_PARTS[step][name]}"]
        for name in frameworks
        for k in range(1, GPU_PARTS[step][name] + 1)
    ]


def _wait(process: subprocess.Popen, deadline: float) -> int:
    """The process's exit code, or 124 when it runs past `deadline` (it is then killed, with
    the processes it started: the bench step's `mha bench`)."""
    try:
        return process.wait(timeout=max(0.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()
        return 124


def _sees_gpu(environment) -> bool:
    probe = (
        "import importlib.util as u\n"
        "t = u.find_spec('torch') and __import__('torch').cuda.is_available()\n"
        "def j():\n"
        "    try: return bool(__import__('jax').devices('gpu'))\n"
        "    except Exception: return False\n"
        "raise SystemExit(0 if t or (u.find_spec('jax') and j()) else 1)"
    )
    return subprocess.run([sys.executable, "-c", probe], env=environment).returncode == 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["gpu"]:
        gpu = argparse.ArgumentParser(prog="lanes.py gpu")
        gpu.add_argument("--device", choices=("gpu", "cpu"), default="gpu")
        return gpu_lane(gpu.parse_args(argv[1:]).device)
    own, pytest_args = (
        (argv[: argv.index("--")], argv[argv.index("--") + 1 :]) if "--" in argv else (argv, [])
    )
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "lanes",
        nargs="*",
        metavar="LANE",
        help=f"{' or '.join(LANES)} (default: both); or gpu on its own, the GPU lane "
        "(gpu [--device cpu|gpu])",
    )
    parser.add_argument(
        "--lock", action="store_true", help="regenerate the lanes' constraints files"
    )
    options = parser.parse_args(own)
    unknown = [name for name in options.lanes if name not in LANES]
    if unknown:
        parser.error(f"unknown lane {unknown[0]!r}; the lanes are {', '.join(LANES)}")
    names = options.lanes or list(LANES)
    if options.lock:  # in this Python, whose newest releases the lock writes down
        for name in names:
            if not fits(LANES[name], tuple(sys.version_info[:3])):
                parser.error(f"locking the {name} lane needs Python {span(LANES[name])}")
            lock(name, LANES[name])
        return 0
    pythons = set_up(names)
    if "current" in names:
        browser()
    results = {name: test(name, pythons[name], pytest_args) for name in names}
    verdicts = (f"{name} {'passed' if code == 0 else 'FAILED'}" for name, code in results.items())
    print("== lanes: " + ", ".join(verdicts))
    return max(results.values())


if __name__ == "__main__":
    sys.exit(main())
