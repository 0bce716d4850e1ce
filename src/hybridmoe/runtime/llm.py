"""The offline Python API: `LLM(model).generate(prompts, sampling_params)`, `.chat(messages)`, and `.stream(prompt)`
(a synchronous iterator over one request's outputs as they are produced)."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from hybridmoe.runtime.engine import EngineConfig, LLMEngine, RequestOutput
from hybridmoe.runtime.logprobs import TokenLogprobs
from hybridmoe.runtime.sampling_params import SamplingParams

Message = dict[str, str]


@dataclass
class GenerationResult:
    prompt_token_ids: list[int]
    token_ids: list[int]  # the generated ids
    text: str
    finish_reason: str | None  # "stop" | "length" | "error" (the request could not be served, or failed)
    error: str | None = None
    logprobs: list[TokenLogprobs] | None = None  # per generated token, when SamplingParams.logprobs is set
    prompt_logprobs: list[TokenLogprobs | None] | None = None  # when SamplingParams.prompt_logprobs is set


class LLM:
    def __init__(self, model: str | Path, dtype: str = "auto", **engine_options):
        """model: a local Hugging Face model directory, or `demo` (the embedded demo model). engine_options: the
        fields of EngineConfig (block_size, kv_cache_gb, kv_cache_dtype, max_num_seqs, max_num_batched_tokens, max_model_len,
        expert_backend, enable_prefix_caching; and where it runs, docs/hybrid.md: device="auto"|"cpu"|"cuda",
        vram="24GB"|None, num_gpus=1, stream_prefill="auto"|"on"|"off", plan=None|path, routing=None|path,
        verbose, overlap="auto"|"on"|"off": dual-batch overlap of decode steps)."""
        self.engine = LLMEngine(model, EngineConfig(dtype=dtype, **engine_options))
        self.tokenizer = self.engine.tokenizer

    def close(self) -> None:
        """Stop the expert-parallel worker ranks (num_gpus > 1) and free stream-loading prefill's device slots."""
        self.engine.close()

    def generate(self, prompts: str | list[int] | Sequence[str | list[int]],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None) -> list[GenerationResult]:
        """One result per prompt (a string or a list of token ids), in order; all prompts run batched. A prompt
        that cannot be served (too long for the context, empty, ids outside the vocabulary) fails alone: its
        result has finish_reason "error" and the reason in `error`, and the other prompts run."""
        if isinstance(prompts, str) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        params = sampling_params if isinstance(sampling_params, Sequence) else [sampling_params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"got {len(params)} sampling_params for {len(prompts)} prompts")
        slots: list[str | GenerationResult] = []  # per prompt: its request id, or the result of a refused one
        for prompt, p in zip(prompts, params):
            try:
                slots.append(self.engine.add_request(prompt, p or SamplingParams()))
            except ValueError as error:
                slots.append(GenerationResult(self._prompt_ids(prompt), [], "", "error", str(error)))
        results, logprobs = {}, {slot: [] for slot in slots if isinstance(slot, str)}
        while self.engine.has_unfinished_requests():
            for out in self.engine.step():
                if out.new_logprobs is not None and out.req_id in logprobs:
                    logprobs[out.req_id] += out.new_logprobs
                if out.finished:
                    results[out.req_id] = GenerationResult(
                        out.prompt_token_ids, out.token_ids, out.text, out.finish_reason, out.error,
                        logprobs[out.req_id] if out.new_logprobs is not None else None, out.prompt_logprobs)
        return [results[slot] if isinstance(slot, str) else slot for slot in slots]

    def stream(self, prompt: str | list[int], sampling_params: SamplingParams | None = None) -> Iterator[RequestOutput]:
        """Run one prompt, yielding a RequestOutput each time it produces tokens (new_text, new_token_ids) and a
        last one with finished=True. Raises ValueError at once when the prompt cannot be served. Leaving the loop
        early aborts the request."""
        req_id = self.engine.add_request(prompt, sampling_params or SamplingParams())
        finished = False
        try:
            while not finished:
                for out in self.engine.step():
                    if out.req_id == req_id:
                        finished = out.finished
                        yield out
        finally:
            if not finished:
                self.engine.abort_request(req_id)
                while self.engine.has_unfinished_requests():  # report the abort, so the engine holds nothing of it
                    self.engine.step()

    def chat(self, messages: list[Message] | Sequence[list[Message]],
             sampling_params: SamplingParams | None = None) -> list[GenerationResult]:
        """Apply the model's chat template to one conversation (or several) and generate the replies."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        prompts = [self.tokenizer.apply_chat_template(c, add_generation_prompt=True) for c in conversations]
        return self.generate(prompts, sampling_params)

    def _prompt_ids(self, prompt: str | list[int]) -> list[int]:
        """The token ids of a refused prompt, as far as they can be read."""
        if isinstance(prompt, str):
            return self.tokenizer.encode(prompt)
        return list(prompt)
