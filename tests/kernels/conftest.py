"""Fixtures for the kernel tests: every ISA path this machine can run."""

from __future__ import annotations

import pytest

from hybridmoe.kernels import isa


@pytest.fixture(params=isa.available_isas())
def each_isa(request):
    """Runs the test once per ISA available here (scalar always; avx2/avx512 where the CPU has them)."""
    with isa.use_isa(request.param):
        yield request.param
