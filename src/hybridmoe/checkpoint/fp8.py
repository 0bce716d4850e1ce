"""DeepSeek-V3's native FP8 weight format: float8_e4m3fn values with one float32 scale per block.

A weight W [R, C] is stored as `q` (float8_e4m3fn, [R, C]) and `weight_scale_inv` (float32,
[ceil(R/b0), ceil(C/b1)]) with W[r, c] = q[r, c] * scale[r // b0, c // b1]. The last row/column block may be
partial (DeepSeek-V3's kv_a_proj_with_mqa has 576 rows). Here: exact block dequantisation, the matching
quantiser, and `write_fp8_checkpoint`, which converts a BF16/FP32 checkpoint directory into this format.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import save_file

from hybridmoe.checkpoint.safetensors_reader import CheckpointReader

FP8_MAX = 448.0  # largest finite float8_e4m3fn
SCALE_SUFFIX = "_scale_inv"  # "<name>.weight" -> "<name>.weight_scale_inv"


def expand_block_scales(scale: torch.Tensor, shape: tuple[int, int], block: tuple[int, int]) -> torch.Tensor:
    """scale [ceil(R/b0), ceil(C/b1)] -> per-element scale [R, C] (partial last blocks cropped)."""
    rows, cols = shape
    if scale.shape != (-(-rows // block[0]), -(-cols // block[1])):
        raise ValueError(f"block scale shape {list(scale.shape)} does not fit weight {list(shape)} with blocks {list(block)}")
    return scale.repeat_interleave(block[0], 0)[:rows].repeat_interleave(block[1], 1)[:, :cols]


def dequantize_fp8(weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int] = (128, 128),
                   dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """weight [R, C] float8_e4m3fn, scale [ceil(R/b0), ceil(C/b1)] float32 -> [R, C] in `dtype`.

    Computed in float32 (exact: an e4m3 value times a float32 scale rounds once), then cast.
    """
    full = expand_block_scales(scale.float(), tuple(weight.shape), block)
    return (weight.float() * full).to(dtype)


def quantize_fp8(weight: torch.Tensor, block: tuple[int, int] = (128, 128)) -> tuple[torch.Tensor, torch.Tensor]:
    """weight [R, C] float -> (q [R, C] float8_e4m3fn, scale [ceil(R/b0), ceil(C/b1)] float32), absmax per block."""
    rows, cols = weight.shape
    b0, b1 = block
    nr, nc = -(-rows // b0), -(-cols // b1)
    padded = torch.zeros(nr * b0, nc * b1, dtype=torch.float32)
    padded[:rows, :cols] = weight.float()
    blocks = padded.view(nr, b0, nc, b1)  # [nr, b0, nc, b1]
    absmax = blocks.abs().amax(dim=(1, 3))  # [nr, nc]
    scale = torch.where(absmax > 0, absmax / FP8_MAX, torch.ones_like(absmax))
    q = (blocks / scale[:, None, :, None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q.view(nr * b0, nc * b1)[:rows, :cols].contiguous(), scale


def _is_quantizable(name: str, tensor: torch.Tensor, skip: tuple[str, ...]) -> bool:
    """Linear projection weights inside decoder layers; embeddings, norms, router and lm_head stay."""
    return (
        name.endswith(".weight") and tensor.dim() == 2 and ".layers." in name
        and "norm" not in name and not name.endswith("mlp.gate.weight")
        and not any(s in name for s in skip)
    )


def write_fp8_checkpoint(src_dir: str | Path, dst_dir: str | Path, block: tuple[int, int] = (128, 128),
                         skip: tuple[str, ...] = ()) -> Path:
    """Write an FP8 copy of the checkpoint in `src_dir` to `dst_dir` in DeepSeek-V3's format.

    Linear weights of decoder layers become float8_e4m3fn + float32 `weight_scale_inv` per block; the rest is
    copied as is. config.json gains `quantization_config`; tokenizer and other small files are copied.
    """
    src, dst = Path(src_dir), Path(dst_dir)
    dst.mkdir(parents=True, exist_ok=True)
    reader = CheckpointReader(src)
    tensors: dict[str, torch.Tensor] = {}
    for name in reader.names():
        tensor = reader.get(name)
        if _is_quantizable(name, tensor, skip):
            tensors[name], tensors[name + SCALE_SUFFIX] = quantize_fp8(tensor, block)
        else:
            tensors[name] = tensor.clone()
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    for item in src.iterdir():
        if item.is_file() and not item.name.endswith(".safetensors") and item.name != "model.safetensors.index.json":
            shutil.copy2(item, dst / item.name)
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = {
        "quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": list(block),
    }
    (dst / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return dst
