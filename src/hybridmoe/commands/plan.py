"""`hybridmoe plan`: print where every part of a model goes for a VRAM budget, before anything is loaded.

The machine comes from a measured profile (`--profile`, default: the one `hybridmoe profile` saved) or from
reference profiles (`--hardware rtx4090,epyc-genoa-2s`). The model is a directory with config.json, the name
of a packaged config (deepseek-v3, kimi-k2, qwen3-235b-a22b, qwen3-30b-a3b, mixtral-8x7b) or `demo` (the embedded
demo model).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

DEFAULT_PROFILE = Path("~/.cache/hybridmoe/profile.json")


def parse_size(text: str) -> float:
    """"24GB" / "24G" / "22.5GiB" / "512MB" -> bytes (accel.parse_bytes, as `--vram` everywhere); a bare number is
    GB here ("24")."""
    from hybridmoe.accel.accelerator import parse_bytes

    try:
        return float(text) * 1e9
    except ValueError:
        return float(parse_bytes(text))


def parse_ints(text: str, what: str) -> tuple[int, ...]:
    try:
        values = tuple(int(v) for v in text.split(",") if v.strip())
    except ValueError:
        raise ValueError(f"{what} must be comma-separated integers, got {text!r}") from None
    if not values or min(values) < 1:
        raise ValueError(f"{what} must be positive integers, got {text!r}")
    return values


def model_argument(model: str) -> str:
    """--model as the planner reads it: `demo` and `demo-gqa` are the embedded models' directories."""
    from hybridmoe.checkpoint.default_model import resolve_model_dir

    return str(resolve_model_dir(model))


def resolve_hardware(profile: str | None, hardware: str | None) -> str:
    """The hardware description to plan for: --hardware, else --profile, else the saved default profile."""
    if hardware and profile:
        raise ValueError("give either --profile or --hardware, not both")
    if hardware:
        return hardware
    path = Path(profile).expanduser() if profile else DEFAULT_PROFILE.expanduser()
    if not path.is_file():
        raise ValueError(f"no hardware profile at {path}: run `hybridmoe profile` first, or pass --hardware "
                         "(e.g. rtx4090,epyc-genoa-2s; see docs/placement.md for the reference profiles)")
    return str(path)


def register(subparsers) -> None:
    p = subparsers.add_parser("plan", help="print the placement plan of a model for a VRAM budget")
    p.add_argument("--model", required=True,
                   help="model directory, packaged name (e.g. deepseek-v3) or demo (the embedded demo model)")
    p.add_argument("--vram", help="VRAM budget, e.g. 24GB (default: the whole GPU)")
    p.add_argument("--profile", help=f"measured hardware profile (default: {DEFAULT_PROFILE})")
    p.add_argument("--hardware", help="reference profiles instead, e.g. rtx4090,epyc-genoa-2s")
    p.add_argument("--gpus", type=int, help="number of GPUs of that kind (stream-loading uses all)")
    p.add_argument("--experts", help="format of the routed experts (fp8, int4, int8, bf16; default: the model's)")
    p.add_argument("--dense", help="format of the other weights (default: the model's)")
    p.add_argument("--context", type=int, default=32768,
                   help="context length to reserve KV cache for (default 32768; TTFT is predicted up to it)")
    p.add_argument("--concurrency", type=int, default=1, help="sequences decoding at once")
    p.add_argument("--tiers", help="decode batch tiers, e.g. 1,4,16 (default: 1 and --concurrency)")
    p.add_argument("--routing", help="routing statistics JSON measured on sample prompts (hot experts)")
    p.add_argument("--json", help="also write the plan as JSON to this path")
    p.set_defaults(func=run)


def run(args) -> int:
    from hybridmoe.config import ConfigError
    from hybridmoe.placement.hardware import ProfileError, machine
    from hybridmoe.placement.modelspec import ModelSpec, resolve_model
    from hybridmoe.placement.planner import PlanError, Planner
    from hybridmoe.placement.report import format_plan, plan_to_json
    from hybridmoe.placement.routing import RoutingStats

    try:
        hardware = resolve_hardware(args.profile, args.hardware)
        model = model_argument(args.model)
        spec = ModelSpec(resolve_model(model), Path(model).name.lower())
        routing = RoutingStats.from_json(args.routing) if args.routing else None
        planner = Planner(spec, machine(hardware, gpus=args.gpus), parse_size(args.vram) if args.vram else None,
                          expert_format=args.experts, dense_format=args.dense, context=args.context,
                          concurrency=args.concurrency,
                          tiers=parse_ints(args.tiers, "--tiers") if args.tiers else None, routing=routing)
        plan = planner.plan()
    except (ValueError, ConfigError, ProfileError, PlanError) as e:
        print(f"hybridmoe plan: {e}", file=sys.stderr)
        return 2
    print(format_plan(plan))
    if args.json:
        Path(args.json).write_text(json.dumps(plan_to_json(plan), indent=2) + "\n")
    return 0
