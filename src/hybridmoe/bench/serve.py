"""`hybridmoe bench serve [--model DIR] [--url URL] [--json PATH] [--plot PNG]`: load on an OpenAI-compatible
server, its latencies and throughput.

The load generator runs in this process and the server in another: without --url the bench starts
`hybridmoe serve --model DIR` (default: the demo model) on 127.0.0.1 and a free port, waits for GET /health to
answer 200, runs the workload and stops the server (SIGTERM); with --url it loads a server already running on
this machine (loopback addresses only). The workload (`_serving/workload.py`): N concurrent users
(--concurrency, default 4) or Poisson arrivals (--rate), a mix of long prompts (/v1/completions) and multi-turn
chats under shared system prompts (/v1/chat/completions), every request streamed; bounded by --num-requests and
--duration.

Printed: p50 / p90 / p99 (and mean) of time to first token (TTFT), time per output token after the first (TPOT)
and end-to-end latency; requests and tokens per second; the fraction of requests meeting the SLO (TTFT <= 30 s
and TPOT <= 50 ms unless --slo-ttft / --slo-tpot-ms say otherwise). --json writes the settings, the summary and
every request's record; --plot draws TTFT and TPOT over the run and their CDFs.

--compare NAMES runs the same workload against a server started per setting (overlap: `--overlap on` against
`--no-overlap`; pd once `serve --pd` exists; several names: every combination), --rounds times each in alternating
order, and prints the settings side by side: the engine's own decode throughput (decode tokens / decode step seconds
from GET /metrics, the aggregate over all decoding sequences) and its CPU experts' time, then the HTTP-side figures;
--json keeps every run, --plot draws the settings' TTFT and TPOT CDFs and throughputs in one figure.
"""

from __future__ import annotations

import json
import os
import shlex
import sys
from pathlib import Path

from hybridmoe.bench._serving import compare
from hybridmoe.bench._serving.loadgen import ServerUnreachable, run_workload
from hybridmoe.bench._serving.report import SLO, format_summary, plot, summarize, write_json
from hybridmoe.bench._serving.server import ServerError, ServerProcess, check_loopback
from hybridmoe.bench._serving.workload import WorkloadSpec

DEFAULTS = WorkloadSpec()


def register(subparsers) -> None:
    p = subparsers.add_parser("serve", help="load an OpenAI-compatible server: TTFT, TPOT, throughput, SLO")
    where = p.add_mutually_exclusive_group()
    where.add_argument("--model", default="demo",
                       help="start `hybridmoe serve` on this model directory, or demo (the default)")
    where.add_argument("--url", help="load a server already running at this URL on this machine instead "
                                     "(http://127.0.0.1:PORT; loopback only)")
    p.add_argument("--json", metavar="PATH", help="write the settings, summary and per-request records to PATH")
    p.add_argument("--plot", metavar="PNG", help="draw TTFT and TPOT over time and their CDFs to PNG")
    pacing = p.add_mutually_exclusive_group()
    pacing.add_argument("--concurrency", type=int, metavar="N",
                        help=f"N users, each sending its next request when its last ended (default "
                             f"{DEFAULTS.concurrency})")
    pacing.add_argument("--rate", type=float, metavar="R", help="Poisson arrivals, R requests/s, instead")
    p.add_argument("--num-requests", type=int, metavar="N", default=DEFAULTS.num_requests,
                   help=f"requests to send (default {DEFAULTS.num_requests})")
    p.add_argument("--duration", type=float, metavar="S", default=DEFAULTS.duration_s,
                   help=f"seconds at most: no request is sent after, those in flight are cancelled (default "
                        f"{DEFAULTS.duration_s:g})")
    p.add_argument("--long-fraction", type=float, metavar="F", default=DEFAULTS.long_fraction,
                   help=f"fraction of requests that are long prompts, the rest chat turns (default "
                        f"{DEFAULTS.long_fraction:g})")
    p.add_argument("--long-tokens", type=int, metavar="TOKENS", default=DEFAULTS.long_tokens,
                   help=f"length of a long prompt (default {DEFAULTS.long_tokens})")
    p.add_argument("--system-prompts", type=int, metavar="N", default=DEFAULTS.system_prompts,
                   help=f"distinct system prompts the chat users share (default {DEFAULTS.system_prompts})")
    p.add_argument("--system-tokens", type=int, metavar="TOKENS", default=DEFAULTS.system_tokens,
                   help=f"length of a system prompt (default {DEFAULTS.system_tokens})")
    p.add_argument("--turn-tokens", type=int, metavar="TOKENS", default=DEFAULTS.turn_tokens,
                   help=f"length of a user's chat turn (default {DEFAULTS.turn_tokens})")
    p.add_argument("--turns", type=int, metavar="N", default=DEFAULTS.turns,
                   help=f"turns of a conversation before its user starts a new one (default {DEFAULTS.turns})")
    p.add_argument("--max-tokens", type=int, metavar="N", default=DEFAULTS.max_tokens,
                   help=f"output tokens a request asks for at most (default {DEFAULTS.max_tokens})")
    p.add_argument("--temperature", type=float, metavar="T", default=DEFAULTS.temperature,
                   help=f"sampling temperature (default {DEFAULTS.temperature:g}: greedy)")
    p.add_argument("--chars-per-token", type=float, metavar="C", default=DEFAULTS.chars_per_token,
                   help=f"characters of text a token, to size prompts without the server's tokenizer (default "
                        f"{DEFAULTS.chars_per_token:g}; the demo model's tokenizer makes about 4.3 of the bench's "
                        f"text)")
    p.add_argument("--seed", type=int, metavar="N", default=DEFAULTS.seed,
                   help=f"workload seed (default {DEFAULTS.seed})")
    p.add_argument("--slo-ttft", type=float, default=SLO.ttft_s, metavar="S",
                   help=f"TTFT target, seconds (default {SLO.ttft_s:g})")
    p.add_argument("--slo-tpot-ms", type=float, default=SLO.tpot_s * 1000, metavar="MS",
                   help=f"TPOT target, milliseconds (default {SLO.tpot_s * 1000:g})")
    p.add_argument("--api-key", help="sent as a bearer token (and given to the server the bench starts)")
    p.add_argument("--server-args", default="", metavar="ARGS",
                   help="more options for the `hybridmoe serve` the bench starts, one string "
                        "(e.g. \"--kv-cache-gb 2 --no-prefix-caching\")")
    p.add_argument("--startup-timeout", type=float, metavar="S", default=600.0,
                   help="seconds to wait for the started server's GET /health to answer 200 (default 600)")
    p.add_argument("--server-log", metavar="PATH", help="keep the started server's output in PATH")
    p.add_argument("--compare", metavar="NAMES",
                   help="run the workload against servers started with each setting of NAMES and report them side by "
                        "side: overlap (--overlap on against --no-overlap); pd (--pd against without, once `serve "
                        "--pd` exists); several, comma-separated, run every combination. Not with --url")
    p.add_argument("--rounds", type=int, default=1, metavar="N",
                   help="with --compare: runs of each setting, alternating their order (default 1)")
    p.set_defaults(func=run)


def workload_spec(args) -> WorkloadSpec:
    """The WorkloadSpec of the parsed flags (ValueError naming a bad one)."""
    return WorkloadSpec(concurrency=None if args.rate is not None else (
                            DEFAULTS.concurrency if args.concurrency is None else args.concurrency),
                        rate=args.rate, num_requests=args.num_requests, duration_s=args.duration,
                        long_fraction=args.long_fraction, long_tokens=args.long_tokens,
                        system_prompts=args.system_prompts, system_tokens=args.system_tokens,
                        turn_tokens=args.turn_tokens, turns=args.turns, max_tokens=args.max_tokens,
                        temperature=args.temperature, chars_per_token=args.chars_per_token, seed=args.seed)


def _progress(stream=None):
    """A line rewritten in place on a terminal, nothing otherwise. -> (show(message), done())."""
    stream = stream or sys.stderr
    if not stream.isatty():
        return (lambda message: None), (lambda: None)

    def show(message: str) -> None:
        stream.write("\r\x1b[K" + message)
        stream.flush()

    return show, lambda: show("")


def run(args) -> int:
    if args.compare:
        return run_compare(args)
    spec = workload_spec(args)
    slo = SLO(ttft_s=args.slo_ttft, tpot_s=args.slo_tpot_ms / 1000)
    url = check_loopback(args.url) if args.url else None
    server_args = shlex.split(args.server_args) + (["--api-key", args.api_key] if args.api_key else [])
    show, done = _progress()
    load_before = os.getloadavg()[0]  # other work on the machine slows the server: the JSON keeps the load
    try:
        if url:
            result = run_workload(url, spec, api_key=args.api_key, progress=show)
            server = {"started_by_bench": False}
        else:
            print(f"starting hybridmoe serve --model {args.model} {args.server_args}".rstrip(), file=sys.stderr)
            with ServerProcess(args.model, server_args, args.startup_timeout, args.server_log) as process:
                result = run_workload(process.url, spec, api_key=args.api_key, progress=show)
                died = process.died()
            server = {"started_by_bench": True, "model": args.model, "server_args": shlex.split(args.server_args)}
            if died:
                print(f"warning: {died}", file=sys.stderr)
    except (ServerError, ServerUnreachable) as error:
        done()
        print(f"error: {error}", file=sys.stderr)
        return 1
    done()
    summary = summarize(result.records, result.duration_s, slo)
    pacing = f"{spec.concurrency} concurrent users" if spec.concurrency else f"Poisson arrivals at {spec.rate:g}/s"
    print(f"bench serve: {result.model} at {result.url}, {pacing}")
    print(format_summary(summary))
    print(f"the load generator used {result.client_cpu_s:.1f} s of CPU in the run's {result.duration_s:.1f} s")
    machine = {"cpus": os.cpu_count(), "load_average_1min": [load_before, os.getloadavg()[0]]}
    if args.json:
        write_json(args.json, result, summary, {"server": server, "machine": machine})
        print(f"wrote {args.json}")
    if args.plot:
        plot(args.plot, result, summary)
        print(f"wrote {args.plot}")
    return 0


def run_compare(args) -> int:
    """--compare: each setting's own server, the same workload, one table and one plot (bench/_serving/compare.py)."""
    if args.url:
        raise ValueError("--compare starts a server per setting; it cannot use --url")
    if args.rounds < 1:
        raise ValueError(f"--rounds must be >= 1, got {args.rounds}")
    names = compare.parse(args.compare)
    spec = workload_spec(args)
    slo = SLO(ttft_s=args.slo_ttft, tpot_s=args.slo_tpot_ms / 1000)
    base_args = shlex.split(args.server_args) + (["--api-key", args.api_key] if args.api_key else [])
    settings = compare.settings(names)
    records = {label: [] for label, _ in settings}
    durations = {label: 0.0 for label, _ in settings}
    counters = {label: {} for label, _ in settings}
    runs = []
    show, done = _progress()
    load_before = os.getloadavg()[0]
    for round_index in range(args.rounds):
        order = settings if round_index % 2 == 0 else settings[::-1]
        for label, flags in order:
            print(f"[{label}] round {round_index + 1}/{args.rounds}: hybridmoe serve --model {args.model} "
                  f"{' '.join(base_args + flags)}".rstrip(), file=sys.stderr)
            try:
                with ServerProcess(args.model, base_args + flags, args.startup_timeout, args.server_log) as process:
                    before = compare.engine_counters(process.url, args.api_key)
                    result = run_workload(process.url, spec, api_key=args.api_key, progress=show)
                    after = compare.engine_counters(process.url, args.api_key)
                    died = process.died()
            except (ServerError, ServerUnreachable) as error:
                done()
                print(f"error: [{label}] {error}", file=sys.stderr)
                return 1
            done()
            if died:
                print(f"warning: [{label}] {died}", file=sys.stderr)
            delta = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in compare.ENGINE_COUNTERS}
            for k, v in delta.items():
                counters[label][k] = counters[label].get(k, 0.0) + v
            records[label] += result.records
            durations[label] += result.duration_s
            summary = summarize(result.records, result.duration_s, slo)
            engine = compare.engine_delta({}, delta)
            runs.append({"setting": label, "flags": flags, "round": round_index, "summary": summary,
                         "engine": engine, "run": result.run_info(), "requests": result.records_as_dicts()})
            print(f"[{label}] {summary['completed']} requests, {summary['output_token_throughput']:.1f} output tok/s; "
                  f"decode in the engine {engine['decode_tok_s'] or 0:.1f} tok/s", file=sys.stderr)
    labels = [label for label, _ in settings]
    summaries = [summarize(records[label], durations[label], slo) for label in labels]
    engines = [compare.engine_delta({}, counters[label]) for label in labels]
    pacing = f"{spec.concurrency} concurrent users" if spec.concurrency else f"Poisson arrivals at {spec.rate:g}/s"
    print(f"bench serve --compare {','.join(names)}: {args.model}, {pacing}, {args.rounds} round(s) per setting "
          f"(all rounds pooled)")
    print(compare.format_table(labels, summaries, engines))
    machine = {"cpus": os.cpu_count(), "load_average_1min": [load_before, os.getloadavg()[0]]}
    if args.json:
        report = {"settings": {"model": args.model, "server_args": shlex.split(args.server_args),
                               "workload": spec.as_dict(), "slo": {"ttft_s": slo.ttft_s, "tpot_s": slo.tpot_s},
                               "compare": names, "rounds": args.rounds, "machine": machine},
                  "combined": [{"setting": label, "flags": flags, "summary": s, "engine": e}
                               for (label, flags), s, e in zip(settings, summaries, engines)],
                  "runs": runs}
        Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
        print(f"wrote {args.json}")
    if args.plot:
        compare.plot(args.plot, labels, [records[label] for label in labels], summaries, engines,
                     f"bench serve --compare {','.join(names)}: {args.model}, {pacing}")
        print(f"wrote {args.plot}")
    return 0
