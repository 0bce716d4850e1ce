"""One streamed request to an OpenAI-compatible server, timed: `stream_request` fills in its RequestRecord.

The request asks for `stream: true` and `stream_options.include_usage`, as OpenAI's API defines them: the reply is
server-sent events, `data: {chunk}` lines ending with `data: [DONE]`, and a last chunk with `usage` (no choices).
A chat chunk carries text in `choices[0].delta.content` (the first one often only the role), a completion chunk
in `choices[0].text`.

Timings: TTFT is the time from sending to the first chunk carrying output: text, or the finish_reason of a reply
that ended at its first token with no text. The last output time is that of the last chunk carrying text or a
finish_reason, since the finish of a reply that stops at its end-of-sequence token comes in a chunk of its own,
after the step that sampled that token. TPOT is (last - first) / (output tokens - 1), the mean time per token
after the first; the output tokens are the server's `usage.completion_tokens` (a chunk may carry more than one
token, or none while text is held back), or the text chunks where a server sends no usage.
"""

from __future__ import annotations

import json
import time

import httpx

from hybridmoe.bench._serving.records import RequestRecord
from hybridmoe.bench._serving.workload import CHAT, RequestPlan

ERROR_BODY_CHARS = 300  # of an error reply kept in the record


def _chunk_text(chunk: dict, chat: bool) -> tuple[str, str | None]:
    """A chunk's output text and finish_reason (choice 0; bench serve asks for one choice)."""
    choices = chunk.get("choices") or []
    if not choices:
        return "", None
    choice = choices[0]
    text = (choice.get("delta") or {}).get("content") if chat else choice.get("text")
    return text or "", choice.get("finish_reason")


async def stream_request(client: httpx.AsyncClient, plan: RequestPlan, model: str, record: RequestRecord,
                         clock_zero: float) -> str | None:
    """Send `plan` and time its stream into `record` (status ok or error). Returns the output text, None if the
    request failed."""
    chat = plan.endpoint == CHAT
    body = {**plan.body, "model": model, "stream": True, "stream_options": {"include_usage": True}}
    start = time.perf_counter()
    record.start_s = start - clock_zero
    first = last = None
    parts: list[str] = []
    text_chunks = 0
    usage = None
    done = False
    try:
        async with client.stream("POST", plan.endpoint, json=body) as response:
            if response.status_code != 200:
                detail = (await response.aread()).decode(errors="replace")[:ERROR_BODY_CHARS]
                return _failed(record, f"HTTP {response.status_code}: {detail}")
            async for line in response.aiter_lines():
                if not line.startswith("data:"):  # blank lines between events, comments, event names
                    continue
                data = line[len("data:"):].strip()
                if data == "[DONE]":
                    done = True
                    break
                chunk = json.loads(data)
                if "error" in chunk:  # an error after the stream began comes as a chunk of its own
                    return _failed(record, f"error in stream: {json.dumps(chunk['error'])[:ERROR_BODY_CHARS]}")
                usage = chunk.get("usage") or usage
                text, finish = _chunk_text(chunk, chat)
                if text or finish:
                    last = time.perf_counter()
                    first = first or last
                if text:
                    parts.append(text)
                    text_chunks += 1
                if finish:
                    record.finish_reason = finish
    except (httpx.HTTPError, json.JSONDecodeError) as error:
        return _failed(record, f"{type(error).__name__}: {error}")
    end = time.perf_counter()
    if not done or first is None:
        return _failed(record, "the stream ended before " + ("data: [DONE]" if not done else "any output"))
    record.status = "ok"
    record.e2e_s = end - start
    record.ttft_s = first - start
    record.prompt_tokens = usage.get("prompt_tokens") if usage else None
    record.output_tokens = usage.get("completion_tokens", text_chunks) if usage else text_chunks
    if record.output_tokens >= 2:
        record.tpot_s = (last - first) / (record.output_tokens - 1)
    return "".join(parts)


def _failed(record: RequestRecord, error: str) -> None:
    record.status = "error"
    record.error = error
    return None
