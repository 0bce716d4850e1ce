"""Timeline of one forward pass: compute units in execution order, with streamed weights double-buffered.

A `Unit` is one piece of a layer (attention half, MoE half, one split of streamed experts, ...). It computes
on the accelerator and/or the CPU at the same time (time = max of the two, plus a hand-off), and may need
weights copied over the host link first. Copies run in order on one copy engine and land in `buffers` slots:
the copy of streamed unit k may start once the copy before it has finished and the unit that last used its
slot (streamed unit k - buffers) has finished computing. With two slots this is the double buffer: the copy
of split i+1 overlaps the compute of split i, and the copy of layer l+1's first split overlaps layer l.

On the CPU standing in for an accelerator the "copy engine" is a memcpy on the same cores that compute, so a copy
and a compute do not run at once: `run(..., overlap=False)` (see `copies_overlap`) puts them on one track.

`run` returns the total time and per-unit start/end times; `by_layer` sums them per layer.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class Unit:
    name: str
    layer: int  # decoder layer (-1: before the first layer, num_layers: LM head)
    gpu_s: float = 0.0
    cpu_s: float = 0.0
    handoff_s: float = 0.0  # serial cost around the unit (activation copies, thread dispatch)
    copy_s: float = 0.0  # weights streamed to the accelerator before the unit may start
    copy_bytes: float = 0.0
    copy_waits: bool = False  # the copy may not start before the previous unit has finished (it needs its
    # result, e.g. the router's choice of experts)
    repeat: int = 1  # this many identical units back to back (the splits of a layer)

    @property
    def compute_s(self) -> float:
        return max(self.gpu_s, self.cpu_s) + self.handoff_s


@dataclass
class Timeline:
    total_s: float
    starts: list[float] = field(default_factory=list)
    ends: list[float] = field(default_factory=list)
    copy_ends: list[float] = field(default_factory=list)  # 0.0 for units with nothing to copy
    units: list[Unit] = field(default_factory=list)

    def stall_s(self) -> float:
        """Time the compute units spent waiting for copies."""
        busy = sum(unit.compute_s * unit.repeat for unit in self.units)
        return self.total_s - busy

    def by_layer(self) -> dict[int, dict[str, float]]:
        """Per layer: wall time (from the end of the previous layer to the end of its last unit), compute
        time, copy time and bytes streamed."""
        out: dict[int, dict[str, float]] = {}
        previous_end = 0.0
        for unit, end in zip(self.units, self.ends):
            row = out.setdefault(unit.layer, {"wall_s": 0.0, "compute_s": 0.0, "copy_s": 0.0, "copy_bytes": 0.0,
                                              "gpu_s": 0.0, "cpu_s": 0.0})
            row["wall_s"] += end - previous_end
            row["compute_s"] += unit.compute_s * unit.repeat
            row["copy_s"] += unit.copy_s * unit.repeat
            row["copy_bytes"] += unit.copy_bytes * unit.repeat
            row["gpu_s"] += unit.gpu_s * unit.repeat
            row["cpu_s"] += unit.cpu_s * unit.repeat
            previous_end = end
        return out


def copies_overlap(gpu) -> bool:
    """Whether this accelerator (a hardware.GpuSpec, or None) copies while it computes: a GPU's copy engine does;
    the CPU stand-in's copies take the cores its compute needs."""
    return gpu is None or not gpu.stand_in


def run(units: list[Unit], buffers: int = 2, overlap: bool = True) -> Timeline:
    """Simulate the units in order (see module docstring); overlap=False: copies and compute share one track."""
    if buffers < 1:
        raise ValueError(f"need at least one copy buffer, got {buffers}")
    timeline = Timeline(0.0, units=list(units))
    compute_free = copy_free = 0.0
    streamed_ends: list[float] = []  # compute end of each streamed unit, in order
    for unit in units:
        start = None
        duration, copy_s = unit.compute_s, unit.copy_s
        for k in range(unit.repeat):
            copy_end = 0.0
            if copy_s > 0:
                slot_free = streamed_ends[-buffers] if len(streamed_ends) >= buffers else 0.0
                ready = compute_free if (unit.copy_waits and k == 0) or not overlap else 0.0
                copy_end = max(copy_free, slot_free, ready) + copy_s
                copy_free = copy_end
            begin = compute_free if compute_free > copy_end else copy_end
            if start is None:
                start = begin
            compute_free = begin + duration
            if copy_s > 0:
                streamed_ends.append(compute_free)
        timeline.starts.append(start)
        timeline.ends.append(compute_free)
        timeline.copy_ends.append(copy_end)
    timeline.total_s = compute_free
    return timeline
