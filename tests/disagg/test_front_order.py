"""The PD front reads each worker on a thread of its own, so it may see the decode worker's refusal of a streamed
prompt's KV before the prefill worker's answer for that prompt. Here the two workers' messages are played to the
front's readers in that order (no processes): a prompt that ended at its first token keeps it; one the prefill
worker stopped because of the refusal, or whose handoff comes after it, ends with the decode worker's error."""

from __future__ import annotations

import asyncio

from hybridmoe.disagg import messages as m
from hybridmoe.disagg.engine import DECODE, PREFILL, PDEngine
from hybridmoe.disagg.handoff import PackedKV
from hybridmoe.runtime.engine import RequestOutput
from hybridmoe.runtime.sampling_params import SamplingParams

PROMPT = [5, 17, 33]
PARAMS = SamplingParams(temperature=0.0, max_tokens=1)
REFUSAL = "the decode worker refused the KV handoff: no segment"


class _Replay:
    """A worker's end of the socket that gives the front the messages it is handed, then reports it closed."""

    def __init__(self, messages):
        self.messages = list(messages)

    def recv(self):
        if not self.messages:
            raise EOFError
        return self.messages.pop(0)


def _front(monkeypatch) -> PDEngine:
    engine = PDEngine("unused")
    for event in engine._first_ready.values():  # as if both workers were up (their slots not ready: sends queue)
        event.set()
    monkeypatch.setattr("hybridmoe.disagg.engine.remove", lambda name: None)  # no segments exist here
    return engine


def _kv(name: str) -> PackedKV:
    return PackedKV(name, len(PROMPT), 0, 1.0)


def _output(req_id: str, finished: bool, reason: str | None) -> RequestOutput:
    return RequestOutput(req_id, PROMPT, [202], "x", new_token_ids=[202], finished=finished, finish_reason=reason)


async def _request(engine: PDEngine, play) -> list[RequestOutput]:
    """Start one request, play the workers' messages (play(req_id) -> [(role, messages), ...]), collect its
    outputs."""
    outputs, gen = [], engine.generate(PROMPT, PARAMS, req_id="r")
    first = asyncio.ensure_future(gen.__anext__())
    await asyncio.sleep(0)  # the request is registered with the front
    for role, messages in play("r"):
        engine._read(role, _Replay(messages))
    outputs.append(await first)
    async for out in gen:
        outputs.append(out)
    return outputs


def test_a_prompt_that_ended_at_its_first_token_keeps_it_after_a_refusal(monkeypatch):
    engine = _front(monkeypatch)
    outs = asyncio.run(_request(engine, lambda r: [
        (PREFILL, [m.KVStream(r, PROMPT, PARAMS, _kv("s"))]),
        (DECODE, [m.Failed([r], REFUSAL)]),  # the prefill worker had already given the segment up
        (PREFILL, [m.Outputs([_output(r, True, "length")], None)]),
    ]))
    assert [(o.token_ids, o.finish_reason, o.error) for o in outs] == [([202], "length", None)]
    assert engine.num_unfinished_requests == 0
    assert [type(msg) for msg in engine._slots[PREFILL].backlog] == [m.Add, m.Abort]


def test_a_prompt_stopped_because_of_a_refusal_ends_with_the_decode_workers_error(monkeypatch):
    engine = _front(monkeypatch)
    outs = asyncio.run(_request(engine, lambda r: [
        (PREFILL, [m.KVStream(r, PROMPT, PARAMS, _kv("s"))]),
        (DECODE, [m.Failed([r], REFUSAL)]),
        (PREFILL, [m.Outputs([RequestOutput(r, PROMPT, [], "", finished=True, finish_reason="abort")], None)]),
    ]))
    assert [(o.finish_reason, o.error) for o in outs] == [("error", REFUSAL)]
    assert engine.num_unfinished_requests == 0


def test_a_handoff_after_a_refusal_ends_the_request_with_the_error(monkeypatch):
    engine = _front(monkeypatch)
    outs = asyncio.run(_request(engine, lambda r: [
        (PREFILL, [m.KVStream(r, PROMPT, PARAMS, _kv("s"))]),
        (DECODE, [m.Failed([r], REFUSAL)]),
        (PREFILL, [m.Outputs([_output(r, False, None)], None), m.Handoff(r, PROMPT, PARAMS, 202, _kv("s"), None)]),
    ]))
    assert sum((o.new_token_ids for o in outs), []) == [202]  # the first token reached the caller
    assert (outs[-1].finished, outs[-1].finish_reason, outs[-1].error) == (True, "error", REFUSAL)
    assert engine.num_unfinished_requests == 0
    assert not any(isinstance(msg, m.Adopt) for msg in engine._slots[DECODE].backlog)  # never moved there
