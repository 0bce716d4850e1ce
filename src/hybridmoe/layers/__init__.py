"""Model building blocks: norms, rotary embeddings, attention (GQA, MLA) over a paged KV cache, MoE."""
