"""`hybridmoe eval kv` and `hybridmoe eval kv-probe`: SpectrumKV, the prompt's KV handed over as a mixed-precision
payload (hybridmoe.kv, docs/spectrumkv.md).

  eval kv-probe [--model DIR] [--tokens 1024] [--cache-dir DIR] [--force]
      3 needle trials at b = 0.3 under FP16/INT8/INT4; INT4 KV allowed when >= 2 pass. The verdict is cached
      per model fingerprint (hybridmoe's cache directory, kv-probe/) and reused unless --force.
  eval kv [--model DIR] --budgets 0.3,0.4,0.5,0.75 [--json PATH] [--plot PNG] [--int4 auto|yes|no]
      continuation perplexity against the compressed prefix KV and passkey accuracy over depths 0.05-0.95,
      for spectrumkv (attention / position importance), uniform INT8, uniform INT4 and PDTrim-style
      keep-first-and-last; payload bytes and pack/unpack GB/s.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

MODEL_HELP = "model directory, or 'demo' (the embedded demo model, MLA; default) or 'demo-gqa' (its GQA companion)"


def register(subparsers) -> None:
    parser = subparsers.add_parser("eval", help="evaluate the engine's options on a model (kv: SpectrumKV)")
    evals = parser.add_subparsers(dest="evaluation", metavar="EVALUATION")

    probe = evals.add_parser("kv-probe", help="does the model tolerate INT4 KV? (needle trials, cached verdict)")
    probe.add_argument("--model", default="demo", help=MODEL_HELP)
    probe.add_argument("--tokens", type=int, default=1024, help="prompt tokens of each needle trial (default 1024)")
    probe.add_argument("--cache-dir", default=None, help="where verdicts are cached (default: hybridmoe's cache, kv-probe/)")
    probe.add_argument("--force", action="store_true", help="probe again even when a verdict is cached")
    probe.set_defaults(func=run_probe)

    kv = evals.add_parser("kv", help="SpectrumKV quality and payload figures against full KV and baselines")
    kv.add_argument("--model", default="demo", help=MODEL_HELP)
    kv.add_argument("--budgets", default="0.3,0.4,0.5,0.75", help="budgets b, fractions of the 16-bit KV bytes")
    kv.add_argument("--json", default=None, help="write the rows as JSON here")
    kv.add_argument("--plot", default=None, help="write a PNG plot here")
    kv.add_argument("--int4", choices=("auto", "yes", "no"), default="auto",
                    help="INT4 tier: auto = the probe's (cached) verdict")
    kv.add_argument("--cache-dir", default=None, help="probe verdict cache (default: hybridmoe's cache, kv-probe/)")
    kv.add_argument("--prefix-tokens", type=int, default=512, help="prefix of each perplexity window (compressed)")
    kv.add_argument("--continuation-tokens", type=int, default=64, help="teacher-forced tokens per window")
    kv.add_argument("--windows", type=int, default=8, help="perplexity windows")
    kv.add_argument("--text", default=None, help="text file for perplexity (default: Python stdlib docstrings)")
    kv.add_argument("--passkey-tokens", type=int, default=1024, help="passkey prompt length")
    kv.add_argument("--depths", type=int, default=10, help="passkey needle depths, evenly 0.05-0.95")
    kv.add_argument("--bench-tokens", type=int, default=4096, help="prompt tokens of the pack/unpack timing")
    kv.set_defaults(func=run_kv)
    parser.set_defaults(func=lambda args: parser.print_help() or 2)


def _harness(model: str):
    from hybridmoe.checkpoint.default_model import resolve_model_dir
    from hybridmoe.commands._kv_eval import KVHarness

    return KVHarness(resolve_model_dir(model))


def probe_verdict(harness, tokens: int = 1024, cache_dir=None, force: bool = False, log=print):
    """The cached verdict for harness's model, or a fresh probe (then cached)."""
    from hybridmoe.commands._kv_eval import probe_trials
    from hybridmoe.kv.probe import PROBE_BUDGET, ProbeVerdict, VerdictCache, decide

    cache = VerdictCache(cache_dir)
    verdict = None if force else cache.get(harness.fingerprint)
    if verdict is not None:
        log(f"cached verdict for model {harness.fingerprint}: {verdict.label} ({sum(verdict.successes)}/3 trials "
            f"passed) in {cache.path(harness.fingerprint)}")
        return verdict
    successes = probe_trials(harness, tokens, PROBE_BUDGET)
    verdict = ProbeVerdict(harness.fingerprint, decide(successes), successes, PROBE_BUDGET,
                           tokens, str(harness.model_dir))
    path = cache.put(verdict)
    log(f"model {harness.fingerprint}: {sum(successes)}/{len(successes)} needle trials passed at b = "
        f"{PROBE_BUDGET} with INT4 -> {verdict.label} (cached in {path})")
    return verdict


def run_probe(args) -> int:
    probe_verdict(_harness(args.model), args.tokens, args.cache_dir, args.force)
    return 0


def run_kv(args) -> int:
    from hybridmoe.commands import _kv_eval
    from hybridmoe.kv.allocation import LADDER_2, LADDER_3, TIER_NAMES

    budgets = [float(b) for b in args.budgets.split(",") if b.strip()]
    if not budgets or any(not 0 < b <= 1 for b in budgets):
        raise ValueError(f"--budgets: fractions in (0, 1], got {args.budgets!r}")
    harness = _harness(args.model)
    if args.int4 == "auto":
        verdict = probe_verdict(harness, cache_dir=args.cache_dir)
        int4, harness.int4_verdict = verdict.int4_allowed, verdict.label
    else:
        int4, harness.int4_verdict = args.int4 == "yes", f"int4-{'allowed' if args.int4 == 'yes' else 'refused'}-by-flag"
    ladder = LADDER_3 if int4 else LADDER_2
    print(f"model {harness.model_dir} ({harness.layout.kind}, fingerprint {harness.fingerprint}); ladder "
          f"{'/'.join(TIER_NAMES[t] for t in ladder)}; full tier {harness.full_dtype}")
    text = Path(args.text).read_text() if args.text else None
    start = time.perf_counter()
    rows = _kv_eval.evaluate(harness, budgets, ladder, prefix_tokens=args.prefix_tokens,
                             continuation_tokens=args.continuation_tokens, windows=args.windows,
                             passkey_tokens=args.passkey_tokens, depths=args.depths, text=text)
    rates = [_kv_eval.bench_pack(harness, args.bench_tokens, b, ladder) for b in (0.3, 0.5)]
    print(f"\n{'method':<22}{'b':>6}{'ppl':>9}{'dppl %':>9}{'passkey':>9}{'payload B':>11}{'real b':>8}")
    for r in rows:
        print(f"{r['method']:<22}{r['budget']:>6.2f}{r['ppl']:>9.3f}{r['ppl_delta_pct']:>+9.2f}"
              f"{r['passkey_acc']:>9.0%}{r['payload_bytes']:>11}{r['payload_fraction']:>8.3f}")
    for r in rates:
        print(f"pack/unpack of {r['tokens']} tokens at b = {r['budget']}: {r['payload_bytes']} payload bytes, "
              f"pack {r['pack_gbps']} GB/s, unpack {r['unpack_gbps']} GB/s (16-bit KV bytes per second)")
    print(f"({time.perf_counter() - start:.0f} s)")
    if args.json:
        report = _kv_eval.json_rows(args.model, harness.layout.kind, [TIER_NAMES[t] for t in ladder], rows, rates)
        Path(args.json).write_text(json.dumps(report, indent=1) + "\n")
    if args.plot:
        _kv_eval.plot(rows, args.plot, f"SpectrumKV on {harness.model_dir.name} ({harness.layout.kind})")
    return 0
