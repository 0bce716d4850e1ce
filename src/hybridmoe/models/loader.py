"""`load_model(model_dir, dtype)`: config + memory-mapped checkpoint -> a ready MoEDecoderModel."""

from __future__ import annotations

from pathlib import Path

import torch

from hybridmoe.checkpoint.safetensors_reader import CheckpointReader
from hybridmoe.config import ModelConfig, load_config
from hybridmoe.kernels.isa import cpu_features
from hybridmoe.layers.moe.cpu_backend import CpuExpertBackend
from hybridmoe.layers.moe.torch_backend import TorchExpertBackend
from hybridmoe.models.decoder import ExpertBackendFactory, MoEDecoderModel, build_decoder
from hybridmoe.models.transformed_weights import TransformedWeights
from hybridmoe.models.weight_loader import WeightLoader

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# Routed-expert backends: "cpu" runs the C++ kernels (the default), "torch" the plain-torch reference.
EXPERT_BACKENDS: dict[str, ExpertBackendFactory] = {"cpu": CpuExpertBackend, "torch": TorchExpertBackend}


def resolve_dtype(dtype: str | torch.dtype) -> torch.dtype:
    """A dtype name -> torch dtype. "auto": bfloat16 where the hardware computes in it natively (a GPU, a CPU
    with AVX512-BF16), else float32 (a CPU without bf16 units runs bf16 matmuls several times slower than
    fp32). The compute dtype never converts routed experts, nor bf16/f16 projections under float32: they stay in
    their stored format for the kernels (layers.linear)."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        native_bf16 = torch.cuda.is_available() or cpu_features().get("avx512_bf16", False)
        return torch.bfloat16 if native_bf16 else torch.float32
    if dtype not in DTYPES:
        raise ValueError(f"dtype {dtype!r} is not supported; choose one of {['auto', *DTYPES]}")
    return DTYPES[dtype]


def expert_backend_factory(name: str) -> ExpertBackendFactory:
    if name not in EXPERT_BACKENDS:
        raise ValueError(f"expert backend {name!r} is not supported; choose one of {list(EXPERT_BACKENDS)}")
    return EXPERT_BACKENDS[name]


def load_model(model_dir: str | Path, dtype: str | torch.dtype = "auto", expert_backend: str = "cpu",
               config: ModelConfig | None = None, show_progress: bool | None = None,
               transformed: TransformedWeights | None = None) -> MoEDecoderModel:
    """transformed: where the weights made at load go (None: this process's memory; see WeightLoader)."""
    backend_factory = expert_backend_factory(expert_backend)
    config = config or load_config(model_dir)
    reader = CheckpointReader(model_dir)
    loader = WeightLoader(reader, config, resolve_dtype(dtype), show_progress, transformed)
    return build_decoder(config, loader, backend_factory)
