"""hybridmoe: CPU-GPU hybrid inference for large Mixture-of-Experts language models.

`from hybridmoe import LLM, SamplingParams` is the Python API; the heavy imports happen on first use.
"""

__version__ = "0.1.0"
__all__ = ["LLM", "SamplingParams"]


def __getattr__(name: str):
    if name == "LLM":
        from hybridmoe.runtime.llm import LLM

        return LLM
    if name == "SamplingParams":
        from hybridmoe.runtime.sampling_params import SamplingParams

        return SamplingParams
    raise AttributeError(f"module 'hybridmoe' has no attribute {name!r}")
