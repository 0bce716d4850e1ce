"""Tests for hybridmoe.runtime (request-side pieces: sampling, tokenizer, detokenizer, scheduler)."""
