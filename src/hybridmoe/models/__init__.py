"""One module per supported architecture (DeepSeek-V3, Qwen3-MoE, Mixtral)."""
