"""DeepSeek-V3 checkpoints in the native FP8 format (float8_e4m3fn + float32 weight_scale_inv per 128x128
block): our forward against a float64 reference built from our exact block dequantisation, with dimensions
that are multiples of 128 and with partial last blocks; routed experts stay FP8 in memory."""

from __future__ import annotations

import pytest
import torch
from hf_reference import set_expert_weight
from transformers import AutoModelForCausalLM

from hybridmoe.checkpoint.fp8 import SCALE_SUFFIX, dequantize_fp8, write_fp8_checkpoint
from hybridmoe.checkpoint.safetensors_reader import CheckpointReader
from hybridmoe.kernels import isa
from hybridmoe.models.loader import load_model
from hybridmoe.runtime.model_runner import ModelRunner, SequenceChunk

SHAPES = {
    "multiples_of_128": dict(hidden_size=256, intermediate_size=256, moe_intermediate_size=128, kv_lora_rank=128,
                             qk_nope_head_dim=64, qk_rope_head_dim=128, v_head_dim=64, num_attention_heads=2,
                             num_hidden_layers=2),
    "partial_blocks": dict(hidden_size=192, intermediate_size=160, moe_intermediate_size=96, kv_lora_rank=48,
                           qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32, num_attention_heads=3,
                           q_lora_rank=40, num_hidden_layers=2),
}


def _float64_reference(src_dir, fp8_dir):
    """The transformers model in float64 with every FP8 weight replaced by its float64 block dequantisation."""
    model = AutoModelForCausalLM.from_pretrained(src_dir, dtype=torch.float64, experts_implementation="eager").eval()
    reader = CheckpointReader(fp8_dir)
    params = dict(model.named_parameters())
    for name in reader.names():
        if not name.endswith(SCALE_SUFFIX) and name + SCALE_SUFFIX in reader:
            deq = dequantize_fp8(reader.get(name), reader.get(name + SCALE_SUFFIX), (128, 128), torch.float64)
            if name in params:
                params[name].data.copy_(deq)
            else:  # per-expert keys on disk, fused [E, ...] tensors in memory
                set_expert_weight(model, name, deq)
    return model


def _bf16_dot_isa() -> str | None:
    """An ISA with bf16 dot products this machine runs (native, else the AVX2 emulation), or None."""
    return next((name for name in ("avx512bf16", "avx2bf16") if name in isa.available_isas()), None)


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["cpu", "cpu-bf16-dot", "torch"])
@pytest.mark.parametrize("shape", list(SHAPES))
def test_fp8_forward_matches_float64_block_dequantised_reference(tiny_model_dir, tmp_path, shape, backend):
    """cpu-bf16-dot: the CPU kernels with bf16 activations (ISA avx512bf16 or avx2bf16) through the whole model."""
    if backend == "cpu-bf16-dot":
        if _bf16_dot_isa() is None:
            pytest.skip("no ISA with bf16 dot products on this CPU")
        with isa.use_isa(_bf16_dot_isa()):
            _check_fp8_forward(tiny_model_dir, tmp_path, shape, "cpu")
    else:
        _check_fp8_forward(tiny_model_dir, tmp_path, shape, backend)


def _check_fp8_forward(tiny_model_dir, tmp_path, shape: str, backend: str) -> None:
    src = tiny_model_dir("deepseek_v3", **SHAPES[shape])
    fp8_dir = write_fp8_checkpoint(src, tmp_path / "fp8")
    model = load_model(fp8_dir, "float32", backend)
    moe_layer = next(layer for layer in model.layers if hasattr(layer.mlp, "router"))
    experts = moe_layer.mlp.experts
    if backend == "torch":
        assert experts.w.fmt == "fp8" and experts.w.gate[0].dtype == torch.float8_e4m3fn  # kept in FP8
    else:
        assert experts.moe.fmt == "fp8"  # the kernels read the FP8 bytes as stored

    reference = _float64_reference(src, fp8_dir)
    prompts = [torch.randint(3, 300, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (9, 4)]
    runner = ModelRunner(model, num_blocks=8, block_size=8)
    ours = runner.forward([SequenceChunk(prompts[0], 0, [0, 1]), SequenceChunk(prompts[1], 0, [2])], all_logits=True)
    ref = torch.cat([reference(torch.tensor([p])).logits[0] for p in prompts]).float()
    err = (ours - ref).abs().max() / ref.abs().max()
    # the issue asks for 2e-2; both expert backends reach ~1e-6 (float32 arithmetic on the same FP8 values), the
    # CPU kernels ~3e-3 where their ISA rounds activations to bf16 (bf16 dot products: avx512bf16, avx2bf16; AMX
    # tiles: amx, measured 2.5e-3 on a lent Xeon). The FP8 attention projections run on the kernels with either
    # expert backend, so the ISA decides for both.
    rounds = isa.bf16_dot() or isa.amx()
    assert err < (1e-2 if rounds else 1e-4), f"relative error {err:.2e}"
