"""A payload between two processes over torch.distributed gloo on loopback, layer by layer."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import textwrap

import pytest

SCRIPT = textwrap.dedent("""
    import json, sys, torch, torch.distributed as dist
    from hybridmoe.kv import payload as P
    from hybridmoe.kv.allocation import LADDER_3, allocate
    from hybridmoe.kv.layout import KVLayout
    from hybridmoe.kv.transfer import receive_payload, send_payload

    rank, port, out = int(sys.argv[1]), sys.argv[2], sys.argv[3]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    layout, n, budget = KVLayout("gqa", 3, (32,) * 4), 500, 0.3
    g = torch.Generator().manual_seed(7)
    layers = [torch.randn(n, layout.row_width, generator=g) for _ in range(layout.num_layers)]
    tiers = allocate(torch.rand(n, generator=g), budget, LADDER_3)
    if rank == 0:
        writer = P.PayloadWriter(layout, tiers, model="fp", full_dtype="bfloat16")
        stats = send_payload(writer.head(), (writer.pack_layer(i, r) for i, r in enumerate(layers)), dst=1)
        result = {"bytes": stats.bytes, "seconds": stats.seconds}
    else:
        got = {}
        capacity = P.payload_capacity(layout, n, budget, "bfloat16")
        reader, data, stats = receive_payload(0, capacity=capacity, model="fp", layout=layout,
                                              on_layer=lambda i, rows: got.__setitem__(i, rows))
        _, whole = P.unpack(bytes(data), model="fp", layout=layout)
        result = {"bytes": stats.bytes, "seconds": stats.seconds, "capacity": capacity,
                  "layers": sorted(got), "same": all(torch.equal(got[i], whole[i]) for i in got),
                  "dropped": int(reader.dropped.sum()),
                  "max_err": max(float((r - layers[i])[~reader.dropped].abs().max()) for i, r in got.items())}
    dist.destroy_process_group()
    open(out, "w").write(json.dumps(result))
""")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_two_processes_over_gloo(tmp_path):
    script = tmp_path / "rank.py"
    script.write_text(SCRIPT)
    port = str(_free_port())
    procs = [subprocess.Popen([sys.executable, str(script), str(rank), port, str(tmp_path / f"r{rank}.json")])
             for rank in (0, 1)]
    for p in procs:
        assert p.wait(timeout=120) == 0
    sent, received = (json.loads((tmp_path / f"r{r}.json").read_text()) for r in (0, 1))
    assert sent["bytes"] == received["bytes"] <= received["capacity"]
    assert received["layers"] == [0, 1, 2] and received["same"]
    assert received["dropped"] == 0 and received["max_err"] < 1.0
    assert sent["seconds"] > 0 and received["seconds"] > 0
