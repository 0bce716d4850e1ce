"""Running a response's requests: n choices (and prompts) started together and read as one stream, the context
check, the race against a client that disconnects, and the two ways a response is written: gathered (`collect`)
or as server-sent events (`stream_response` with an endpoint's `StreamFormat`).

`merged(engine, jobs)` yields (choice index, RequestOutput) as outputs arrive; closing it (the handler is done, or
cancelled because the client left) aborts every request still running. `until_disconnected(request, awaitable)`
awaits the work unless the client disconnects first, which cancels it (and so aborts its requests).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Protocol

from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from hybridmoe.runtime.engine import RequestOutput
from hybridmoe.runtime.logprobs import TokenLogprobs
from hybridmoe.runtime.sampling_params import SamplingParams
from hybridmoe.serve.engine_client import EngineClient
from hybridmoe.serve.errors import APIError, error_body


class ClientDisconnected(Exception):
    """The client went away before the response was ready; its requests were aborted."""


def check_context(num_prompt_tokens: int, max_tokens: int, max_model_len: int, param: str = "max_tokens") -> None:
    """400 naming both numbers when the prompt plus max_tokens exceed the context."""
    if num_prompt_tokens + max_tokens > max_model_len:
        raise APIError(400, f"This model's maximum context length is {max_model_len} tokens. However, you "
                            f"requested {num_prompt_tokens + max_tokens} tokens ({num_prompt_tokens} in the prompt, "
                            f"{max_tokens} for the completion). Please reduce the prompt or {param}.",
                       param=param, code="context_length_exceeded")


async def refused_as_400(awaitable):
    """The awaitable's result; a ValueError (the engine refused the request) becomes a 400 with its message."""
    try:
        return await awaitable
    except ValueError as error:
        raise APIError(400, str(error)) from error


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


async def merged(engine: EngineClient, jobs: list[tuple[list[int], SamplingParams]],
                 req_id: str) -> AsyncIterator[list[tuple[int, RequestOutput]]]:
    """Start every (prompt ids, params) job as request f"{req_id}-{index}" and yield the (index, output) pairs
    that are ready, a list at a time (one write for a streamed response). A refused job raises its ValueError;
    leaving early aborts the jobs still running."""
    if len(jobs) == 1:  # the common case, without a task per job (the engine merges the outputs that wait)
        prompt, params = jobs[0]
        stream = engine.generate(prompt, params, f"{req_id}-0")
        try:
            async for out in stream:
                yield [(0, out)]
        finally:
            await stream.aclose()
        return

    inbox: asyncio.Queue = asyncio.Queue()

    async def pump(index: int, prompt: list[int], params: SamplingParams) -> None:
        try:
            async for out in engine.generate(prompt, params, f"{req_id}-{index}"):
                inbox.put_nowait((index, out))
        except Exception as error:  # refused or failed: the reader raises it
            inbox.put_nowait((index, error))

    tasks = [asyncio.create_task(pump(i, prompt, params)) for i, (prompt, params) in enumerate(jobs)]
    try:
        remaining = len(jobs)
        while remaining:
            batch = [await inbox.get()]
            while not inbox.empty():
                batch.append(inbox.get_nowait())
            for index, item in batch:
                if isinstance(item, Exception):
                    raise item
                remaining -= item.finished
            yield batch
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def until_disconnected(request: Request, awaitable):
    """The awaitable's result; ClientDisconnected (the work cancelled) when the client disconnects first."""
    work = asyncio.ensure_future(awaitable)
    watch = asyncio.create_task(_disconnect(request))
    try:
        await asyncio.wait({work, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:  # also when this handler is cancelled itself
        watch.cancel()
        if not work.done():
            work.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await work
    if work.cancelled():
        raise ClientDisconnected()
    return work.result()


async def _disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


@dataclass
class Choice:
    """One choice's result, gathered from its outputs."""

    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    prompt_token_ids: list[int] = field(default_factory=list)
    prompt_logprobs: list[TokenLogprobs | None] | None = None
    finish_reason: str | None = None
    error: str | None = None


async def collect(outputs: AsyncIterator[list[tuple[int, RequestOutput]]], num_choices: int) -> list[Choice]:
    """Read merged outputs to the end; a failed request (finish_reason "error") is a 500."""
    choices = [Choice() for _ in range(num_choices)]
    async for batch in outputs:
        for index, out in batch:
            _gather(choices[index], out)
    return choices


def _gather(choice: Choice, out: RequestOutput) -> None:
    if out.new_logprobs:
        choice.logprobs += out.new_logprobs
    if out.finished:
        if out.finish_reason == "error":
            raise APIError(500, f"generation failed: {out.error}")
        choice.text, choice.token_ids, choice.finish_reason = out.text, out.token_ids, out.finish_reason
        choice.prompt_token_ids, choice.prompt_logprobs = out.prompt_token_ids, out.prompt_logprobs


class StreamFormat(Protocol):
    """How one endpoint writes its server-sent events."""

    def head(self) -> list[dict]: ...  # chunks before the first output

    def chunk(self, index: int, out: RequestOutput) -> str | None: ...  # the chunk's JSON; None: nothing to send

    def tail(self) -> list[dict]: ...  # chunks after the last output (usage)


async def stream_response(request: Request, outputs: AsyncIterator[list[tuple[int, RequestOutput]]],
                          fmt: StreamFormat) -> Response:
    """Server-sent events: `data: {chunk}` lines, then `data: [DONE]`. Waits for the first output before the
    response starts, so that a refused request is still an HTTP error. A request that fails midway sends an
    error event (OpenAI's error shape) before [DONE]. The events of the outputs ready together go out in one
    write; an output that carries several tokens (the client read slower than the engine produced) is one chunk."""
    try:
        first = await until_disconnected(request, anext(outputs))
    except ClientDisconnected:
        return Response(status_code=499)

    async def events():
        try:
            head = "".join(_event(data) for data in fmt.head())
            batch = first
            while True:
                parts = [head] if head else []
                head = ""
                for index, out in batch:
                    if out.finish_reason == "error":
                        parts.append(_event(error_body(500, f"generation failed: {out.error}")))
                        parts.append("data: [DONE]\n\n")
                        yield "".join(parts).encode()
                        return
                    data = fmt.chunk(index, out)
                    if data is not None:
                        parts.append(f"data: {data}\n\n")
                if parts:
                    yield "".join(parts).encode()
                try:
                    batch = await anext(outputs)
                except StopAsyncIteration:
                    break
            tail = "".join(_event(data) for data in fmt.tail())
            if tail:
                yield tail.encode()
        except Exception as error:  # the engine failed outside a step's model run
            yield _event(error_body(500, f"generation failed: {error}")).encode()
        finally:
            await outputs.aclose()
        yield b"data: [DONE]\n\n"

    return StreamingResponse(events(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})


# Compact JSON as the chunks are written (ensure_ascii off: the text as UTF-8); a str alone takes the encoder's
# C fast path, which the chunk templates below use for the text of each chunk.
to_json = json.JSONEncoder(ensure_ascii=False, separators=(",", ":")).encode


def _event(data: dict) -> str:
    return f"data: {to_json(data)}\n\n"


def chunk_template(base: dict) -> str:
    """The JSON of `{**base, "choices": [{"index": ` (a chunk of one choice starts so): the constant head of a
    stream's chunks, which the formats complete with the index and the choice's fields, byte for byte what
    to_json of the whole chunk gives."""
    return to_json(base)[:-1] + ',"choices":[{"index":'
