"""Every backend this run requires imports; a broken one is a failure, never a skip."""

import pytest

from conftest import backend_params, required_backends
from mha.registry import load_backend


@pytest.mark.parametrize("name", backend_params(required_backends()))
def test_required_backend_imports(name):
    load_backend(name)
