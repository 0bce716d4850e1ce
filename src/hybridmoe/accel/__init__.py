"""The accelerator abstraction: CUDA when present, else the CPU standing in for it through the same calls."""
