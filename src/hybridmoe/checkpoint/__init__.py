"""Model checkpoints: memory-mapped safetensors, weight formats (FP8 block scales), synthetic models."""
