"""The command line beside TensorFlow: its native log lines stay out of what mha prints."""

import subprocess
import sys

import pytest

from conftest import backend_module

pytestmark = pytest.mark.tensorflow

# TensorFlow writes absl log lines ("I0000 ... oneDNN custom operations are on") to the
# process's standard error, outside Python, when it loads; mha sets them aside while it runs
IMPORT_TENSORFLOW = "import tensorflow"
IMPORT_ASIDE = (
    "import sys\n"
    "from mha.cli_common import framework_logs_aside\n"
    "kept = []\n"
    "with framework_logs_aside(sys.stderr, kept) as err:\n"
    "    import tensorflow\n"
    "    print('mha: a message of its own', file=err)\n"
    "print('aside:', bool(''.join(kept).strip()))\n"
)


def stderr_and_stdout(code: str) -> tuple[str, str]:
    completed = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=300
    )
    return completed.stderr, completed.stdout


@pytest.mark.slow
def test_tensorflow_native_log_lines_are_set_aside():
    backend_module("tensorflow")
    native, _ = stderr_and_stdout(IMPORT_TENSORFLOW)
    native = [line for line in native.splitlines() if line.strip()]
    err, out = stderr_and_stdout(IMPORT_ASIDE)
    assert "mha: a message of its own" in err  # mha's own lines still reach standard error
    assert not [line for line in native if line in err], err
    assert out.strip() == f"aside: {bool(native)}"  # what TensorFlow wrote was kept aside
