"""The CPUs each pytest-xdist worker keeps (set in conftest.py)."""

from __future__ import annotations


def xdist_worker_cpus(cpus: list[int], worker: str | None, count: str | None) -> list[int]:
    """The CPUs a pytest-xdist worker keeps: its share of `cpus`, at least 2, else all of them. Each worker's
    kernel pool has a thread per CPU it may use and meets at barriers, so that workers sharing every CPU would
    run far more threads than CPUs and wait for descheduled ones at every call (8 workers on a lent 16-CPU
    machine did not finish the kernel tests in 240 s; the CI machine's 2 CPUs run them in 3-4 minutes)."""
    if not worker or not count:
        return cpus
    share = len(cpus) // int(count)
    if share < 2:
        return cpus
    index = int(worker.removeprefix("gw"))
    return cpus[index * share:(index + 1) * share]
