"""Python face of the C++ expert kernels (csrc/), and pure-torch float64 references for every op.

Modules:
  isa        which kernel ISA runs (scalar / avx2 / avx512, HYBRIDMOE_ISA forces one), CPU features, threads
  numa       NUMA nodes of the thread pool (detected or emulated); experts split over them by intermediate range
  formats    the weight formats (fp8 e4m3 block, int4/int8 per group, bf16): quantisers, exact dequantisers
  reference  float64 references of the kernels (matmul per format, the routed-expert MoE)
  weights    wrapping tensors (zero-copy) as kernel matrices, with format checks
  moe        FusedMoE: one layer's routed experts on the C++ kernels, submit/wait asynchronously; matmul (one
             projection) and matmul_heads (one matrix per head, MLA's absorbed kv_b_proj)
  attention  paged decode attention over the KV cache, read in place
  norm       RMSNorm, with the decoder's residual add fused in
  rope       rotary position embedding of a query or key tensor

Imports nothing of ours except hybridmoe.config.
"""

from __future__ import annotations

try:
    from hybridmoe.kernels import _native  # noqa: F401  (the compiled extension)
except ImportError as error:  # pragma: no cover - only when the package was not built
    raise ImportError(
        "hybridmoe's C++ kernels (hybridmoe.kernels._native) are not built; reinstall the package with "
        "`pip install --no-build-isolation -e .` (needs cmake, a C++17 compiler and nanobind)"
    ) from error
