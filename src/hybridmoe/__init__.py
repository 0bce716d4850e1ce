"""hybridmoe: CPU-GPU hybrid inference for large Mixture-of-Experts language models."""

__version__ = "0.1.0"
