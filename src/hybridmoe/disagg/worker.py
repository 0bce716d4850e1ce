"""A worker process of prefill/decode disaggregation: one `LLMEngine` driven by messages from the front.

The prefill worker takes new requests (`Add`) and prefills them. It packs each prompt's KV into a shared-memory
segment under its `KVPolicy` (handoff.py: below budget 1 its engine scores each prompt's attention importance during
the prefill, unless position importance is asked for, and the ladder follows the model's cached INT4 probe
verdict). Where the tiers are known before the forward (budget 1, or position importance) the KV streams: in the
step that completes the prompt, each layer is written into the segment as soon as the forward has computed it
(`LLMEngine.set_prompt_kv_observer`), and a `KVStream` at the first layer tells the decode worker, which unpacks
the layers as they come between its own steps (`Init.kv_streaming` False: no streaming). With attention
importance the ranking needs every layer's attention, so the KV is packed after the step. After the step that
samples the first token (reported as a normal output), the prefill worker forgets the request
(`LLMEngine.detach_request`: its blocks are freed, full ones stay in its prefix cache) and sends a `Handoff` with
that token. A request that ends with its first token (EOS, max_tokens 1, a stop string) ends here.
The decode worker adopts each handed-off request: a streamed one into KV blocks it reserved at the `KVStream`
(`LLMEngine.reserve_adoption`, `complete_adoption` once every layer is in and the first token has come), another
at its `Adopt` (`LLMEngine.adopt_request`, unpacking the payload into its own cache); the dropped tokens become the
request's mask of dropped keys. It waits while its KV blocks are full, and decodes each request to the end.

Both load the model with `SharedWeights` (disagg/shared_weights.py): what the loader makes at load (weights in
another dtype) is made once, in a shared-memory segment, by the first to load; the other maps it.

Both run the same loop: wait for messages when idle, apply them between steps, step, send the outputs. A worker
whose front is gone (its socket closed: the front crashed) removes the front's shared-memory segments and exits.
Workers run in a session of their own and ignore SIGINT: a Ctrl-C in the server's terminal is the front's to
handle (it stops them in order), not a crash of each worker.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import os
import signal
import sys
from collections import deque
from dataclasses import dataclass
from multiprocessing.connection import Connection

import torch

from hybridmoe.disagg import handoff, messages as m, shared_weights
from hybridmoe.disagg.cpus import pin_to
from hybridmoe.disagg.shm import remove, sweep
from hybridmoe.kv.layout import KVLayout
from hybridmoe.models.loader import resolve_dtype
from hybridmoe.runtime.engine import EngineConfig, LLMEngine, RequestOutput

PREFILL, DECODE = "prefill", "decode"
STREAM_POLL_S = 0.001  # how often a decode worker with nothing to step looks for newly written layers


@dataclass
class _Outgoing:
    """A prompt's KV the prefill worker is writing layer by layer during the step that completes it."""

    writer: handoff.LayerWriter
    slots: torch.Tensor


@dataclass
class _Incoming:
    """A streamed prompt at the decode worker: waiting for KV blocks (reader None), then unpacked as its layers
    come; `final` is its Adopt (the first token) once that has come."""

    stream: m.KVStream
    reader: handoff.LayerReader | None = None
    final: m.Adopt | None = None


def main(argv: list[str] | None = None) -> None:
    """`python -m hybridmoe.disagg.worker --fd N`: N is this end of a socket pair to the front, which first sends
    an `Init` (a plain subprocess: nothing of the front's script is re-imported, unlike multiprocessing's spawn)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    parser = argparse.ArgumentParser()
    parser.add_argument("--fd", type=int, required=True)
    args = parser.parse_args(argv)
    conn = Connection(args.fd)
    try:
        init = conn.recv()
    except EOFError:
        return
    if init.cpus is not None:
        pin_to(init.cpus)
    run_worker(init.role, conn, init.model, init.config, init.prefix, init.kv_budget, init.kv_importance,
               init.kv_streaming)


def run_worker(role: str, conn, model: str, config: EngineConfig, prefix: str, kv_budget: float,
               kv_importance: str = "attention", kv_streaming: bool = True) -> None:
    """A worker's life: load, say Ready, serve messages until Stop or until the front is gone."""
    try:
        with _shared_weights(prefix, model, config) as weights:
            engine = LLMEngine(model, config, show_progress=False, transformed=weights)
        # the prefill worker packs: its policy reads the probe's verdict (and says once when there is none)
        policy = handoff.kv_policy(model, kv_budget, kv_importance) if role == PREFILL else None
    except BaseException as error:  # noqa: BLE001 - reported to the front, which decides
        try:
            conn.send(m.LoadFailed(f"{type(error).__name__}: {error}"))
        except OSError:  # the front died meanwhile: clean up after it
            sweep(prefix)
        return
    worker = _Worker(role, conn, engine, prefix, policy, kv_streaming)
    parent_gone = False
    try:
        conn.send(m.Ready(os.getpid(), engine.max_model_len, engine.stats()))
        worker.loop()
    except (EOFError, BrokenPipeError, ConnectionResetError):
        parent_gone = True
    finally:
        engine.close()
        if parent_gone:
            sweep(prefix)


def _shared_weights(prefix: str, model: str, config: EngineConfig):
    """The weights the loader makes, in the segment both workers map (none with HYBRIDMOE_PD_SHARED_WEIGHTS=0)."""
    if not shared_weights.enabled():
        return contextlib.nullcontext(None)
    return shared_weights.SharedWeights(prefix, model, resolve_dtype(config.dtype))


class _Worker:
    def __init__(self, role: str, conn, engine: LLMEngine, prefix: str, policy: handoff.KVPolicy | None,
                 streaming: bool = True):
        self.role, self.conn, self.engine, self.prefix = role, conn, engine, prefix
        self.policy = policy  # the prefill worker's handoff policy
        if policy is not None and policy.wants_attention_importance:
            engine.set_prompt_importance(True)
        self.identity = handoff.model_identity(engine.model_config)
        self.layout = KVLayout.from_config(engine.model_config)
        self.block_size = engine.config.block_size
        self.params: dict = {}  # req_id -> SamplingParams of the requests in this engine
        self.pending: deque[m.Adopt] = deque()  # handed-off requests waiting for KV blocks
        self.names = itertools.count()
        self.outgoing: dict[str, _Outgoing] = {}  # prefill: prompts whose KV this step writes layer by layer
        self.stream_errors: dict[str, str] = {}  # prefill: why a prompt's streamed KV could not be written
        self.incoming: dict[str, _Incoming] = {}  # decode: streamed prompts, in arrival order
        if role == PREFILL and policy is not None and policy.streams and streaming:
            engine.set_prompt_kv_observer(self.stream_layer)

    def loop(self) -> None:
        engine = self.engine
        while True:
            if not engine.has_unfinished_requests():  # nothing to step: wait for a message (or for KV layers)
                self.conn.poll(STREAM_POLL_S if self.pending or self.incoming else None)
            while self.conn.poll(0):
                if self.handle(self.conn.recv()):
                    return
            self.adopt_pending()
            self.advance_streams()
            if not engine.has_unfinished_requests():
                continue
            try:
                outputs = engine.step()
            except Exception as error:  # outside the model run (the engine ends a failed model run's requests)
                self.fail(list(self.params), f"the {self.role} worker's engine step failed: "
                                             f"{type(error).__name__}: {error}")
                outputs = []
            handoffs = []
            for out in outputs:
                if out.finished:
                    self.params.pop(out.req_id, None)
                elif self.role == PREFILL and len(out.token_ids) == 1:
                    handoffs.append(out)
            handed = {out.req_id for out in handoffs}
            for req_id in list(self.outgoing):  # a streamed prompt that ended in its step (or failed): no handoff
                if req_id not in handed:
                    self.outgoing.pop(req_id).writer.discard()
            for req_id in list(self.stream_errors):
                if req_id not in handed:
                    del self.stream_errors[req_id]
            self.conn.send(m.Outputs(outputs, engine.stats()))  # the first tokens go out before the packing
            for out in handoffs:
                message = self.hand_off(out)
                if message is not None:
                    self.conn.send(message)
            if handoffs:  # the counters without the requests that left
                self.conn.send(m.Outputs([], engine.stats()))

    def handle(self, msg) -> bool:
        """Apply one message; True on Stop."""
        if isinstance(msg, m.Stop):
            return True
        if isinstance(msg, m.Add):
            try:
                self.engine.add_request(msg.prompt, msg.params, req_id=msg.req_id)
                self.params[msg.req_id] = msg.params
            except (ValueError, TypeError) as error:
                self.conn.send(m.Refused(msg.req_id, str(error)))
        elif isinstance(msg, m.KVStream):
            self.incoming[msg.req_id] = _Incoming(msg)
        elif isinstance(msg, m.Adopt):
            if msg.req_id in self.incoming:  # streamed: its first token
                self.incoming[msg.req_id].final = msg
            else:
                self.pending.append(msg)
        elif isinstance(msg, m.Abort):
            for item in list(self.pending):
                if item.req_id == msg.req_id:  # not adopted yet: ends here
                    self.pending.remove(item)
                    remove(item.kv.segment)
                    self._report_abort(item)
            incoming = self.incoming.get(msg.req_id)
            if incoming is not None:  # streaming in, or waiting for blocks: given up
                self._drop_incoming(msg.req_id)
                if incoming.final is not None:  # the front had moved it here: it expects the request's end
                    self._report_abort(incoming.final)
                else:  # the blocks it held are free again
                    self.conn.send(m.Outputs([], self.engine.stats()))
            else:
                self.engine.abort_request(msg.req_id)
        return False

    def _report_abort(self, item: m.Adopt) -> None:
        self.conn.send(m.Outputs([RequestOutput(item.req_id, item.prompt_ids, [item.first_token], "", finished=True,
                                                finish_reason="abort")], self.engine.stats()))

    def stream_layer(self, layer: int, prompts) -> None:
        """The engine's prompt-KV observer: write layer `layer` of each completing prompt into its segment (the
        first layer creates the segment and tells the front). A failure ends that prompt's streaming only; its
        request fails after the step (hand_off)."""
        caches = self.engine.runner.kv_caches
        for prompt in prompts:
            req_id = prompt.req_id
            if layer == 0:
                self._begin_stream(prompt)
            outgoing = self.outgoing.get(req_id)
            if outgoing is None:
                continue
            try:
                outgoing.writer.write_layer(layer, caches[layer], outgoing.slots)
            except Exception as error:  # noqa: BLE001 - reported after the step
                self.outgoing.pop(req_id).writer.discard()
                self.stream_errors[req_id] = f"{type(error).__name__}: {error}"

    def _begin_stream(self, prompt) -> None:
        n = len(prompt.prompt_ids)
        try:
            slots = handoff.slots_of(prompt.block_table, n, self.block_size)
            writer = handoff.LayerWriter(self._segment_name(), self.layout, handoff.choose_tiers(n, self.policy),
                                         model=self.identity, full_dtype=self.engine.runner.kv_caches[0].dtype,
                                         policy=self.policy)
        except Exception as error:  # noqa: BLE001 - e.g. no room in /dev/shm; reported after the step
            self.stream_errors[prompt.req_id] = f"{type(error).__name__}: {error}"
            return
        self.outgoing[prompt.req_id] = _Outgoing(writer, slots)
        self.conn.send(m.KVStream(prompt.req_id, prompt.prompt_ids, self.params[prompt.req_id], writer.packed))

    def _segment_name(self) -> str:
        return f"{self.prefix}{os.getpid()}-{next(self.names)}"

    def hand_off(self, out: RequestOutput) -> m.Handoff | None:
        """Pack out's prompt KV into a segment (or finish its streamed one) and forget the request here (None: it
        failed, reported)."""
        engine, req_id = self.engine, out.req_id
        outgoing = self.outgoing.pop(req_id, None)
        try:
            if req_id in self.stream_errors:
                raise RuntimeError(self.stream_errors.pop(req_id))
            if outgoing is not None:
                kv = outgoing.writer.close()
            else:
                table = engine.scheduler.block_manager.get_block_table(req_id)
                slots = handoff.slots_of(table, len(out.prompt_token_ids), self.block_size)
                kv = handoff.pack_into_segment(self._segment_name(), engine.runner.kv_caches, self.layout, slots,
                                               model=self.identity, policy=self.policy,
                                               importance=engine.prompt_importance(req_id))
        except Exception as error:  # e.g. no room in /dev/shm
            if outgoing is not None:
                outgoing.writer.discard()
            engine.detach_request(req_id)
            self.params.pop(req_id, None)
            self.conn.send(m.Failed([req_id], f"the KV handoff failed: {type(error).__name__}: {error}"))
            return None
        generator = engine.detach_request(req_id)
        state = bytes(generator.get_state().numpy().tobytes()) if generator is not None else None
        return m.Handoff(req_id, out.prompt_token_ids, self.params.pop(req_id), out.token_ids[0], kv, state)

    def adopt_pending(self) -> None:
        engine = self.engine
        while self.pending and engine.can_adopt(len(self.pending[0].prompt_ids)):
            msg = self.pending.popleft()
            slots = None

            def write_kv(table: list[int]):
                nonlocal slots
                slots = handoff.slots_of(table, len(msg.prompt_ids), self.block_size)
                reader = handoff.unpack_from_segment(msg.kv.segment, engine.runner.kv_caches, self.layout, slots,
                                                     model=self.identity)
                return handoff.adopted_kv(reader, engine.runner.kv_caches[0].dtype)  # dropped keys: masked

            state = (torch.frombuffer(bytearray(msg.generator_state), dtype=torch.uint8)
                     if msg.generator_state is not None else None)
            try:
                engine.adopt_request(msg.prompt_ids, msg.params, msg.req_id, msg.first_token, write_kv, state)
                self.params[msg.req_id] = msg.params
            except Exception as error:  # PayloadError (another model or version), a refused request, a lost segment
                remove(msg.kv.segment)  # unpacking removes it; an earlier refusal does not
                self.conn.send(m.Failed([msg.req_id], f"the decode worker refused the KV handoff: {error}"))

    def advance_streams(self) -> None:
        """Decode worker: reserve KV blocks for streamed prompts (in arrival order, while they fit), unpack the
        layers written since the last look, and start each request whose layers are all in and whose first token
        has come."""
        engine = self.engine
        for req_id, incoming in list(self.incoming.items()):
            try:
                if incoming.reader is None:
                    if not engine.can_adopt(len(incoming.stream.prompt_ids)):
                        break  # later ones wait behind it
                    self._reserve(incoming)
                if not incoming.reader.unpack_ready(engine.runner.kv_caches) or incoming.final is None:
                    continue
                adopted = handoff.adopted_kv(incoming.reader.reader, engine.runner.kv_caches[0].dtype)
                final = incoming.final
                state = (torch.frombuffer(bytearray(final.generator_state), dtype=torch.uint8)
                         if final.generator_state is not None else None)
                engine.complete_adoption(req_id, final.first_token, adopted, state)
            except Exception as error:  # PayloadError (another model or version), a refused request, a lost segment
                self._drop_incoming(req_id)
                self.conn.send(m.Failed([req_id], f"the decode worker refused the KV handoff: {error}"))
                continue
            incoming.reader.close()
            del self.incoming[req_id]
            self.params[req_id] = final.params

    def _reserve(self, incoming: _Incoming) -> None:
        stream, engine = incoming.stream, self.engine
        table = engine.reserve_adoption(stream.prompt_ids, stream.params, stream.req_id)
        slots = handoff.slots_of(table, len(stream.prompt_ids), self.block_size)
        try:
            incoming.reader = handoff.LayerReader(stream.kv.segment, self.layout, slots, model=self.identity)
        except BaseException:
            engine.cancel_adoption(stream.req_id)
            raise

    def _drop_incoming(self, req_id: str) -> None:
        """Give up a streamed prompt: its blocks back, its segment removed."""
        incoming = self.incoming.pop(req_id)
        if incoming.reader is not None:
            incoming.reader.close()
            self.engine.cancel_adoption(req_id)
        else:
            remove(incoming.stream.kv.segment)

    def fail(self, req_ids: list[str], message: str) -> None:
        for req_id in req_ids:
            self.engine.abort_request(req_id)
            self.params.pop(req_id, None)
        if req_ids:
            self.conn.send(m.Failed(req_ids, message))
        print(message, file=sys.stderr)


if __name__ == "__main__":
    main()
