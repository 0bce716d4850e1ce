"""`hybridmoe serve [--model DIR] [--host 127.0.0.1] [--port 8000]`: the OpenAI-compatible HTTP server (default
model: the embedded demo model). See docs/serving.md."""

from __future__ import annotations

import logging

from hybridmoe.checkpoint.default_model import resolve_model_dir
from hybridmoe.commands._generation import add_model_arguments, engine_config
from hybridmoe.config import load_config
from hybridmoe.runtime.async_engine import AsyncLLMEngine
from hybridmoe.serve.api_server import run_server
from hybridmoe.serve.state import ServerSettings


def register(subparsers) -> None:
    parser = subparsers.add_parser("serve", help="serve the model over an OpenAI-compatible HTTP API")
    add_model_arguments(parser)
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1; 0.0.0.0: all)")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--api-key", default=None,
                        help="require 'Authorization: Bearer KEY' on /v1/*, /tokenize and /detokenize")
    parser.add_argument("--served-model-name", default=None,
                        help="the model's name in the API (default: the --model argument)")
    parser.add_argument("--max-model-len", type=int, default=None,
                        help="most tokens (prompt + output) per request (default: the model's, capped by the cache)")
    parser.add_argument("--max-num-seqs", type=int, default=32, help="most requests running at once (default 32)")
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048,
                        help="token budget of one engine step (default 2048)")
    parser.add_argument("--max-waiting-requests", type=int, default=1024,
                        help="requests accepted but not yet running past which new ones get 429 (default 1024)")
    parser.add_argument("--max-request-bytes", type=int, default=16 * 2**20,
                        help="largest request body; larger ones get 413 (default 16 MiB)")
    parser.add_argument("--stream-interval", type=int, default=1,
                        help="a streamed response gets an event every N new tokens of a request (its first and last "
                             "at once): fewer events, less server CPU a token (default 1: every token)")
    parser.add_argument("--shutdown-timeout", type=float, default=30.0,
                        help="on SIGTERM/SIGINT, seconds the requests in flight may take to finish before they are "
                             "aborted (default 30)")
    group = parser.add_argument_group("prefill/decode disaggregation (docs/serving.md)")
    group.add_argument("--pd", action="store_true",
                       help="prefill and decode in two worker processes on this machine, sharing the weights' pages; "
                            "a prompt's KV moves to the decode worker, layer by layer as the prefill computes it, "
                            "and the request with it once its first token is sampled")
    group.add_argument("--kv-budget", type=float, default=1.0,
                       help="with --pd: the KV handoff's SpectrumKV budget, a fraction of the prompt KV's 16-bit "
                            "bytes: 1.0 (full precision, default) down to 0.05. Below 1 the less important tokens "
                            "are INT8; below 0.5 INT4 where the model's cached probe verdict allows it (hybridmoe "
                            "eval kv-probe; none cached: FULL/INT8 only), and below the cheapest tier's cost the "
                            "least important tokens are dropped (masked by the decode worker, positions kept)")
    group.add_argument("--kv-importance", choices=("attention", "position"), default="attention",
                       help="with --pd and --kv-budget below 1: what ranks the prompt's tokens: attention (the "
                            "attention mass from the prompt's last 32 queries, computed during the prefill; "
                            "default) or position (recency only, the paper's baseline)")
    group.add_argument("--no-kv-streaming", dest="kv_streaming", action="store_false",
                       help="with --pd: pack a prompt's KV after its prefill rather than sending each layer as the "
                            "prefill computes it (streaming needs the tiers before the prefill: with --kv-budget below "
                            "1 and attention importance the KV is packed after it anyway)")
    group.add_argument("--pd-prefill-cpus", default=None, metavar="LIST",
                       help="with --pd: the CPUs the prefill worker runs on, e.g. 0-3 (default: all)")
    group.add_argument("--pd-decode-cpus", default=None, metavar="LIST",
                       help="with --pd: the CPUs the decode worker runs on, e.g. 4-15 (default: all)")
    parser.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    parser.set_defaults(func=run)


def run(args) -> int:
    for name in ("port", "max_waiting_requests", "max_request_bytes", "stream_interval"):
        if getattr(args, name) < (0 if name == "max_waiting_requests" else 1):
            raise ValueError(f"--{name.replace('_', '-')} must be a positive integer, got {getattr(args, name)}")
    config = engine_config(args, max_model_len=args.max_model_len, max_num_seqs=args.max_num_seqs,
                           max_num_batched_tokens=args.max_num_batched_tokens)
    load_config(resolve_model_dir(args.model))  # a wrong --model is an error line before the server starts
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s:     %(message)s")
    settings = ServerSettings(served_model_name=args.served_model_name or str(args.model), api_key=args.api_key,
                              max_waiting_requests=args.max_waiting_requests,
                              max_request_bytes=args.max_request_bytes)
    if args.pd:
        from hybridmoe.disagg.engine import PDEngine

        engine = PDEngine(args.model, config, kv_budget=args.kv_budget, prefill_cpus=args.pd_prefill_cpus,
                          decode_cpus=args.pd_decode_cpus, kv_importance=args.kv_importance,
                          kv_streaming=args.kv_streaming, stream_interval=args.stream_interval)
    else:
        for flag, value, default in (("--kv-budget", args.kv_budget, 1.0), ("--kv-importance", args.kv_importance,
                                     "attention"), ("--pd-prefill-cpus", args.pd_prefill_cpus, None),
                                     ("--pd-decode-cpus", args.pd_decode_cpus, None),
                                     ("--no-kv-streaming", args.kv_streaming, True)):
            if value != default:
                raise ValueError(f"{flag} sets up --pd's workers; without --pd there are none")
        engine = AsyncLLMEngine(args.model, config, stream_interval=args.stream_interval)
    return run_server(engine, settings, args.host, args.port, args.shutdown_timeout, args.log_level)
