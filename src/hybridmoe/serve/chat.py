"""POST /v1/chat/completions: the conversation rendered with the model's chat template, n choices, streamed
(`chat.completion.chunk` events: the role first, then content deltas, finish_reason on a choice's last chunk, usage
in a last chunk without choices when stream_options.include_usage) or gathered (`chat.completion`)."""

from __future__ import annotations

import time
import uuid

from jinja2 import TemplateError
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from hybridmoe.runtime.engine import RequestOutput
from hybridmoe.serve.errors import APIError
from hybridmoe.serve.generation import (ClientDisconnected, check_context, collect, merged, refused_as_400,
                                        chunk_template, stream_response, to_json, until_disconnected, usage)
from hybridmoe.serve.logprobs import TokenStrings, chat_logprobs
from hybridmoe.serve.protocol import ChatCompletionRequest, ChatMessage
from hybridmoe.serve.state import ServerState


def render_messages(tokenizer, messages: list[ChatMessage], add_generation_prompt: bool = True,
                    template_kwargs: dict | None = None) -> list[int]:
    """Token ids of the conversation in the model's chat template; 400 when it cannot be rendered."""
    conversation = [{"role": "system" if m.role == "developer" else m.role, "content": m.text()} for m in messages]
    try:
        return tokenizer.apply_chat_template(conversation, add_generation_prompt=add_generation_prompt,
                                             **(template_kwargs or {}))
    except (TemplateError, ValueError, TypeError) as error:
        raise APIError(400, f"the messages cannot be rendered with the model's chat template: {error}",
                       param="messages") from error


async def create_chat_completion(state: ServerState, body: ChatCompletionRequest, request: Request) -> Response:
    state.admit(body.model, body.n)
    unsupported = body.unsupported()
    if unsupported is not None:
        raise APIError(400, unsupported[1], param=unsupported[0])
    engine = state.engine
    prompt_ids = render_messages(engine.tokenizer, body.messages, body.add_generation_prompt,
                                 body.chat_template_kwargs)
    param = "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens"
    max_tokens = body.requested_max_tokens
    if max_tokens is None:  # as vLLM: whatever the context leaves
        max_tokens = max(1, engine.max_model_len - len(prompt_ids))
    check_context(len(prompt_ids), max_tokens, engine.max_model_len, param)
    try:
        logit_bias = body.token_bias(engine.tokenizer.vocab_size)
    except ValueError as error:
        raise APIError(400, str(error), param="logit_bias") from error
    try:
        params = [body.sampling_params(max_tokens, body.num_logprobs, choice=i, logit_bias=logit_bias)
                  for i in range(body.n)]
    except ValueError as error:
        raise APIError(400, str(error)) from error
    req_id = f"chatcmpl-{uuid.uuid4().hex}"
    created = int(time.time())
    outputs = merged(engine, [(prompt_ids, p) for p in params], req_id)
    model = state.settings.served_model_name
    if body.stream:
        include_usage = body.stream_options is not None and body.stream_options.include_usage
        fmt = _ChatStream(req_id, created, model, body.n, len(prompt_ids), include_usage,
                          state.token_strings if body.logprobs else None)
        return await refused_as_400(stream_response(request, outputs, fmt))
    try:
        choices = await refused_as_400(until_disconnected(request, collect(outputs, body.n)))
    except ClientDisconnected:
        return Response(status_code=499)
    completion_tokens = sum(len(c.token_ids) for c in choices)
    return JSONResponse({
        "id": req_id, "object": "chat.completion", "created": created, "model": model,
        "choices": [{
            "index": i, "message": {"role": "assistant", "content": c.text},
            "logprobs": {"content": chat_logprobs(c.logprobs, state.token_strings)} if body.logprobs else None,
            "finish_reason": c.finish_reason,
        } for i, c in enumerate(choices)],
        "usage": usage(len(prompt_ids), completion_tokens),
    })


class _ChatStream:
    def __init__(self, req_id: str, created: int, model: str, num_choices: int, num_prompt_tokens: int,
                 include_usage: bool, strings: TokenStrings | None):
        self._base = {"id": req_id, "object": "chat.completion.chunk", "created": created, "model": model}
        if include_usage:
            self._base["usage"] = None  # OpenAI: every chunk has it, null but in the last
        self._num_choices, self._num_prompt_tokens = num_choices, num_prompt_tokens
        self._include_usage, self._strings = include_usage, strings
        self._completion_tokens = 0
        self._head = chunk_template(self._base)

    def head(self) -> list[dict]:
        return [{**self._base, "choices": [{"index": i, "delta": {"role": "assistant", "content": ""},
                                            "logprobs": None, "finish_reason": None}]}
                for i in range(self._num_choices)]

    def chunk(self, index: int, out: RequestOutput) -> str | None:
        """The JSON of `{**base, "choices": [{"index", "delta", "logprobs", "finish_reason"}]}`, from the
        stream's constant head (no dict per chunk)."""
        if not out.new_text and not out.finished and not out.new_logprobs:
            return None  # a token that completes no character yet
        if out.finished:
            self._completion_tokens += len(out.token_ids)
        logprobs = "null"
        if self._strings is not None:
            logprobs = to_json({"content": chat_logprobs(out.new_logprobs or [], self._strings)})
        delta = '{"content":' + to_json(out.new_text) + "}" if out.new_text or not out.finished else "{}"
        finish_reason = to_json(out.finish_reason) if out.finished else "null"
        return f'{self._head}{index},"delta":{delta},"logprobs":{logprobs},"finish_reason":{finish_reason}}}]}}'


    def tail(self) -> list[dict]:
        if not self._include_usage:
            return []
        return [{**self._base, "choices": [], "usage": usage(self._num_prompt_tokens, self._completion_tokens)}]
