"""Cost model primitives: how long one piece of work takes on the CPU, on the accelerator, or on the link.

Every primitive is a roofline over the machine's profile: time = max(bytes / achieved bandwidth,
FLOPs / achieved arithmetic rate), with achieved = datasheet x measured efficiency, or read from a measured
table where the profile has one (tables win: they are this machine). CPU expert kernels also pay the cost of
unpacking each weight (FP8/INT4 -> fp32) once per call, which bounds GEMV speed on small CPUs, and a fixed
dispatch cost per call.

When the profile carries this engine's op tables for the model's shapes (placement/op_tables.py), every CPU
piece is costed from them instead: each matmul of a part at its own shape, the engine's attention, its expert
kernels, its elementwise passes and its host cost per step and layer. This is how the planner predicts our own
engine's CPU steps (`hybridmoe bench costmodel` checks it against measured steps).

The one fitted constant of the model lives here: FITTED_DISPATCH_US, the fixed cost of one call of the CPU
expert kernels in a decode or hybrid step (thread wake-up across sockets, synchronisation with the
accelerator), used for CPUs whose profile has no measured `dispatch_us`. It was fitted on exactly one
published figure (see placement/paper.py, which re-derives it); every other number comes from a profile.
Attention kernels are assumed to reach the GPU's matmul efficiency unless the profile measured them.
Legend: T tokens, W weights, C context, K top-k.
"""

from __future__ import annotations

import functools
import math

import numpy as np

from hybridmoe.placement.format_sizes import WeightFormat, weight_format
from hybridmoe.placement.hardware import GpuSpec, Machine, ProfileError, Table
from hybridmoe.placement.modelspec import ModelSpec
from hybridmoe.placement.op_tables import OpTables
from hybridmoe.placement.routing import RoutingStats

# Fitted on the paper's 21.5 tok/s FP8 decode (DeepSeek-V3, one RTX 5090, dual-socket CPU) by
# hybridmoe.placement.paper.fit_dispatch_us(); a test checks that the fit reproduces this value.
FITTED_DISPATCH_US = 61.5

ACTIVATION_BYTES = 2  # hidden states cross the link in bf16
COMPUTE_FALLBACK = {"fp8": "bf16", "int8": "bf16", "bf16": "fp32"}
ROUTER_FORMAT = "bf16"


def interpolate(table: Table, x: float) -> float:
    """Log-log interpolation in a measured (x, y) table; beyond either end the nearest y."""
    xs = np.log([p[0] for p in table])
    ys = np.log([p[1] for p in table])
    return float(np.exp(np.interp(math.log(max(x, 1e-9)), xs, ys)))


class CostModel:
    """Times of the pieces of a forward pass of `spec` on `machine` with the given weight formats."""

    def __init__(self, machine: Machine, spec: ModelSpec, expert_format: str | None = None,
                 dense_format: str | None = None, routing: RoutingStats | None = None, mla_form: str = "auto",
                 attention_efficiency: float | None = None, dispatch_us: float | None = None):
        self.machine, self.spec = machine, spec
        self.cpu, self.gpu = machine.cpu, machine.gpu
        self.expert_fmt: WeightFormat = weight_format(expert_format or spec.expert_format)
        self.dense_fmt: WeightFormat = weight_format(dense_format or spec.dense_format)
        self.mla_form = mla_form
        moe_layers = tuple(l.index for l in spec.moe_layers)
        self.routing = routing or RoutingStats.uniform(moe_layers, spec.num_experts, spec.top_k)
        if spec.moe_layers:
            self.routing.check_model(moe_layers, spec.num_experts, spec.top_k)
        self.row_of_layer = {layer: row for row, layer in enumerate(moe_layers)}
        self._distinct: dict[tuple[int, float], float] = {}
        self._gpu_bw: float | None = None
        self._rate_keys: dict[str, str] = {}
        self._h2d: float | None = None
        gpu_eff = (self.gpu.attention_efficiency or self.gpu.matmul_efficiency) if self.gpu else None
        self.attention_efficiency = attention_efficiency or gpu_eff
        self.dispatch_s = 1e-6 * (dispatch_us if dispatch_us is not None else
                                  self.cpu.dispatch_us if self.cpu.dispatch_us is not None else FITTED_DISPATCH_US)
        self._check_formats()
        self.ops_missing = self._op_tables_missing()
        # the profile's op tables when they cover this model in this expert format, else None (roofline)
        self.ops: OpTables | None = self.cpu.op_tables if not self.ops_missing else None

    def _op_tables_missing(self) -> list[str]:
        """What the profile's op tables lack for this model (["no op tables"] without any)."""
        ops, spec = self.cpu.op_tables, self.spec
        if ops is None:
            return ["no op tables"]
        linear = {s for layer in spec.layers for part in ("attention", "router", "shared", "dense")
                  for s in spec.part_matmuls(part, layer.index)} | set(spec.part_matmuls("lm_head"))
        expert = (self.expert_fmt.name, spec.hidden, spec.expert_intermediate) if spec.moe_layers else None
        return ops.missing_for(linear, set(spec.absorption_matmuls), spec.attention_shape, expert)

    def _check_formats(self) -> None:
        if self.gpu is not None:
            for fmt in (self.expert_fmt, self.dense_fmt):
                self.compute_key(fmt.accelerator_compute)

    # ---- sizes (bytes) ---------------------------------------------------------------------------------
    @functools.cached_property
    def expert_bytes(self) -> float:
        return self.expert_fmt.nbytes(self.spec.moe_layers[0].expert) if self.spec.moe_layers else 0.0

    def part_bytes(self, layer: int, part: str) -> float:
        shape = self.spec.layers[layer]
        if part == "router":
            return weight_format(ROUTER_FORMAT).nbytes(shape.router)
        weights = {"attention": shape.attention, "shared": shape.shared_experts, "dense": shape.dense_mlp}[part]
        return self.dense_fmt.nbytes(weights)

    @property
    def lm_head_bytes(self) -> float:
        return self.dense_fmt.nbytes(self.spec.lm_head or self.spec.embedding)

    def layer_expert_bytes(self, layer: int) -> float:
        return self.expert_bytes * self.spec.layers[layer].num_experts

    # ---- accelerator -----------------------------------------------------------------------------------
    def _gpu(self) -> GpuSpec:
        if self.gpu is None:
            raise ProfileError(f"machine {self.machine.name} has no accelerator")
        return self.gpu

    def gpu_bandwidth(self) -> float:
        if self._gpu_bw is None:
            gpu = self._gpu()
            self._gpu_bw = gpu.memory_gbs * 1e9 * gpu.memory_efficiency
        return self._gpu_bw

    def compute_key(self, compute: str) -> str:
        """The rate a format multiplies at: its own if the profile has it, else the next wider one (an
        accelerator without FP8 units dequantises and multiplies in bf16)."""
        gpu = self._gpu()
        key = compute
        while key not in gpu.peak_tflops and key not in gpu.matmul_table:
            if key not in COMPUTE_FALLBACK:
                raise ProfileError(f"{gpu.name}: no matmul rate for '{compute}' or a wider type "
                                   f"(profile has {', '.join(gpu.peak_tflops)})")
            key = COMPUTE_FALLBACK[key]
        return key

    def gpu_rate(self, compute: str, tokens: float) -> float:
        """Achieved matmul FLOP/s at `tokens` rows for a compute key (fp32|bf16|fp8|int8)."""
        gpu = self._gpu()
        key = self._rate_keys.get(compute) or self._rate_keys.setdefault(compute, self.compute_key(compute))
        table = gpu.matmul_table.get(key)
        if table:
            return interpolate(table, tokens) * 1e12
        return gpu.peak_tflops[key] * 1e12 * gpu.matmul_efficiency

    def gpu_matmul_s(self, weights: float, tokens: float, fmt: WeightFormat, flops: float | None = None) -> float:
        """W weights in `fmt` multiplied with T token rows (flops defaults to 2*W*T)."""
        if weights <= 0 and not flops:
            return 0.0
        work = 2.0 * weights * tokens if flops is None else flops
        return max(fmt.nbytes(weights) / self.gpu_bandwidth(), work / self.gpu_rate(fmt.accelerator_compute, tokens))

    def gpu_attention_s(self, queries: int, context_before: int, sequences: int = 1) -> float:
        """One layer's attention half for `sequences` sequences of `queries` new tokens each."""
        spec = self.spec
        linear = spec.attention_linear_flops(queries, context_before, self.mla_form) * sequences
        pairs = spec.attention_pair_flops(queries, context_before, self.mla_form) * sequences
        weights = spec.layers[0].attention
        matmul = self.gpu_matmul_s(weights, queries * sequences, self.dense_fmt, flops=linear)
        gpu = self._gpu()
        if gpu.attention_table:
            rate = interpolate(gpu.attention_table, context_before + queries) * 1e12
        else:
            rate = gpu.peak_tflops["bf16"] * 1e12 * self.attention_efficiency
        kv = sequences * (context_before + queries) * spec.kv_values_per_token * 2
        return matmul + max(pairs / rate, kv / self.gpu_bandwidth())

    def gpu_experts_s(self, experts: float, pairs: float) -> float:
        """Grouped GEMM over `experts` routed experts that together see `pairs` (token, expert) pairs."""
        if experts <= 1e-9:
            return 0.0
        w = self.spec.moe_layers[0].expert
        rows = pairs / experts  # tokens per expert sets the GEMM shape
        return max(experts * self.expert_bytes / self.gpu_bandwidth(),
                   2.0 * w * pairs / self.gpu_rate(self.expert_fmt.accelerator_compute, rows))

    # ---- CPU -------------------------------------------------------------------------------------------
    def cpu_bandwidth(self, copying: bool = False) -> float:
        bw = self.cpu.memory_read_gbs * 1e9 * self.cpu.stream_efficiency
        return bw * self.copy_slowdown() if copying else bw

    def copy_slowdown(self) -> float:
        """Fraction of CPU memory bandwidth left while host->device copies stream from host memory:
        measured, or derived as 1 - (link bandwidth / memory bandwidth) per GPU streaming."""
        if self.cpu.copy_slowdown is not None:
            return self.cpu.copy_slowdown
        if self.gpu is None:
            return 1.0
        streaming = self.gpu.h2d_gbs * max(1, self.machine.num_gpus)
        return max(0.05, 1.0 - streaming / self.cpu.memory_read_gbs)

    def cpu_matmul_s(self, weights: float, tokens: float, fmt: WeightFormat, copying: bool = False,
                     flops: float | None = None) -> float:
        """W weights in `fmt` times T tokens on the CPU: streaming bound vs unpack + multiply bound."""
        if weights <= 0 and not flops:
            return 0.0
        work = 2.0 * weights * tokens if flops is None else flops
        memory = fmt.nbytes(weights) / self.cpu_bandwidth(copying)
        rate = self.cpu.decode_gweights_s.get(fmt.name)
        unpack = weights / (rate * 1e9) if rate else 0.0
        return max(memory, unpack + work / (self.cpu.peak_tflops * 1e12 * self.cpu.matmul_efficiency))

    def cpu_part_s(self, layer: int, part: str, tokens: float) -> float:
        """A part of `layer` ("router", "shared", "dense", "lm_head") for `tokens` tokens on the CPU."""
        if self.ops is not None:
            return sum(self.ops.linear_s(rows, cols, tokens) for rows, cols in self.spec.part_matmuls(part, layer))
        shape = self.spec.layers[layer]
        if part == "lm_head":
            return self.cpu_matmul_s(self.spec.lm_head or self.spec.embedding, tokens, self.dense_fmt)
        weights = {"router": shape.router, "shared": shape.shared_experts, "dense": shape.dense_mlp}[part]
        return self.cpu_matmul_s(weights, tokens, weight_format(ROUTER_FORMAT) if part == "router" else self.dense_fmt)

    def cpu_host_s(self, kind: str, layer: int | None, tokens: float) -> float:
        """What the op tables measured beyond the arithmetic (0 without them): the engine's host cost of a
        step (layer None) or of one layer, plus that layer's elementwise passes; kind "decode" | "prefill"."""
        if self.ops is None:
            return 0.0
        host = self.ops.host[kind]
        if layer is None:
            return host["step"]
        shape = self.spec.layers[layer]
        return (host["moe_layer" if shape.is_moe else "dense_layer"]
                + self.ops.elementwise.above_floor(self.spec.elementwise_elements(tokens, layer)))

    def cpu_experts_s(self, experts: float, pairs: float, copying: bool = False) -> float:
        """Routed experts on the CPU kernels: `experts` distinct experts read, `pairs` (token, expert) pairs."""
        if experts <= 1e-9:
            return 0.0
        if self.ops is not None:  # the call's fixed cost is in the host cost
            return experts * self.ops.experts(pairs / experts) / (self.copy_slowdown() if copying else 1.0)
        w = self.spec.moe_layers[0].expert
        table = self.cpu.expert_table.get(self.expert_fmt.name)
        if table:  # measured weight-bytes/s of one call at T tokens per expert (dispatch included)
            rows = pairs / experts
            last_t, last_gbs = table[-1]
            seconds = experts * self.expert_bytes / (interpolate(table, rows) * 1e9)
            if rows > last_t:  # beyond the table the kernel is compute-bound: time grows with T
                seconds = experts * self.expert_bytes / (last_gbs * 1e9) * rows / last_t
            return seconds / (self.copy_slowdown() if copying else 1.0) + self.dispatch_s
        return self.cpu_matmul_s(w * experts, pairs / experts, self.expert_fmt, copying) + self.dispatch_s

    def cpu_attention_s(self, queries: int, context_before: int, sequences: int = 1) -> float:
        spec = self.spec
        if self.ops is not None:  # the engine's form: MLA absorbed, projections batched over the sequences
            tokens = queries * sequences
            return (sum(self.ops.linear_s(rows, cols, tokens) for rows, cols in spec.attention_matmuls)
                    + sum(self.ops.batched_s(shape, tokens) for shape in spec.absorption_matmuls)
                    + sequences * self.ops.attention_s(queries, context_before))
        linear = spec.attention_linear_flops(queries, context_before, self.mla_form) * sequences
        pairs = spec.attention_pair_flops(queries, context_before, self.mla_form) * sequences
        matmul = self.cpu_matmul_s(spec.layers[0].attention, queries * sequences, self.dense_fmt, flops=linear)
        if self.cpu.attention_table:
            rate = interpolate(self.cpu.attention_table, context_before + queries) * 1e12
        else:
            rate = self.cpu.peak_tflops * 1e12 * self.cpu.matmul_efficiency
        kv = sequences * (context_before + queries) * spec.kv_values_per_token * 2
        return matmul + max(pairs / rate, kv / self.cpu_bandwidth())

    # ---- link ------------------------------------------------------------------------------------------
    def h2d_s(self, nbytes: float) -> float:
        gpu = self._gpu()
        return gpu.link_latency_us * 1e-6 + nbytes / (self.h2d_gbs() * 1e9)

    def h2d_gbs(self) -> float:
        """Per-GPU host->device bandwidth, capped by what host memory can feed all GPUs at once."""
        if self._h2d is None:
            feed = self.cpu.memory_read_gbs * self.cpu.stream_efficiency / max(1, self.machine.num_gpus)
            self._h2d = min(self._gpu().h2d_gbs, feed)
        return self._h2d

    def d2h_s(self, nbytes: float) -> float:
        gpu = self._gpu()
        return gpu.link_latency_us * 1e-6 + nbytes / (gpu.d2h_gbs * 1e9)

    def gpu_to_gpu_s(self, nbytes: float) -> float:
        """One GPU sends `nbytes` to another: over a peer link, else through host memory."""
        gpu = self._gpu()
        if gpu.p2p_gbs:
            return gpu.link_latency_us * 1e-6 + nbytes / (gpu.p2p_gbs * 1e9)
        return self.d2h_s(nbytes) + self.h2d_s(nbytes)

    def activations_bytes(self, tokens: float) -> float:
        return tokens * self.spec.hidden * ACTIVATION_BYTES

    # ---- routing ---------------------------------------------------------------------------------------
    def distinct_experts(self, layer: int, tokens: float, exclude: np.ndarray | None = None) -> float:
        if exclude is not None:
            return self.routing.expected_distinct(self.row_of_layer[layer], tokens, exclude)
        key = (layer, tokens)
        if key not in self._distinct:
            self._distinct[key] = self.routing.expected_distinct(self.row_of_layer[layer], tokens)
        return self._distinct[key]

    def routed_fraction(self, layer: int, experts: np.ndarray) -> float:
        return self.routing.routed_fraction(self.row_of_layer[layer], experts)
