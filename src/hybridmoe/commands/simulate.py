"""`hybridmoe simulate`: predicted TTFT and decode speed of a model on hardware we may not have.

`--model NAME --hardware GPU,CPU [--gpus N]` prints, for FP8 and INT4 routed experts and the strategies
cpu-only, hybrid, slp and slp on N GPUs, the TTFT at 8K/32K/64K prompts, prefill and decode tokens/s and the
longest prompt served within 30 s. `--paper` prints the comparison with the published figures instead.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def register(subparsers) -> None:
    p = subparsers.add_parser("simulate", help="predict TTFT and decode speed on other hardware")
    p.add_argument("--model", help="packaged model name (e.g. deepseek-v3), model directory or demo (the embedded "
                                   "demo model)")
    p.add_argument("--hardware", help="profiles: a GPU and a CPU, e.g. rtx5090,epyc-genoa-2s (or a JSON path)")
    p.add_argument("--gpus", type=int, help="GPUs for distributed stream-loading (default 1)")
    p.add_argument("--formats", default="fp8,int4", help="routed-expert formats (default fp8,int4)")
    p.add_argument("--prompts", default="8192,32768,65536", help="prompt lengths (default 8192,32768,65536)")
    p.add_argument("--dense", help="format of the non-expert weights (default: the model's)")
    p.add_argument("--no-longest", action="store_true", help="skip the longest-prompt-within-30-s search")
    p.add_argument("--paper", action="store_true", help="compare with the paper's published figures")
    p.add_argument("--json", help="write the records (a list of objects) to this path")
    p.set_defaults(func=run)


def run(args) -> int:
    from hybridmoe.commands.plan import model_argument, parse_ints
    from hybridmoe.config import ConfigError
    from hybridmoe.placement.hardware import ProfileError
    from hybridmoe.placement.planner import PlanError
    from hybridmoe.placement.report import format_comparison, format_records
    from hybridmoe.placement.what_if import Simulation

    try:
        if args.paper:
            from hybridmoe.placement import paper

            figures = paper.comparison()
            print(f"{paper.PAPER}\nAssumed hardware: {paper.ASSUMED_HARDWARE}\n")
            print(format_comparison(figures))
            if args.json:
                Path(args.json).write_text(json.dumps([f.__dict__ | {"ratio": f.ratio} for f in figures], indent=2))
            return 0
        if not args.model or not args.hardware:
            raise ValueError("--model and --hardware are required (or --paper)")
        sim = Simulation(model_argument(args.model), args.hardware, args.gpus, args.dense)
        formats = tuple(f.strip().lower() for f in args.formats.split(",") if f.strip())
        records = sim.run(formats, parse_ints(args.prompts, "--prompts"), longest=not args.no_longest)
    except (ValueError, ConfigError, ProfileError, PlanError, RuntimeError) as e:
        print(f"hybridmoe simulate: {e}", file=sys.stderr)
        return 2
    print(format_records(records))
    if args.json:
        Path(args.json).write_text(json.dumps([r.to_json() for r in records], indent=2) + "\n")
    return 0
