"""POST /v1/completions (OpenAI's legacy completions): prompts as a string, strings, token ids or lists of token
ids, n choices each (choice index = prompt index * n + choice), echo, and logprobs in the legacy shape. With echo and
logprobs the prompt's tokens are scored too (the first has none), so evaluation harnesses that score a text
(lm-evaluation-harness's local-completions) work; max_tokens 0 with echo scores the prompt alone."""

from __future__ import annotations

import time
import uuid

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from hybridmoe.runtime.engine import RequestOutput
from hybridmoe.serve.errors import APIError
from hybridmoe.serve.generation import (ClientDisconnected, check_context, collect, merged, refused_as_400,
                                        chunk_template, stream_response, to_json, until_disconnected, usage)
from hybridmoe.serve.logprobs import TokenStrings, completion_logprobs, merge_completion_logprobs
from hybridmoe.serve.protocol import CompletionRequest
from hybridmoe.serve.state import ServerState


async def create_completion(state: ServerState, body: CompletionRequest, request: Request) -> Response:
    prompts = body.prompts()
    state.admit(body.model, len(prompts) * body.n)
    unsupported = body.unsupported()
    if unsupported is not None:
        raise APIError(400, unsupported[1], param=unsupported[0])
    if not prompts or any(len(p) == 0 for p in prompts):
        raise APIError(400, "prompt must not be empty", param="prompt")
    engine = state.engine
    tokenizer = engine.tokenizer
    prompt_ids = [tokenizer.encode(p) if isinstance(p, str) else list(p) for p in prompts]
    requested = 16 if body.max_tokens is None else body.max_tokens
    max_tokens = max(requested, 1)  # max_tokens 0 (echo only): one token is generated and dropped
    for ids in prompt_ids:
        check_context(len(ids), requested, engine.max_model_len)
    prompt_logprobs = body.logprobs if body.echo else None
    try:
        logit_bias = body.token_bias(tokenizer.vocab_size)
    except ValueError as error:
        raise APIError(400, str(error), param="logit_bias") from error
    try:
        jobs = [(ids, body.sampling_params(max_tokens, body.logprobs, prompt_logprobs, choice=c,
                                           logit_bias=logit_bias))
                for ids in prompt_ids for c in range(body.n)]
    except ValueError as error:
        raise APIError(400, str(error)) from error
    req_id = f"cmpl-{uuid.uuid4().hex}"
    created = int(time.time())
    model = state.settings.served_model_name
    echoes = [_prompt_text(p, ids, tokenizer) if body.echo else "" for p, ids in zip(prompts, prompt_ids)]
    outputs = merged(engine, jobs, req_id)
    num_prompt_tokens = sum(len(ids) for ids in prompt_ids)
    if body.stream:
        include_usage = body.stream_options is not None and body.stream_options.include_usage
        fmt = _CompletionStream(req_id, created, model, body.n, echoes, num_prompt_tokens, include_usage,
                                state.token_strings if body.logprobs is not None else None, requested == 0)
        return await refused_as_400(stream_response(request, outputs, fmt))
    try:
        choices = await refused_as_400(until_disconnected(request, collect(outputs, len(jobs))))
    except ClientDisconnected:
        return Response(status_code=499)
    result = []
    for i, c in enumerate(choices):
        echo = echoes[i // body.n]
        kept = 0 if requested == 0 else len(c.token_ids)
        logprobs = None
        if body.logprobs is not None:
            parts = []
            if body.echo:
                parts.append(completion_logprobs(c.prompt_logprobs or [], c.prompt_token_ids, state.token_strings))
            parts.append(completion_logprobs(c.logprobs[:kept], c.token_ids[:kept], state.token_strings,
                                             len(echo)))
            logprobs = merge_completion_logprobs(parts)
        result.append({"index": i, "text": echo + (c.text if kept else ""), "logprobs": logprobs,
                       "finish_reason": c.finish_reason if kept else "length"})
    completion_tokens = sum(len(c.token_ids) for c in choices) if requested else 0
    return JSONResponse({"id": req_id, "object": "text_completion", "created": created, "model": model,
                         "choices": result, "usage": usage(num_prompt_tokens, completion_tokens)})


def _prompt_text(prompt: str | list[int], ids: list[int], tokenizer) -> str:
    return prompt if isinstance(prompt, str) else tokenizer.decode(ids, skip_special_tokens=False)


class _CompletionStream:
    def __init__(self, req_id: str, created: int, model: str, n: int, echoes: list[str], num_prompt_tokens: int,
                 include_usage: bool, strings: TokenStrings | None, echo_only: bool):
        self._base = {"id": req_id, "object": "text_completion", "created": created, "model": model}
        if include_usage:
            self._base["usage"] = None
        self._n, self._echoes, self._num_prompt_tokens = n, echoes, num_prompt_tokens
        self._include_usage, self._strings, self._echo_only = include_usage, strings, echo_only
        self._started: set[int] = set()
        self._offsets: dict[int, int] = {}
        self._completion_tokens = 0
        self._head = chunk_template(self._base)

    def head(self) -> list[dict]:
        return []

    def chunk(self, index: int, out: RequestOutput) -> str | None:
        """The JSON of `{**base, "choices": [{"index", "text", "logprobs", "finish_reason"}]}`, from the stream's
        constant head (no dict per chunk)."""
        text, parts = "", []
        if index not in self._started:  # the echo goes first, with the prompt's logprobs
            self._started.add(index)
            text = self._echoes[index // self._n]
            self._offsets[index] = len(text)
            if self._strings is not None and text and out.prompt_logprobs is not None:
                parts.append(completion_logprobs(out.prompt_logprobs, out.prompt_token_ids, self._strings))
        if not self._echo_only:
            text += out.new_text
            if self._strings is not None and out.new_logprobs:
                parts.append(completion_logprobs(out.new_logprobs, out.new_token_ids, self._strings,
                                                 self._offsets[index]))
            self._offsets[index] += len(out.new_text)
            if out.finished:
                self._completion_tokens += len(out.token_ids)
        if not text and not parts and not out.finished:
            return None
        logprobs = to_json(merge_completion_logprobs(parts)) if self._strings is not None else "null"
        finish_reason = to_json("length" if self._echo_only else out.finish_reason) if out.finished else "null"
        return (f'{self._head}{index},"text":{to_json(text)},"logprobs":{logprobs},'
                f'"finish_reason":{finish_reason}}}]}}')

    def tail(self) -> list[dict]:
        if not self._include_usage:
            return []
        return [{**self._base, "choices": [], "usage": usage(self._num_prompt_tokens, self._completion_tokens)}]
