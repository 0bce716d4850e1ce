"""Weight formats the planner reasons about: bytes per weight (with scales) and the arithmetic they run in.

A format is what a weight matrix occupies in memory and on the wire (the bytes PCIe copies and the CPU reads),
and which tensor-core rate the accelerator computes it at. Numbers follow the on-disk/in-memory layouts of
the engine: FP8 is DeepSeek-V3's e4m3 with one float32 scale per 128x128 block; INT4 is a group-wise format
(32 weights share one 16-bit scale, 4.5 bits a weight); INT8 has one 16-bit scale per 128 weights.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class WeightFormat:
    name: str
    bits: int  # bits of one stored weight value
    group: int = 0  # weights sharing one scale (0: no scales)
    scale_bytes: int = 0
    accelerator_compute: str = "bf16"  # tensor-core rate key the accelerator multiplies this format at

    @property
    def bytes_per_weight(self) -> float:
        scale = self.scale_bytes / self.group if self.group else 0.0
        return self.bits / 8 + scale

    def nbytes(self, num_weights: float) -> float:
        return num_weights * self.bytes_per_weight


FORMATS: dict[str, WeightFormat] = {
    "fp32": WeightFormat("fp32", 32, accelerator_compute="fp32"),
    "bf16": WeightFormat("bf16", 16, accelerator_compute="bf16"),
    "fp16": WeightFormat("fp16", 16, accelerator_compute="bf16"),
    "fp8": WeightFormat("fp8", 8, group=128 * 128, scale_bytes=4, accelerator_compute="fp8"),
    "int8": WeightFormat("int8", 8, group=128, scale_bytes=2, accelerator_compute="int8"),
    # weight-only INT4 is dequantised in registers and multiplied at the bf16 rate (W4A16)
    "int4": WeightFormat("int4", 4, group=32, scale_bytes=2, accelerator_compute="bf16"),
}


def weight_format(name: str) -> WeightFormat:
    """The format called `name` (case-insensitive); raises ValueError listing the known ones."""
    key = name.strip().lower()
    if key not in FORMATS:
        raise ValueError(f"unknown weight format {name!r}; known: {', '.join(FORMATS)}")
    return FORMATS[key]
