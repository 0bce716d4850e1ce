"""A worker process of prefill/decode disaggregation: one `LLMEngine` driven by messages from the front.

The prefill worker takes new requests (`Add`), prefills them, and after the step that samples a request's first
token (reported as a normal output) packs the prompt's KV into a shared-memory segment under its `KVPolicy`
(handoff.py: below budget 1 its engine scores each prompt's attention importance during the prefill, unless
position importance is asked for, and the ladder follows the model's cached INT4 probe verdict), forgets the request
(`LLMEngine.detach_request`: its blocks are freed, full ones stay in its prefix cache) and sends a `Handoff`.
A request that ends with its first token (EOS, max_tokens 1, a stop string) ends here.
The decode worker adopts each handed-off request (`LLMEngine.adopt_request`, unpacking the payload into its own
cache; the dropped tokens become the request's mask of dropped keys), waiting while its KV blocks are full, and
decodes it to the end.

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
from multiprocessing.connection import Connection

import torch

from hybridmoe.disagg import handoff, messages as m, shared_weights
from hybridmoe.disagg.cpus import pin_to
from hybridmoe.disagg.shm import remove, sweep
from hybridmoe.kv.layout import KVLayout
from hybridmoe.models.loader import resolve_dtype
from hybridmoe.runtime.engine import EngineConfig, LLMEngine, RequestOutput

PREFILL, DECODE = "prefill", "decode"


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
    run_worker(init.role, conn, init.model, init.config, init.prefix, init.kv_budget, init.kv_importance)


def run_worker(role: str, conn, model: str, config: EngineConfig, prefix: str, kv_budget: float,
               kv_importance: str = "attention") -> None:
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
    worker = _Worker(role, conn, engine, prefix, policy)
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
    def __init__(self, role: str, conn, engine: LLMEngine, prefix: str, policy: handoff.KVPolicy | None):
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

    def loop(self) -> None:
        engine = self.engine
        while True:
            idle = not engine.has_unfinished_requests() and not self.pending
            if idle:
                self.conn.poll(None)
            while self.conn.poll(0):
                if self.handle(self.conn.recv()):
                    return
            self.adopt_pending()
            if not engine.has_unfinished_requests():
                continue
            try:
                outputs = engine.step()
            except Exception as error:  # outside the model run (the engine ends a failed model run's requests)
                self.fail(list(self.params), f"the {self.role} worker's engine step failed: "
                                             f"{type(error).__name__}: {error}")
                continue
            handoffs = []
            for out in outputs:
                if out.finished:
                    self.params.pop(out.req_id, None)
                elif self.role == PREFILL and len(out.token_ids) == 1:
                    handoffs.append(out)
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
        elif isinstance(msg, m.Adopt):
            self.pending.append(msg)
        elif isinstance(msg, m.Abort):
            for item in list(self.pending):
                if item.req_id == msg.req_id:  # not adopted yet: ends here
                    self.pending.remove(item)
                    remove(item.kv.segment)
                    self.conn.send(m.Outputs([RequestOutput(item.req_id, item.prompt_ids, [item.first_token], "",
                                                            finished=True, finish_reason="abort")],
                                             self.engine.stats()))
            self.engine.abort_request(msg.req_id)
        return False

    def hand_off(self, out: RequestOutput) -> m.Handoff | None:
        """Pack out's prompt KV into a segment and forget the request here (None: it failed, reported)."""
        engine, req_id = self.engine, out.req_id
        n = len(out.prompt_token_ids)
        name = f"{self.prefix}{os.getpid()}-{next(self.names)}"
        try:
            table = engine.scheduler.block_manager.get_block_table(req_id)
            slots = handoff.slots_of(table, n, self.block_size)
            kv = handoff.pack_into_segment(name, engine.runner.kv_caches, self.layout, slots, model=self.identity,
                                           policy=self.policy, importance=engine.prompt_importance(req_id))
        except Exception as error:  # e.g. no room in /dev/shm
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

    def fail(self, req_ids: list[str], message: str) -> None:
        for req_id in req_ids:
            self.engine.abort_request(req_id)
            self.params.pop(req_id, None)
        if req_ids:
            self.conn.send(m.Failed(req_ids, message))
        print(message, file=sys.stderr)


if __name__ == "__main__":
    main()
