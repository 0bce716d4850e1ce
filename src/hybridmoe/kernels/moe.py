"""FusedMoE: one layer's routed experts computed by the C++ kernels, asynchronously.

`submit(hidden, topk_ids, topk_weights)` checks its inputs, queues the computation on the kernels' executor and
returns at once; `wait(handle)` blocks (without the GIL) and returns [T, H] in hidden's dtype. In between,
Python is free to run other work (accelerator kernels of another micro-batch). The weights are the caller's
tensors, used in place (no copy), except that with several real NUMA nodes each node's shard of the
experts' intermediate dimension is copied once into that node's memory, and with HYBRIDMOE_COPY_EXPERTS=1 (one
node too) the experts are copied once into the kernels' own memory on transparent huge pages (see
hybridmoe.kernels.numa).

`matmul(w, x)` is one projection on the kernels (every `Linear`); `matmul_heads(heads, x)` one matrix per head in one
call (MLA's absorbed kv_b_proj at decode).

Legend: T tokens, H hidden, K top-k, I expert intermediate, E experts.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils.dlpack import to_dlpack

from hybridmoe.kernels import _native
from hybridmoe.kernels.weights import dense_format, kernel_matrix

PATHS = ("auto", "gemv", "gemm")


def _dlpack(t: torch.Tensor):
    """t as a DLPack capsule for the bindings' typed ndarrays (no copy; the array they import keeps t alive). A
    decode step submits every MoE layer, and torch's Python-level Tensor.__dlpack__ costs about 10x this."""
    return to_dlpack(t)


def _as_dtype(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return t if t.dtype == dtype else t.to(dtype)


@dataclass
class MoEHandle:
    """A submitted computation; pass it to FusedMoE.wait."""

    native: Any  # _native.MoEHandle, or None when there was nothing to compute
    out: torch.Tensor
    result_dtype: torch.dtype

    def done(self) -> bool:
        return self.native is None or self.native.done()


class FusedMoE:
    """Routed experts of one layer in one format ("f32"/"bf16"/"f16"/"fp8"/"int4"/"int8")."""

    def __init__(self, fmt: str, gate: list[torch.Tensor], up: list[torch.Tensor], down: list[torch.Tensor],
                 gate_scale: list[torch.Tensor] | None = None, up_scale: list[torch.Tensor] | None = None,
                 down_scale: list[torch.Tensor] | None = None, *, hidden_size: int, intermediate_size: int,
                 block: tuple[int, int] = (128, 128),
                 shard_storage: Callable[[int, int], tuple[torch.Tensor, bool]] | None = None):
        if not gate:
            raise ValueError("FusedMoE needs at least one expert")
        self.fmt, self.hidden_size, self.intermediate_size = fmt, hidden_size, intermediate_size
        H, I = hidden_size, intermediate_size
        scales = {"gate": gate_scale, "up": up_scale, "down": down_scale}
        matrices: dict[str, list] = {"gate": [], "up": [], "down": []}
        for name, tensors, cols in (("gate", gate, H), ("up", up, H), ("down", down, I)):
            s = scales[name]
            if s is not None and len(s) != len(tensors):
                raise ValueError(f"{name}_scale: {len(s)} scales for {len(tensors)} experts")
            for e, t in enumerate(tensors):
                matrices[name].append(kernel_matrix(fmt, t, s[e] if s is not None else None, cols=cols,
                                                    block=block, name=f"expert {e} {name}"))
        # shard_storage: where each NUMA node's copies go (ExpertWeights.shard_storage), held alive here
        self._buffers = []
        if shard_storage is not None:
            sizes = _native.shard_copy_bytes(matrices["gate"], matrices["up"], matrices["down"], I)
            self._buffers = [shard_storage(node, nbytes) for node, nbytes in enumerate(sizes)]
        self._native = _native.MoE(matrices["gate"], matrices["up"], matrices["down"], H, I,
                                   [(_dlpack(b), filled) for b, filled in self._buffers])
        tensors = (gate, up, down, gate_scale, up_scale, down_scale)
        self.nbytes = sum(t.numel() * t.element_size() for group in tensors if group for t in group)
        # Views of the caller's tensors keep their memory alive; copies in node memory need nothing from them.
        self._tensors = None if self.owns_weights else tensors

    @property
    def native(self) -> _native.MoE:
        """The layer as the kernels hold it (what models.decode_stack passes on to its native stack)."""
        return self._native

    @property
    def owns_weights(self) -> bool:
        """Every NUMA node computes from its own copy of its shard (several real nodes, or copies asked for): the
        tensors this layer was built from are not referenced, and are freed once the caller drops them."""
        return self._native.owns_weights

    @property
    def num_experts(self) -> int:
        return self._native.num_experts

    @property
    def numa_shards(self) -> list[tuple[int, int, int, bool, bool]]:
        """Per NUMA node (as configured when this layer was built): (begin, end) of its range of every
        expert's intermediate dimension, bytes of weights, scales and flags copied into its memory (0: the
        shard is a view of the weights), whether that memory is bound to the node, and whether it is advised
        for transparent huge pages (copies of 2 MB and more)."""
        return [tuple(s) for s in self._native.numa_shards]

    def submit(self, hidden: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
               path: str = "auto") -> MoEHandle:
        """hidden [T, H] (bf16, fp16 or fp32), topk_ids [T, K] int, topk_weights [T, K] -> handle (at once)."""
        hidden, ids, weights, out, result_dtype = self._inputs(hidden, topk_ids, topk_weights, path)
        if hidden.shape[0] == 0:
            return MoEHandle(None, out, result_dtype)
        native = self._native.submit(_dlpack(hidden), _dlpack(ids), _dlpack(weights), _dlpack(out), path)
        return MoEHandle(native, out, result_dtype)

    def _inputs(self, hidden: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, path: str):
        """The checked inputs as the kernels take them, a fresh output, and the dtype to return."""
        if path not in PATHS:
            raise ValueError(f"path must be one of {PATHS}, got {path!r}")
        if hidden.dim() != 2 or hidden.shape[1] != self.hidden_size:
            raise ValueError(f"hidden must be [T, {self.hidden_size}], got {list(hidden.shape)}")
        if topk_ids.shape != topk_weights.shape or topk_ids.dim() != 2 or topk_ids.shape[0] != hidden.shape[0]:
            raise ValueError(f"topk_ids {list(topk_ids.shape)} and topk_weights {list(topk_weights.shape)} "
                             f"must both be [T, K] with T = {hidden.shape[0]}")
        if topk_ids.dtype.is_floating_point:
            raise ValueError(f"topk_ids must be an integer tensor, got {topk_ids.dtype}")
        result_dtype = hidden.dtype
        if hidden.dtype not in (torch.float32, torch.bfloat16):  # fp16 computes through fp32
            hidden = hidden.float()
        # A decode step calls this once per MoE layer: conversions only where needed (a same-dtype .to() and
        # torch.empty(shape, dtype=...) cost 0.7 and 1.7 us here, the checks and empty_like 0.07 and 0.7 us)
        hidden = hidden.contiguous()
        ids = (topk_ids if topk_ids.dtype == torch.int64 else topk_ids.to(torch.int64)).contiguous()
        weights = (topk_weights if topk_weights.dtype == torch.float32 else topk_weights.float()).contiguous()
        out = torch.empty_like(hidden)
        return hidden, ids, weights, out, result_dtype

    def wait(self, handle: MoEHandle) -> torch.Tensor:
        """Block until `handle` is done; returns [T, H] in the submitted hidden's dtype."""
        if handle.native is not None:
            handle.native.wait()
        return _as_dtype(handle.out, handle.result_dtype)

    def __call__(self, hidden: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                 path: str = "auto") -> torch.Tensor:
        """submit + wait, run on the calling thread when no submitted call is pending (no hand-off to the
        kernels' executor thread and back)."""
        hidden, ids, weights, out, result_dtype = self._inputs(hidden, topk_ids, topk_weights, path)
        if hidden.shape[0]:
            self._native.run(_dlpack(hidden), _dlpack(ids), _dlpack(weights), _dlpack(out), path)
        return _as_dtype(out, result_dtype)


def matmul(w: _native.Matrix, x: torch.Tensor, path: str = "auto",
           out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """x [M, K] @ W^T -> [M, N] on the kernels (blocking), computed in float32. x in float32 or bfloat16 goes to the
    kernels as it is (others through float32); out_dtype float32 or bfloat16 (rounded to nearest even, as
    `.to(torch.bfloat16)` would). A decode step calls this for every projection: no conversion it can spare."""
    if path not in PATHS:
        raise ValueError(f"path must be one of {PATHS}, got {path!r}")
    if out_dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"out_dtype must be float32 or bfloat16, got {out_dtype}")
    if (x.dtype != torch.float32 and x.dtype != torch.bfloat16) or not x.is_contiguous():
        x = x.float().contiguous()
    # new_empty takes about half of torch.empty(shape, dtype=...)'s 2-4 us: a decode step makes ~5 of these a layer
    out = x.new_empty((x.shape[0], w.rows)) if out_dtype == x.dtype else torch.empty((x.shape[0], w.rows), dtype=out_dtype)
    if x.shape[0]:
        _native.matmul(w, _dlpack(x), _dlpack(out), path)
    return out


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up on the kernels (the experts' own activation): gate, up [..., I] float32, contiguous -> a new
    float32 tensor of their shape."""
    out = torch.empty_like(gate)
    _native.silu_mul(_dlpack(gate), _dlpack(up), _dlpack(out))
    return out


class MatrixHeads:
    """One weight matrix W_n [M, K] per head n < N, all of one format and shape, for `matmul_heads` (MLA's
    absorbed kv_b_proj: W_uk^T [L, P] and W_uv [V, L] per head). The kernel matrices are views of the caller's
    tensors (no copy) and hold them alive."""

    def __init__(self, matrices: list[_native.Matrix]):
        self._native = _native.MatrixHeads(matrices)
        self.heads, self.rows, self.cols = self._native.heads, self._native.rows, self._native.cols

    @property
    def native(self) -> _native.MatrixHeads:
        """The matrices as the kernels hold them (what models.decode_stack passes on to its native stack)."""
        return self._native

    @classmethod
    def dense(cls, w: torch.Tensor, name: str = "weight") -> "MatrixHeads":
        """Float weights w [N, M, K] (float32, bfloat16 or float16; each head's rows contiguous, heads at any
        stride: e.g. one half of kv_b_proj viewed per head), viewed as they are."""
        if w.dim() != 3:
            raise ValueError(f"{name}: per-head weights must be [N, M, K], got {list(w.shape)}")
        fmt = dense_format(w.dtype)
        return cls([kernel_matrix(fmt, w[n], name=f"{name}[{n}]") for n in range(w.shape[0])])


def matmul_heads(heads: MatrixHeads, x: torch.Tensor, out: torch.Tensor | None = None, path: str = "auto",
                 out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Per-head matmuls on the kernels (blocking): out[t, n] = x[t, n] @ W_n^T, x [T, N, K] -> out [T, N, M].

    One pool dispatch over (heads, row block) tasks, computed in float32. x in float32 or bfloat16 goes to the kernels
    as it is, at any strides over tokens and heads with contiguous rows (a view of q's no-rope half of [T, N, P+R]);
    other dtypes through float32. `out`, when given, is written in place (float32 or bfloat16, rows contiguous, any
    non-overlapping strides over tokens and heads: e.g. the first L columns of [T, N, L+R]); else a new [T, N, M] of
    out_dtype (float32 or bfloat16; bfloat16 rounded to nearest even, as `.to(torch.bfloat16)` would).

    Legend: T tokens, N heads, K input features, M output features of each head's matrix."""
    if path not in PATHS:
        raise ValueError(f"path must be one of {PATHS}, got {path!r}")
    if x.dtype != torch.float32 and x.dtype != torch.bfloat16:
        x = x.float()
    if out is None:
        if out_dtype not in (torch.float32, torch.bfloat16):
            raise ValueError(f"out_dtype must be float32 or bfloat16, got {out_dtype}")
        out = torch.empty((x.shape[0], heads.heads, heads.rows), dtype=out_dtype)
    if x.shape[0]:
        _native.matmul_heads(heads._native, _dlpack(x), _dlpack(out), path)
    return out
