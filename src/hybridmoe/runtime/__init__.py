"""Request lifecycle: sampling, tokenizer, KV blocks, scheduler, model runner, engine."""
