"""Runs a workload against a server's URL: `run_workload(url, spec) -> RunResult`.

Closed loop (spec.concurrency): that many users, each sending its next request when its last one ended. Open
loop (spec.rate): requests sent at Poisson arrival times whatever the replies; a chat arrival continues the
conversation of the user idle longest, or starts a new user when all are busy, so arrivals never wait.

Bounds: no request is sent after spec.num_requests have been, nor after spec.duration_s; requests still in flight
at spec.duration_s are cancelled and recorded as such. The client makes a connection per request in flight (no
pool limit, which would queue requests in the client and count the wait as the server's), and ignores proxy
settings from the environment, which could route loopback traffic through a proxy.

One untimed request (one output token) goes first, so that one-time costs of a server's first request are not
counted against the workload's first.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from typing import Callable

import httpx

from hybridmoe.bench._serving.client import stream_request
from hybridmoe.bench._serving.records import RequestRecord, RunResult
from hybridmoe.bench._serving.workload import COMPLETIONS, RequestPlan, User, Workload, WorkloadSpec

CONNECT_TIMEOUT_S = 10.0


class ServerUnreachable(RuntimeError):
    """The server did not answer, or not as an OpenAI-compatible one."""


def run_workload(url: str, spec: WorkloadSpec, *, model: str | None = None, api_key: str | None = None,
                 progress: Callable[[str], None] | None = None) -> RunResult:
    """Run `spec` against the server at `url` (its model: `model`, else the first that GET /v1/models lists).
    `progress` gets a line after each request."""
    return asyncio.run(_Run(url, spec, api_key, progress or (lambda line: None)).run(model))


class _Run:
    def __init__(self, url: str, spec: WorkloadSpec, api_key: str | None, progress: Callable[[str], None]):
        self.url = url.rstrip("/")
        self.spec = spec
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.progress = progress
        self.workload = Workload(spec)
        self.records: list[RequestRecord] = []
        self.finished = 0
        self.clock_zero = 0.0

    async def run(self, model: str | None) -> RunResult:
        async with httpx.AsyncClient(base_url=self.url, headers=self.headers, trust_env=False,
                                     timeout=httpx.Timeout(None, connect=CONNECT_TIMEOUT_S),
                                     limits=httpx.Limits(max_connections=None,
                                                         max_keepalive_connections=None)) as client:
            self.client = client
            self.model = model or await self._first_model()
            await self._warm_up()
            result = RunResult(self.url, self.model, self.spec, self.records,
                               started=time.strftime("%Y-%m-%dT%H:%M:%S%z"))
            self.clock_zero, cpu_zero = time.perf_counter(), time.process_time()
            pacing = self._users() if self.spec.concurrency else self._arrivals()
            try:
                await asyncio.wait_for(pacing, timeout=self.spec.duration_s)
            except asyncio.TimeoutError:  # not the builtin TimeoutError before Python 3.11
                pass  # the time bound: what was in flight has been cancelled
            result.duration_s = time.perf_counter() - self.clock_zero
            result.client_cpu_s = time.process_time() - cpu_zero
        for record in self.records:
            if record.status == "pending":
                record.status = "cancelled"
        return result

    async def _first_model(self) -> str:
        try:
            response = await self.client.get("/v1/models")
            response.raise_for_status()
            return response.json()["data"][0]["id"]
        except (httpx.HTTPError, ValueError, KeyError, IndexError) as error:
            raise ServerUnreachable(f"no model list from {self.url}/v1/models ({type(error).__name__}: {error}); "
                                    f"is an OpenAI-compatible server (hybridmoe serve) running there?") from error

    async def _warm_up(self) -> None:
        plan = RequestPlan("long", COMPLETIONS, {"prompt": "Hello", "max_tokens": 1}, -1, 0)
        record = RequestRecord(-1, plan.kind, plan.user, plan.turn, 0.0)
        await stream_request(self.client, plan, self.model, record, time.perf_counter())
        if record.status != "ok":
            raise ServerUnreachable(f"the warm-up request to {self.url} failed: {record.error}")

    async def _send(self, user: User, plan: RequestPlan) -> None:
        record = RequestRecord(len(self.records), plan.kind, plan.user, plan.turn, 0.0)
        self.records.append(record)
        reply = await stream_request(self.client, plan, self.model, record, self.clock_zero)
        user.finished(plan, reply)
        self.finished += 1
        in_flight = sum(r.status == "pending" for r in self.records)
        self.progress(f"{self.finished}/{self.spec.num_requests} requests done, {in_flight} in flight, "
                      f"{time.perf_counter() - self.clock_zero:.0f} s")

    async def _users(self) -> None:
        async def user_loop(user: User) -> None:
            while len(self.records) < self.spec.num_requests:
                await self._send(user, user.next_request(user.draw_kind()))

        await asyncio.gather(*(user_loop(self.workload.new_user()) for _ in range(self.spec.concurrency)))

    async def _arrivals(self) -> None:
        idle: deque[User] = deque()  # idle longest first
        tasks = []

        async def one(user: User, plan: RequestPlan) -> None:
            await self._send(user, plan)
            idle.append(user)

        try:
            for at in self.workload.arrival_times():
                delay = self.clock_zero + at - time.perf_counter()
                if delay > 0:
                    await asyncio.sleep(delay)
                user = idle.popleft() if idle else self.workload.new_user()
                plan = user.next_request(self.workload.draw_arrival_kind(), self.workload.arrival_rng)
                tasks.append(asyncio.create_task(one(user, plan)))
            await asyncio.gather(*tasks)
        finally:  # the time bound may cancel this loop while it sleeps: its requests in flight go with it
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
