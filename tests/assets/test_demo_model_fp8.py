"""The FP8 copy is DeepSeek-V3's format and holds the BF16 model's weights to e4m3 precision.

The dequantisation reference here is written independently of hybridmoe.checkpoint.fp8, in float64.
"""

from __future__ import annotations

import json
import math

import torch
from safetensors.torch import load_file

BLOCK = 128


def reference_dequantize(q: torch.Tensor, scale_inv: torch.Tensor) -> torch.Tensor:
    """float64 W[r, c] = q[r, c] * scale_inv[r // 128, c // 128], element by block."""
    rows, cols = q.shape
    row_block = torch.arange(rows) // BLOCK
    col_block = torch.arange(cols) // BLOCK
    return q.double() * scale_inv.double()[row_block][:, col_block]


def test_config_declares_deepseek_fp8(fp8_dir, demo_dir):
    config = json.loads((fp8_dir / "config.json").read_text())
    quant = config.pop("quantization_config")
    assert quant["quant_method"] == "fp8" and quant["fmt"] == "e4m3" and quant["weight_block_size"] == [128, 128]
    assert config == json.loads((demo_dir / "config.json").read_text())
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        assert (fp8_dir / name).read_bytes() == (demo_dir / name).read_bytes()


def test_fp8_weights_are_the_bf16_weights_in_e4m3_blocks(fp8_dir, demo_dir):
    fp8 = load_file(str(fp8_dir / "model.safetensors"))
    bf16 = load_file(str(demo_dir / "model.safetensors"))
    quantized = [name for name, t in fp8.items() if t.dtype == torch.float8_e4m3fn]
    assert len(quantized) > 50  # attention, dense MLP, shared and routed experts of every layer
    assert set(fp8) == set(bf16) | {name + "_scale_inv" for name in quantized}
    assert any(bf16[name].shape[0] % BLOCK for name in quantized)  # a partial block (kv_a_proj_with_mqa) is covered
    for name in quantized:
        scale = fp8[name + "_scale_inv"]
        rows, cols = bf16[name].shape
        assert scale.dtype == torch.float32 and scale.shape == (math.ceil(rows / BLOCK), math.ceil(cols / BLOCK))
        original = bf16[name].double()
        error = (reference_dequantize(fp8[name], scale) - original).abs()
        # e4m3 keeps 3 mantissa bits: half a step is 2^-4 relative; subnormals are spaced 2^-9 * scale
        per_element_scale = reference_dequantize(torch.ones_like(original), scale)
        bound = (original.abs() * 2.0 ** -4 + per_element_scale * 2.0 ** -10) * (1 + 1e-5)  # + float32 division slack
        assert (error <= bound).all(), f"{name}: worst error {error.max():.3g}"
        assert error.max() > 0  # it really is quantised
    for name in set(bf16) - set(quantized):
        assert torch.equal(fp8[name], bf16[name]), f"{name} should be copied unchanged"
    assert "lm_head.weight" not in quantized and "model.embed_tokens.weight" not in quantized
