"""The server against the offline engine, measured side by side in one run, on the demo model (or --model):

1. Throughput: one batch (--batch prompts of --prompt-tokens tokens, greedy, --max-tokens tokens each, EOS ignored)
   through `LLM.generate` in this process, and through `hybridmoe serve` (a subprocess on 127.0.0.1) as that many
   concurrent /v1/completions requests from this process, streamed and not. Output tokens per second of each, and
   server / offline; rounds alternate the three, the figures are the medians of the rounds' ratios. With
   --stream-interval N > 1 (default 4) the rounds also stream the batch through a third server started with
   `--stream-interval N` (an event per N tokens of a request, as vLLM's and SGLang's option).
2. Prefix caching in a chat: a conversation whose first turn holds a ~--context-tokens system prompt; the TTFT of
   its second turn (time to the first streamed content) on a server with prefix caching and one without
   (`--no-prefix-caching`), both running, asked in alternation; cached / uncached, median of the rounds.

    python benchmarks/serve_vs_offline.py [--model demo] [--rounds 3] [--stream-interval 4] [--json PATH]

OpenMP threads wait passively here (OMP_WAIT_POLICY=PASSIVE unless set), in this process and the servers alike: on a
machine whose cores other jobs also use, torch's spinning OpenMP team on the main thread made LLM.generate many
times slower than the same engine on the server's engine thread, which would flatter the server.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import socket
import statistics
import subprocess
import sys
import time

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch loads (see above)

import httpx  # noqa: E402

from hybridmoe import LLM, SamplingParams  # noqa: E402


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class _Server:
    def __init__(self, model: str, *flags: str):
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.process = subprocess.Popen([sys.executable, "-m", "hybridmoe.cli", "serve", "--model", model, "--port",
                                         str(self.port), "--log-level", "warning", *flags])
        deadline = time.monotonic() + 300
        while True:
            if self.process.poll() is not None:
                raise RuntimeError(f"hybridmoe serve {' '.join(flags)} exited with {self.process.returncode}")
            try:
                if httpx.get(self.url + "/health", timeout=5).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError("the server did not become healthy within 300 s")
            time.sleep(0.2)

    def stop(self) -> None:
        self.process.terminate()
        self.process.wait(60)

    def cpu_seconds(self) -> float | None:
        """CPU time the server process has used (all its threads; Linux /proc), None where unknown. Less moved by
        other jobs than wall time: the work the server does per token."""
        try:
            with open(f"/proc/{self.process.pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            return None
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime


def _prompts(n: int, length: int, vocab: int) -> list[list[int]]:
    return [[(97 * i + 31 * k) % (vocab - 10) + 5 for k in range(length)] for i in range(n)]


async def _server_batch(url: str, prompts: list[list[int]], max_tokens: int,
                        stream: bool) -> tuple[float, int, float]:
    """(seconds, output tokens, this process's CPU seconds) of the batch as concurrent requests.

    On a small machine the client shares the cores with the server, so it is kept lean: a streamed response is read
    by `_post_streamed` (asyncio streams, the body kept as it arrives and parsed once at its end: httpx's per-chunk
    work took about 90 us a chunk, a tenth of the server's CPU for the batch); only its last event, the usage, is
    parsed. Requests not streamed go through httpx."""
    limits = httpx.Limits(max_connections=len(prompts) + 4)
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as client:
        async def one(prompt: list[int]) -> int:
            body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
            if not stream:
                return (await client.post("/v1/completions", json=body)).json()["usage"]["completion_tokens"]
            body.update(stream=True, stream_options={"include_usage": True})
            return _streamed_usage(await _post_streamed(url, "/v1/completions", body))["completion_tokens"]
        cpu, start = time.process_time(), time.perf_counter()
        counts = await asyncio.gather(*(one(p) for p in prompts))
        return time.perf_counter() - start, sum(counts), time.process_time() - cpu


async def _post_streamed(url: str, path: str, body: dict) -> bytes:
    """POST body as JSON over HTTP/1.1 (one connection, closed by the server after the response) and return the
    response's body, read to its end; RuntimeError unless the status is 200."""
    host, port = url.removeprefix("http://").split(":")
    payload = json.dumps(body).encode()
    reader, writer = await asyncio.open_connection(host, int(port))
    try:
        writer.write(f"POST {path} HTTP/1.1\r\nHost: {host}:{port}\r\nContent-Type: application/json\r\n"
                     f"Content-Length: {len(payload)}\r\nConnection: close\r\n\r\n".encode() + payload)
        pieces = []
        while piece := await reader.read(1 << 16):
            pieces.append(piece)
    finally:
        writer.close()
    head, _, data = b"".join(pieces).partition(b"\r\n\r\n")
    if not head.startswith(b"HTTP/1.1 200"):
        raise RuntimeError(f"{path}: {head.splitlines()[0] if head else b'no response'}: {data[:300]!r}")
    if b"transfer-encoding: chunked" not in head.lower():
        return data
    body_parts, at = [], 0
    while True:  # the chunked transfer coding: hex size CRLF, data CRLF, ..., 0 CRLF CRLF
        line_end = data.index(b"\r\n", at)
        size = int(data[at:line_end].split(b";")[0], 16)
        if size == 0:
            return b"".join(body_parts)
        body_parts.append(data[line_end + 2:line_end + 2 + size])
        at = line_end + 2 + size + 2


def _streamed_usage(raw: bytes) -> dict:
    """The usage of a streamed completion's body: its last `data: {...}` event before [DONE]."""
    events = raw.rstrip().split(b"\n\n")
    if events[-1] != b"data: [DONE]":
        raise RuntimeError(f"the stream did not end with [DONE]: {raw[-200:]!r}")
    return json.loads(events[-2][len(b"data: "):])["usage"]


def _offline_batch(llm: LLM, prompts: list[list[int]], max_tokens: int) -> tuple[float, int]:
    start = time.perf_counter()
    results = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True))
    return time.perf_counter() - start, sum(len(r.token_ids) for r in results)


def _long_system_prompt(url: str, tokens: int) -> str:
    words = ("the engine keeps routed experts in memory and computes them on the cpu while attention runs "
             "elsewhere; long prompts are prefilled in chunks and decode tokens go first. ").split()
    text, n = "", 0
    while n < tokens:
        text += " ".join(words) + " "
        n = httpx.post(url + "/tokenize", json={"prompt": text}, timeout=60).json()["count"]
    return text


def _second_turn_ttft(url: str, system: str, round_index: int) -> tuple[float, int]:
    """(TTFT seconds, prompt tokens) of the second turn of a conversation under the long system prompt; each round
    asks its own first question, so the second turn can reuse at most what its own first turn computed. One client
    for both turns, made before the clock starts: making an httpx client (its TLS context) takes 40-65 ms."""
    messages = [{"role": "system", "content": system},
                {"role": "user", "content": f"Question {round_index}: what runs on the cpu?"}]
    with httpx.Client(timeout=600) as client:
        first = client.post(url + "/v1/chat/completions", json={
            "messages": messages, "max_tokens": 16, "temperature": 0}).json()
        messages += [{"role": "assistant", "content": first["choices"][0]["message"]["content"]},
                     {"role": "user", "content": "And what goes first?"}]
        start = time.perf_counter()
        with client.stream("POST", url + "/v1/chat/completions", json={
                "messages": messages, "max_tokens": 4, "temperature": 0, "stream": True,
                "stream_options": {"include_usage": True}}) as response:
            ttft, prompt_tokens = None, 0
            for line in response.iter_lines():
                if not line.startswith("data: {"):
                    continue
                chunk = json.loads(line[6:])
                if ttft is None and chunk["choices"] and chunk["choices"][0]["delta"].get("content"):
                    ttft = time.perf_counter() - start
                if chunk.get("usage"):
                    prompt_tokens = chunk["usage"]["prompt_tokens"]
    return ttft, prompt_tokens


def _median(values) -> float | None:
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="demo")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--prompt-tokens", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--context-tokens", type=int, default=1024)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--stream-interval", type=int, default=4,
                        help="also stream through a server with this --stream-interval (1: not)")
    parser.add_argument("--json", default=None, help="write the settings and every round's figures here")
    args = parser.parse_args()

    llm = LLM(args.model)
    prompts = _prompts(args.batch, args.prompt_tokens, llm.engine.model_config.vocab_size)
    servers = {"cached": _Server(args.model), "uncached": _Server(args.model, "--no-prefix-caching")}
    runs = [("streamed", "cached", True), ("gathered", "cached", False)]
    if args.stream_interval > 1:
        servers["interval"] = _Server(args.model, "--stream-interval", str(args.stream_interval))
        runs.append(("interval", "interval", True))
    try:
        _offline_batch(llm, prompts[:2], 4)  # warm-up of both paths
        asyncio.run(_server_batch(servers["cached"].url, prompts[:2], 4, True))
        throughput = []
        for _ in range(args.rounds):
            offline_s, offline_tokens = _offline_batch(llm, prompts, args.max_tokens)
            row = {"offline_tok_s": offline_tokens / offline_s, "load_avg_1m": os.getloadavg()[0]}
            for name, server, stream in runs:
                server_cpu = servers[server].cpu_seconds()
                server_s, server_tokens, client_cpu = asyncio.run(_server_batch(
                    servers[server].url, prompts, args.max_tokens, stream))
                assert offline_tokens == server_tokens == args.batch * args.max_tokens
                row[f"{name}_tok_s"], row[f"{name}_ratio"] = server_tokens / server_s, offline_s / server_s
                row[f"{name}_client_cpu_s"] = client_cpu
                if server_cpu is not None:
                    row[f"{name}_server_cpu_s"] = servers[server].cpu_seconds() - server_cpu
            throughput.append(row)
            print(f"throughput: offline {row['offline_tok_s']:.1f} tok/s; server streamed {row['streamed_tok_s']:.1f} "
                  f"tok/s ({row['streamed_ratio']:.3f} of offline), not streamed {row['gathered_tok_s']:.1f} tok/s "
                  f"({row['gathered_ratio']:.3f}); CPU s streamed / not: server {row.get('streamed_server_cpu_s', 0):.2f} / "
                  f"{row.get('gathered_server_cpu_s', 0):.2f}, client {row['streamed_client_cpu_s']:.2f} / "
                  f"{row['gathered_client_cpu_s']:.2f}; load average {row['load_avg_1m']:.1f}"
                  + (f"; streamed at interval {args.stream_interval} {row['interval_tok_s']:.1f} tok/s "
                     f"({row['interval_ratio']:.3f})" if "interval_ratio" in row else ""))

        system = _long_system_prompt(servers["cached"].url, args.context_tokens)
        ttft = []
        for r in range(args.rounds):
            cached, prompt_tokens = _second_turn_ttft(servers["cached"].url, system, r)
            uncached, _ = _second_turn_ttft(servers["uncached"].url, system, r)
            ttft.append({"prompt_tokens": prompt_tokens, "cached_s": cached, "uncached_s": uncached,
                         "ratio": cached / uncached})
            print(f"second chat turn of {prompt_tokens} tokens: TTFT {cached * 1000:.1f} ms with prefix caching, "
                  f"{uncached * 1000:.1f} ms without, cached / uncached {cached / uncached:.3f}")
    finally:
        for server in servers.values():
            server.stop()

    summary = {"streamed_ratio_median": statistics.median(t["streamed_ratio"] for t in throughput),
               "gathered_ratio_median": statistics.median(t["gathered_ratio"] for t in throughput),
               "streamed_server_cpu_s_median": _median(t.get("streamed_server_cpu_s") for t in throughput),
               "gathered_server_cpu_s_median": _median(t.get("gathered_server_cpu_s") for t in throughput),
               "interval_ratio_median": _median(t.get("interval_ratio") for t in throughput),
               "load_avg_1m": [t["load_avg_1m"] for t in throughput],
               "ttft_ratio_median": statistics.median(t["ratio"] for t in ttft)}
    print(f"\nmedian of {args.rounds} rounds: throughput server / offline {summary['streamed_ratio_median']:.3f} "
          f"streamed, {summary['gathered_ratio_median']:.3f} not streamed (goal >= 0.90); TTFT of the second chat "
          f"turn with / without prefix caching {summary['ttft_ratio_median']:.3f} (goal <= 0.2)")
    if summary["interval_ratio_median"] is not None:
        print(f"streamed with --stream-interval {args.stream_interval}: {summary['interval_ratio_median']:.3f} of offline")
    if summary["streamed_server_cpu_s_median"] is not None:
        tokens = args.batch * args.max_tokens
        print(f"server CPU per output token (median): {summary['streamed_server_cpu_s_median'] / tokens * 1e6:.0f} us "
              f"streamed, {summary['gathered_server_cpu_s_median'] / tokens * 1e6:.0f} us not; load average "
              f"{min(summary['load_avg_1m']):.1f} to {max(summary['load_avg_1m']):.1f} over the rounds")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"settings": vars(args), "machine": {"cpus": os.cpu_count(), "platform": platform.platform()},
                       "throughput": throughput, "ttft": ttft, "summary": summary}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
