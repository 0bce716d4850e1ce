"""The CPU share each pytest-xdist worker keeps (xdist_cpus, applied in conftest.py)."""

from xdist_cpus import xdist_worker_cpus


def test_each_worker_keeps_its_own_share_of_the_cpus():
    cpus = list(range(16))
    shares = [xdist_worker_cpus(cpus, f"gw{i}", "8") for i in range(8)]
    assert shares == [[2 * i, 2 * i + 1] for i in range(8)]
    assert xdist_worker_cpus(cpus, "gw2", "5") == [6, 7, 8]  # 3 each; the last CPU stays unused


def test_without_xdist_or_with_too_few_cpus_every_cpu_is_kept():
    cpus = [0, 1, 2, 3]
    assert xdist_worker_cpus(cpus, None, None) == cpus
    assert xdist_worker_cpus(cpus, "gw1", "3") == cpus  # one CPU each would be under 2
