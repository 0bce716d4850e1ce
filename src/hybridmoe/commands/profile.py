"""`hybridmoe profile [--out FILE] [--model DIR]`: measure this machine and save a versioned hardware profile
(what it measures: hybridmoe.profiling.machine). With --model, the engine's op tables for that model too.
(`--routing-model DIR --out FILE` instead counts the model's expert choices on sample prompts, for
`hybridmoe plan --routing FILE`: the hot experts the planner pins.)
"""

from __future__ import annotations

import sys
from pathlib import Path

from hybridmoe.commands.plan import DEFAULT_PROFILE
from hybridmoe.profiling.machine import build_profile
from hybridmoe.profiling.routing import SAMPLE_PROMPTS, measure_routing


def register(subparsers) -> None:
    p = subparsers.add_parser("profile", help="measure this machine and save a hardware profile")
    p.add_argument("--out", help=f"where to write it (default {DEFAULT_PROFILE}; required with --routing-model)")
    p.add_argument("--quick", action="store_true", help="smaller working sets and fewer repeats (less exact)")
    p.add_argument("--formats", default="fp8,int4,bf16", help="expert formats to measure (default fp8,int4,bf16)")
    p.add_argument("--threads", type=int, help="threads for torch and the kernels (default: all CPUs)")
    p.add_argument("--model", metavar="DIR",
                   help="also measure this engine's op tables for this model (the cost model then predicts the "
                        "engine's CPU steps on it: plan --model DIR --profile FILE)")
    p.add_argument("--routing-model", metavar="DIR",
                   help="instead: count which experts this model routes sample prompts to (for plan --routing)")
    p.add_argument("--prompts", metavar="FILE", help="sample prompts for --routing-model, one per line")
    p.set_defaults(func=run)


def run(args) -> int:
    from hybridmoe.placement.hardware import profile_to_json

    if args.routing_model:
        if not args.out:  # the default path holds the hardware profile, which routing statistics must not replace
            raise ValueError("--routing-model needs --out FILE (routing statistics are not a hardware profile)")
        prompts = (Path(args.prompts).read_text().splitlines() if args.prompts else list(SAMPLE_PROMPTS))
        prompts = [p for p in prompts if p.strip()]
        out = Path(args.out).expanduser()
        stats = measure_routing(args.routing_model, prompts)
        stats.to_json(out, model=str(args.routing_model))
        print(f"wrote {out}: routing of {stats.tokens} prompt tokens over {len(stats.layers)} MoE layers")
        return 0

    formats = tuple(f.strip().lower() for f in args.formats.split(",") if f.strip())
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
        try:
            from hybridmoe.kernels import isa

            isa.configure_threads(args.threads)
        except ImportError:
            pass
    try:
        data = build_profile(args.quick, formats, log=lambda msg: print(msg, file=sys.stderr),
                             model_dir=args.model)
        out = Path(args.out or DEFAULT_PROFILE).expanduser()
        out.parent.mkdir(parents=True, exist_ok=True)
        profile_to_json(data, out)
    except (RuntimeError, ValueError, OSError) as e:
        print(f"hybridmoe profile: {e}", file=sys.stderr)
        return 2
    cpu = data["cpu"]
    print(f"wrote {out}: read {cpu['memory_read_gbs']['value']:.1f} GB/s; expert kernels: "
          + ", ".join(f"{f} {rows[0][1]:.1f} GB/s at T=1" for f, rows in cpu["expert_table"].items())
          + f"; measured with {', '.join(data['expert_kernels'])}")
    return 0
