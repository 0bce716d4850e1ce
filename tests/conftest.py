"""Shared fixtures: tiny random-init Hugging Face models of each architecture, built once per session."""

from __future__ import annotations

import json
import os

import pytest
import torch

from hybridmoe.checkpoint.synthetic import save_tiny_model
from hybridmoe.kernels import isa
from xdist_cpus import xdist_worker_cpus

os.sched_setaffinity(0, xdist_worker_cpus(sorted(os.sched_getaffinity(0)), os.environ.get("PYTEST_XDIST_WORKER"),
                                          os.environ.get("PYTEST_XDIST_WORKER_COUNT")))
torch.set_num_threads(2)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """tiny_model_dir(model_type, **overrides) -> path of a saved random-init model (cached per session)."""
    cache: dict[str, object] = {}

    def make(model_type: str, **overrides):
        key = json.dumps([model_type, overrides], sort_keys=True, default=str)
        if key not in cache:
            out = tmp_path_factory.mktemp(model_type)
            cache[key] = save_tiny_model(out, model_type, **overrides)
        return cache[key]

    return make


@pytest.fixture(params=isa.available_isas())
def each_isa(request):
    """Runs the test once per kernel ISA available here (scalar always; avx2/avx512/... where the CPU has them)."""
    with isa.use_isa(request.param):
        yield request.param
