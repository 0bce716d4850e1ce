"""The offline Python API: `LLM(model_dir).generate(prompts, sampling_params)` and `.chat(messages)`."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from hybridmoe.runtime.engine import EngineConfig, LLMEngine
from hybridmoe.runtime.sampling_params import SamplingParams

Message = dict[str, str]


@dataclass
class GenerationResult:
    prompt_token_ids: list[int]
    token_ids: list[int]  # the generated ids
    text: str
    finish_reason: str | None
    error: str | None = None


class LLM:
    def __init__(self, model_dir: str | Path, dtype: str = "auto", **engine_options):
        self.engine = LLMEngine(model_dir, EngineConfig(dtype=dtype, **engine_options))
        self.tokenizer = self.engine.tokenizer

    def generate(self, prompts: str | list[int] | Sequence[str | list[int]],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None) -> list[GenerationResult]:
        """One result per prompt (a string or a list of token ids), in order; all prompts run batched."""
        if isinstance(prompts, str) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        params = sampling_params if isinstance(sampling_params, Sequence) else [sampling_params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"got {len(params)} sampling_params for {len(prompts)} prompts")
        req_ids = []
        try:
            for prompt, p in zip(prompts, params):
                req_ids.append(self.engine.add_request(prompt, p or SamplingParams()))
        except ValueError:
            for req_id in req_ids:
                self.engine.abort_request(req_id)
            self._drain()
            raise
        results = {}
        while self.engine.has_unfinished_requests():
            for out in self.engine.step():
                if out.finished:
                    results[out.req_id] = GenerationResult(out.prompt_token_ids, out.token_ids, out.text,
                                                           out.finish_reason, out.error)
        return [results[r] for r in req_ids]

    def chat(self, messages: list[Message] | Sequence[list[Message]],
             sampling_params: SamplingParams | None = None) -> list[GenerationResult]:
        """Apply the model's chat template to one conversation (or several) and generate the replies."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        prompts = [self.tokenizer.apply_chat_template(c, add_generation_prompt=True) for c in conversations]
        return self.generate(prompts, sampling_params)

    def _drain(self) -> None:
        while self.engine.has_unfinished_requests():
            self.engine.step()
