"""Quantisation fields, shared by every family: a checkpoint's FP8 block format (`quantization_config`) and
weights written as int4/int8 by `hybridmoe quantize` (`expert_quantization`: the routed experts, or
every projection)."""

from __future__ import annotations

from hybridmoe.config.fields import Fields
from hybridmoe.config.model_config import ExpertQuantConfig, QuantConfig


def parse_fp8_quant(f: Fields) -> QuantConfig | None:
    q = f.raw.get("quantization_config")
    if not q:
        return None
    method = q.get("quant_method")
    if method != "fp8":
        raise f.error("quantization_config", f"quant_method {method!r} is not supported (fp8)")
    fmt = q.get("fmt", "e4m3")
    if fmt != "e4m3":
        raise f.error("quantization_config", f"fmt {fmt!r} is not supported (e4m3)")
    block = q.get("weight_block_size") or [128, 128]
    if len(block) != 2 or not all(isinstance(b, int) and b > 0 for b in block):
        raise f.error("quantization_config", f"weight_block_size must be two positive ints, got {block}")
    return QuantConfig(method="fp8", fmt=fmt, block_size=(block[0], block[1]),
                       modules_to_not_convert=tuple(q.get("modules_to_not_convert") or ()))


def parse_expert_quant(f: Fields) -> ExpertQuantConfig | None:
    q = f.raw.get("expert_quantization")
    if not q:
        return None
    if not isinstance(q, dict):
        raise f.error("expert_quantization", "must be an object")
    sub = Fields(q, f"{f.source} (expert_quantization)")
    return ExpertQuantConfig(method=sub.choice("method", ("int4", "int8")),
                             group_size=int(sub.choice("group_size", (32, 128))),
                             scale_dtype=sub.choice("scale_dtype", ("bfloat16", "float16"), "bfloat16"),
                             scope=sub.choice("scope", ("experts", "all"), "experts"))
