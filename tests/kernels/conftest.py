"""Shared fixtures: the fused ops must be built unless the build was skipped on purpose."""

import os

import pytest

from megalite.kernels import fused


@pytest.fixture
def require_extension():
    """Fail (or skip under MEGALITE_NO_EXT=1) when megalite._C is not built."""
    if not fused.BUILT:
        if os.environ.get("MEGALITE_NO_EXT") == "1":
            pytest.skip("extension build skipped with MEGALITE_NO_EXT=1")
        pytest.fail("megalite._C is not built: run `pip install -e . --no-build-isolation` or "
                    "`python setup.py build_ext --inplace` (or set MEGALITE_NO_EXT=1)")
