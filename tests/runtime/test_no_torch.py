"""The request-side bookkeeping modules are plain Python: they import (and work) with torch unavailable."""

from __future__ import annotations

import subprocess
import sys

PLAIN_PYTHON_MODULES = [
    "hybridmoe.runtime.sampling_params",
    "hybridmoe.runtime.request",
    "hybridmoe.runtime.prefix_cache",
    "hybridmoe.runtime.block_manager",
    "hybridmoe.runtime.scheduler",
]


def test_plain_python_modules_import_without_torch():
    script = (
        "import sys\n"
        "sys.modules['torch'] = None  # any 'import torch' now raises ImportError\n"
        + "".join(f"import {name}\n" for name in PLAIN_PYTHON_MODULES)
        + "from hybridmoe.runtime.scheduler import Scheduler\n"
        "from hybridmoe.runtime.block_manager import BlockManager\n"
        "from hybridmoe.runtime.request import Request\n"
        "from hybridmoe.runtime.sampling_params import SamplingParams\n"
        "scheduler = Scheduler(BlockManager(4, 2), 2, 8, 8)\n"
        "scheduler.add_request(Request('a', [1, 2, 3], SamplingParams(max_tokens=1)))\n"
        "output = scheduler.schedule()\n"
        "assert [r.status.is_finished for r in scheduler.update_from_output(output, {'a': 5})] == [True]\n"
        "scheduler.add_request(Request('b', [1, 2, 3], SamplingParams(max_tokens=1)))\n"
        "assert scheduler.schedule().scheduled[0].num_new_tokens == 1  # [1, 2] was cached by 'a'\n"
        "assert 'torch' not in [m for m in sys.modules if sys.modules[m] is not None]\n"
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
