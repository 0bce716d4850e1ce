"""The accelerator abstraction on the CPU stand-in: real copies, the ledger against the budget, the trace, sizes."""

import pytest
import torch

from hybridmoe.accel.accelerator import Accelerator, DeviceMemoryError, parse_bytes, select_accelerator


def test_placing_a_tensor_is_a_real_copy_counted_in_the_ledger():
    accel = Accelerator("cpu", budget_bytes=1000)
    host = torch.arange(100, dtype=torch.float32)  # 400 bytes
    dev = accel.to_device(host, "a")
    assert torch.equal(dev, host) and dev.data_ptr() != host.data_ptr()
    host += 1
    assert dev[0] == 0  # a separate tensor, not a view
    assert accel.held_bytes == 400
    accel.empty((100,), torch.float32, "b")
    assert accel.held_bytes == 800 and accel.peak_bytes == 800
    assert accel.release("a") == 400 and accel.held_bytes == 400 and accel.peak_bytes == 800


def test_over_budget_names_the_item_and_holds_nothing_more():
    accel = Accelerator("cpu", budget_bytes=1000)
    accel.to_device(torch.zeros(200, dtype=torch.float32), "first")
    with pytest.raises(DeviceMemoryError, match="second .* over its budget"):
        accel.to_device(torch.zeros(100, dtype=torch.float32), "second")
    assert accel.held_bytes == 800


def test_stand_in_streams_copy_at_once_and_trace_in_issue_order():
    accel = Accelerator("cpu", trace=True)
    copies = accel.new_stream("copy")
    dst, src = torch.zeros(4), torch.ones(4)
    copies.copy(dst, src, "layer 0 -> slot 0")
    done = copies.record("layer 0 copied")
    accel.compute.wait(done)
    accel.mark_compute("layer 0")
    assert torch.equal(dst, src)
    assert [(e.kind, e.label, e.stream) for e in accel.events] == [
        ("copy", "layer 0 -> slot 0", "copy"), ("record", "layer 0 copied", "copy"),
        ("wait", "layer 0 copied", "compute"), ("compute", "layer 0", "compute")]


def test_pinning_on_the_stand_in_keeps_the_tensor():
    accel = Accelerator("cpu")
    t = torch.ones(3)
    pinned, ok = accel.pinned(t)
    assert pinned is t and not ok


def test_select_and_bad_device():
    assert select_accelerator("cpu").kind == "cpu"
    with pytest.raises(ValueError, match="device must be"):
        select_accelerator("tpu")
    if not torch.cuda.is_available():
        assert select_accelerator("auto").kind == "cpu"
        with pytest.raises(ValueError, match="no CUDA device"):
            select_accelerator("cuda")


@pytest.mark.parametrize("text,expected", [("24GB", 24 * 10**9), ("512MiB", 512 * 2**20), ("1.5g", 15 * 10**8),
                                           ("2e9", 2 * 10**9), (1000, 1000), (None, None)])
def test_parse_bytes(text, expected):
    assert parse_bytes(text) == expected


@pytest.mark.parametrize("text", ["lots", "-1GB", "12XB", ""])
def test_parse_bytes_refuses_nonsense(text):
    with pytest.raises(ValueError, match="memory size"):
        parse_bytes(text)
