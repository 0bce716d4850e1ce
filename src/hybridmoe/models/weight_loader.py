"""Typed weight access for model construction: shape/dtype checks, FP8 handling, progress reporting.

`WeightLoader.dense(name, shape)` returns a tensor in the model's compute dtype: a zero-copy view of the
mapped checkpoint when the stored dtype already matches, a converted copy otherwise, and an exact block
dequantisation for FP8 tensors that carry a `weight_scale_inv`. `WeightLoader.linear(name, shape)` returns a
projection for the kernels (layers.linear.Linear) in its stored format: FP8 and int4/int8 stay as stored, and so
do bf16/f16 under a float32 compute dtype (converted, they would double the bytes a decode step reads).
`WeightLoader.experts(...)` keeps routed experts as stored (FP8 stays FP8 for the CPU kernels, BF16 stays BF16
under a float32 compute dtype). The converted and dequantised copies, and router weights converted to float32,
are the only tensors the loader makes: they go through a `TransformedWeights` (models/transformed_weights.py:
this process's memory, or a segment that `serve --pd`'s workers share).
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Iterable

import torch

from hybridmoe.checkpoint.fp8 import SCALE_SUFFIX, dequantize_fp8
from hybridmoe.checkpoint.safetensors_reader import CheckpointError, CheckpointReader
from hybridmoe.config import ModelConfig
from hybridmoe.layers.linear import Linear, keeps_stored
from hybridmoe.layers.moe.backend import ExpertWeights
from hybridmoe.models.transformed_weights import PrivateWeights, TransformedWeights

FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
FP8_DTYPES = (torch.float8_e4m3fn,)


class WeightLoader:
    def __init__(self, reader: CheckpointReader, config: ModelConfig, dtype: torch.dtype,
                 show_progress: bool | None = None, transformed: TransformedWeights | None = None):
        self.reader, self.config, self.dtype = reader, config, dtype
        self.transformed = transformed or PrivateWeights()
        self.block = config.quantization.block_size if config.quantization else (128, 128)
        self.used: set[str] = set()
        self._progress = _Progress(config.num_layers, show_progress)

    def dense(self, name: str, shape: tuple[int, ...]) -> torch.Tensor:
        """A non-expert weight in the compute dtype (FP8 tensors dequantised exactly)."""
        tensor = self.reader.get_checked(name, shape, FLOAT_DTYPES + FP8_DTYPES)
        self.used.add(name)
        if tensor.dtype in FP8_DTYPES:
            scale = self._scale(name, shape)
            return self._made(name, shape, self.dtype,
                              lambda out: out.copy_(dequantize_fp8(tensor, scale, self.block, self.dtype)))
        if tensor.dtype == self.dtype:
            return tensor
        return self._made(name, shape, self.dtype, lambda out: out.copy_(tensor))

    def linear(self, name: str, shape: tuple[int, int], bias: str | None = None) -> Linear:
        """A projection weight [N, K] for the kernels, kept in its stored format: FP8 with its block scales,
        int4/int8 per group (quantised by `hybridmoe quantize`), bf16/f16 under a float32 compute dtype, else float
        in the compute dtype; with the bias tensor `bias` (compute dtype) when given."""
        b = self.dense(bias, (shape[0],)) if bias is not None else None
        if self.config.expert_quantization is not None and name + "_scale" in self.reader:
            fmt, data, scales = self._int_matrix(name, shape)
            return Linear(fmt, data, scales, cols=shape[1], bias=b, name=name)
        tensor = self.reader.get_checked(name, shape, FLOAT_DTYPES + FP8_DTYPES)
        if tensor.dtype in FP8_DTYPES:
            self.used.add(name)
            return Linear("fp8", tensor, self._scale(name, shape), cols=shape[1], bias=b, block=self.block, name=name)
        if keeps_stored(tensor.dtype, self.dtype):
            self.used.add(name)
            return Linear.dense(tensor, b, name=name)
        return Linear.dense(self.dense(name, shape), b, name=name)

    def optional_dense(self, name: str, shape: tuple[int, ...]) -> torch.Tensor | None:
        return self.dense(name, shape) if name in self.reader else None

    def float32(self, name: str, shape: tuple[int, ...]) -> torch.Tensor:
        """Router weights and biases: kept in float32 as the reference routers compute in float32."""
        tensor = self.reader.get_checked(name, shape, FLOAT_DTYPES)
        self.used.add(name)
        return tensor if tensor.dtype == torch.float32 else self._made(name, shape, torch.float32,
                                                                       lambda out: out.copy_(tensor))

    def derived(self, key: str, shape: tuple[int, ...], dtype: torch.dtype, fill) -> torch.Tensor:
        """A tensor the model makes at load from its weights (a re-laid-out copy), [shape] of dtype as fill(out)
        writes it, kept where the loader's own are (once for `serve --pd`'s workers); key: a name unique to it."""
        return self.transformed.get(key, tuple(shape), dtype, fill)

    def _made(self, name: str, shape: tuple[int, ...], dtype: torch.dtype, fill) -> torch.Tensor:
        """Checkpoint tensor `name` made into [shape] of dtype by fill(out), where `transformed` keeps it."""
        return self.derived(f"{name}:{str(dtype).removeprefix('torch.')}", shape, dtype, fill)

    def experts(self, names: Iterable[tuple[str, str, str]], inter: int, hidden: int) -> ExpertWeights:
        """Routed experts from (gate, up, down) weight names per expert.

        Experts stay as stored, zero-copy, whatever the compute dtype: FP8 with its block scales, int4/int8
        packed with their group scales, BF16/FP16/FP32 as they are (the backends convert on the fly). Copies a
        backend makes of them per NUMA node go where the transformed weights go when those are shared.
        """
        names = list(names)
        weights = self._experts(names, inter, hidden)
        if not isinstance(self.transformed, PrivateWeights) and names:
            weights.shard_storage = functools.partial(_shard_buffer, self.transformed, names[0][0])
        return weights

    def _experts(self, names: list[tuple[str, str, str]], inter: int, hidden: int) -> ExpertWeights:
        if self.config.expert_quantization is not None:
            return self._int_experts(names, inter, hidden)
        gate, up, down, scales = [], [], [], ([], [], [])
        fmt = None
        for triple in names:
            for proj, (name, shape) in enumerate(zip(triple, ((inter, hidden), (inter, hidden), (hidden, inter)))):
                tensor = self.reader.get_checked(name, shape, FLOAT_DTYPES + FP8_DTYPES)
                self.used.add(name)
                this_fmt = "fp8" if tensor.dtype in FP8_DTYPES else "dense"
                if fmt not in (None, this_fmt):
                    raise CheckpointError(f"{self.reader.entry(name).file}: tensor {name!r} is {tensor.dtype}, "
                                          f"but other experts of the layer are {fmt}")
                fmt = this_fmt
                if fmt == "fp8":
                    scales[proj].append(self._scale(name, shape))
                (gate, up, down)[proj].append(tensor)
        if fmt == "fp8":
            return ExpertWeights("fp8", gate, up, down, *scales, block_size=self.block)
        return ExpertWeights("dense", gate, up, down)

    def _int_experts(self, names: Iterable[tuple[str, str, str]], inter: int, hidden: int) -> ExpertWeights:
        """int4/int8 per-group experts as written by `hybridmoe quantize` (layout in kernels.formats)."""
        method = self.config.expert_quantization.method
        parts: tuple[list, ...] = ([], [], [], [], [], [])  # gate, up, down, and their scales
        for triple in names:
            for proj, (name, shape) in enumerate(zip(triple, ((inter, hidden), (inter, hidden), (hidden, inter)))):
                fmt, data, scales = self._int_matrix(name, shape)
                if fmt != method:
                    raise CheckpointError(f"{self.reader.entry(name).file}: expert tensor {name!r} is {fmt}, the "
                                          f"config's expert_quantization says {method}")
                parts[proj].append(data)
                parts[3 + proj].append(scales)
        return ExpertWeights(method, *parts)

    def _int_matrix(self, name: str, shape: tuple[int, int]) -> tuple[str, torch.Tensor, torch.Tensor]:
        """(format, data, scales) of an int4/int8 per-group matrix of logical shape [N, K] (layout:
        kernels.formats). The format follows from the stored dtype (int4: two codes per uint8, int8: int8), so
        one checkpoint may hold both (an int4 model keeps its LM head in int8); the group size from the config."""
        quant = self.config.expert_quantization
        group = quant.group_size
        stored = self.reader.entry(name).dtype
        fmt, per_byte = ("int4", 2) if stored == torch.uint8 else ("int8", 1)
        scale_dtype = torch.bfloat16 if quant.scale_dtype == "bfloat16" else torch.float16
        rows, cols = shape
        padded = -(-cols // group) * group
        data = self.reader.get_checked(name, (rows, padded // per_byte), (torch.uint8, torch.int8))
        scale_name = name + "_scale"
        if scale_name not in self.reader:
            raise CheckpointError(f"{self.reader.entry(name).file}: {fmt} tensor {name!r} has no {scale_name!r}")
        scales = self.reader.get_checked(scale_name, (rows, padded // group), (scale_dtype,))
        self.used.update((name, scale_name))
        return fmt, data, scales

    def _scale(self, name: str, shape: tuple[int, ...]) -> torch.Tensor:
        scale_name = name + SCALE_SUFFIX
        if scale_name not in self.reader:
            raise CheckpointError(f"{self.reader.entry(name).file}: FP8 tensor {name!r} has no {scale_name!r}")
        b0, b1 = self.block
        scale = self.reader.get_checked(scale_name, (-(-shape[0] // b0), -(-shape[1] // b1)), (torch.float32,))
        self.used.add(scale_name)
        return scale

    def layer_done(self) -> None:
        self._progress.advance()

    def close(self) -> None:
        self._progress.close()


class _Progress:
    """A per-layer progress bar on a terminal, silent otherwise."""

    def __init__(self, total: int, show: bool | None):
        self._bar = None
        if show if show is not None else sys.stderr.isatty():
            from rich.progress import Progress

            self._bar = Progress(transient=True)
            self._task = self._bar.add_task("loading layers", total=total)
            self._bar.start()

    def advance(self) -> None:
        if self._bar is not None:
            self._bar.advance(self._task)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.stop()


def _shard_buffer(transformed: TransformedWeights, first_name: str, node: int, nbytes: int) -> tuple[torch.Tensor, bool]:
    """The buffer of a layer's expert copies for NUMA node `node` (keyed by the layer's first expert weight), and
    whether another process has filled it: `transformed` calls fill only where this process makes it."""
    made: list[bool] = []
    buffer = transformed.get(f"{first_name}:numa_shard_copies.{node}", (nbytes,), torch.uint8,
                             lambda out: made.append(True))
    return buffer, not made
