"""The timeline simulator against hand-computed double-buffered pipelines."""

from __future__ import annotations

import pytest

from hybridmoe.placement.schedule import Unit, run


def test_compute_only_units_add_up_and_take_the_slower_device():
    t = run([Unit("a", 0, gpu_s=1.0), Unit("b", 0, gpu_s=0.5, cpu_s=2.0, handoff_s=0.25)])
    assert t.total_s == pytest.approx(3.25)
    assert t.stall_s() == pytest.approx(0.0)


def test_double_buffer_overlaps_copy_with_compute():
    # copy 1 s, compute 2 s each: copies hide behind compute after the first one
    units = [Unit("s", 0, gpu_s=2.0, copy_s=1.0) for _ in range(4)]
    assert run(units, buffers=2).total_s == pytest.approx(1.0 + 4 * 2.0)
    # copy-bound: copy 3 s, compute 1 s: each compute waits for its copy
    units = [Unit("s", 0, gpu_s=1.0, copy_s=3.0) for _ in range(4)]
    assert run(units, buffers=2).total_s == pytest.approx(4 * 3.0 + 1.0)


def test_one_buffer_serialises_copy_and_compute():
    units = [Unit("s", 0, gpu_s=2.0, copy_s=1.0) for _ in range(3)]
    assert run(units, buffers=1).total_s == pytest.approx(3 * (1.0 + 2.0))


def test_buffers_limit_how_far_copies_run_ahead():
    # a long compute unit (attention) then streamed splits: with 2 slots only 2 splits arrive during it
    units = [Unit("attention", 0, gpu_s=10.0)] + [Unit("split", 0, gpu_s=0.1, copy_s=1.0) for _ in range(5)]
    two = run(units, buffers=2).total_s
    five = run(units, buffers=5).total_s
    assert five == pytest.approx(10.0 + 5 * 0.1)
    # with 2 slots, splits 1-2 are copied during the attention; split 3's copy starts when split 1 has
    # computed (10.1), then copies run back to back: split 5 lands at 13.1 and computes until 13.2
    assert two == pytest.approx(13.2)


def test_copy_waits_for_the_previous_unit():
    units = [Unit("router", 0, gpu_s=1.0), Unit("split", 0, gpu_s=1.0, copy_s=2.0, copy_waits=True)]
    assert run(units).total_s == pytest.approx(1.0 + 2.0 + 1.0)
    units[1] = Unit("split", 0, gpu_s=1.0, copy_s=2.0)  # prefetched: the copy overlaps the router
    assert run(units).total_s == pytest.approx(2.0 + 1.0)


def test_repeat_is_the_same_as_separate_units():
    base = [Unit("attention", 0, gpu_s=3.0), Unit("router", 0, gpu_s=0.2)]
    separate = base + [Unit("split", 0, gpu_s=0.4, copy_s=0.7, copy_waits=(i == 0)) for i in range(6)]
    repeated = base + [Unit("split", 0, gpu_s=0.4, copy_s=0.7, copy_waits=True),
                       Unit("split", 0, gpu_s=0.4, copy_s=0.7, repeat=5)]
    for buffers in (1, 2, 3):
        assert run(repeated, buffers).total_s == pytest.approx(run(separate, buffers).total_s)


def test_by_layer_sums_wall_time_and_bytes():
    units = [Unit("a", 0, gpu_s=1.0), Unit("s", 1, gpu_s=1.0, copy_s=0.5, copy_bytes=10.0, repeat=3)]
    t = run(units)
    rows = t.by_layer()
    assert rows[0]["wall_s"] + rows[1]["wall_s"] == pytest.approx(t.total_s)
    assert rows[1]["copy_bytes"] == 30.0 and rows[1]["compute_s"] == pytest.approx(3.0)


def test_rejects_zero_buffers():
    with pytest.raises(ValueError, match="buffer"):
        run([Unit("a", 0, gpu_s=1.0)], buffers=0)


def test_without_overlap_copies_and_compute_share_one_track():
    """The CPU stand-in: its copies take the cores its compute needs, so nothing overlaps."""
    units = [Unit("u", i, gpu_s=1.0, copy_s=2.0) for i in range(4)]
    assert run(units, buffers=2).total_s == pytest.approx(4 * 2.0 + 1.0)  # copy-bound, compute hidden
    assert run(units, buffers=2, overlap=False).total_s == pytest.approx(4 * (2.0 + 1.0))


def test_only_the_stand_in_keeps_copies_off_its_compute():
    from dataclasses import replace

    from hybridmoe.placement.hardware import reference_profile
    from hybridmoe.placement.schedule import copies_overlap

    gpu = reference_profile("rtx4090").gpu
    assert copies_overlap(gpu) and copies_overlap(None)
    assert not copies_overlap(replace(gpu, stand_in=True))
