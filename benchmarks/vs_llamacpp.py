"""Our engine against llama.cpp on one Qwen3-30B-A3B-shaped model, side by side in one run (issue 42; not run by CI).

    python benchmarks/vs_llamacpp.py [--layers 4] [--threads 2] [--rounds 3] [--prompt-tokens 512]
                                     [--decode-tokens 64] [--formats bf16,int8,int4,int4-head4] [--json PATH]

What it does, each step reused when its output is already there (under --cache, default
~/.cache/hybridmoe/vs-llamacpp, and --llama-venv, default ~/.cache/hybridmoe/llamacpp-venv):

1. llama.cpp: a venv of its own in which llama-cpp-python is built from its source distribution
   (`pip download --no-binary :all: llama-cpp-python`, then `pip install --no-binary llama-cpp-python SDIST` with
   CMAKE_ARGS="-DGGML_NATIVE=ON ...", CFLAGS=CXXFLAGS=--llama-cflags (default: no AMX, see NO_AMX below) and
   CMAKE_BUILD_PARALLEL_LEVEL=--build-jobs; the build's [n/m] steps are printed; a stamp in the venv records the
   sdist and flags, and other flags rebuild it), plus what llama.cpp's converter imports (its requirements file:
   transformers 4.57.6, numpy, sentencepiece, protobuf; torch of the same version as this venv's; gguf from the
   sdist's vendor/llama.cpp/gguf-py).
2. The model: `hybridmoe.bench.predicted_vs_measured.qwen_shaped_model` (real dimensions: hidden 2048, 128 experts,
   top-8, moe_intermediate 768, 32 heads, 4 KV heads, head_dim 128, vocab 151936; --layers layers; random bf16
   weights of std 0.02, so routing is near uniform: fine for speed), plus a tokenizer (below). Ours: that
   checkpoint as it is (bf16; compute dtype "auto"), and `hybridmoe quantize --to int8|int4 --group 32` copies of it
   (int4-head4: `--to int4 --lm-head int4`).
   llama.cpp's: its own converter, vendor/llama.cpp/convert_hf_to_gguf.py from the sdist, --outtype bf16 and
   q8_0, and q4_0 quantised from the bf16 GGUF by llama.cpp's `llama_model_quantize` (through llama-cpp-python's
   bindings; the build leaves llama.cpp's tools, llama-quantize among them, out), with llama.cpp's own q4_0 recipe
   (it keeps the output tensor at q6_K; our int4 keeps the LM head at int8), and q4_0 with the output tensor in
   q4_0 too (llama-quantize's `--output-tensor-type q4_0`) against our int4-head4: both engines then read the same
   bits per weight everywhere, the LM head included, so that pair compares the kernels alone. The LM head is most of
   a decode step's bytes in a 4-layer model (331 MB in int8 against 67 MB of int4 layers), far less in the real
   48-layer one (about 1,900 MB a token).
3. Side by side: for each format (bf16/int8/int4/int4-head4 against bf16/q8_0/q4_0/q4_0-output-q4_0), --rounds
   rounds, each round one run of each engine in a subprocess of its own (no shared memory, threads or allocator), the
   order flipping every round (ours, llama.cpp, llama.cpp, ours, ...) so that a drifting host meets both alike. A run
   puts the model's files in the page cache afresh (`warm_files`), loads the model, warms up on a prompt of the same
   length, then times the prefill of the same --prompt-tokens token ids (given as ids: the tokenizers do not matter)
   and --decode-tokens greedy decode steps after it (EOS ignored), --threads threads each (llama.cpp: n_threads =
   n_threads_batch, n_batch = n_ubatch = the prompt, its default float16 KV cache; ours: torch.set_num_threads,
   isa.configure_threads, HYBRIDMOE_NUM_THREADS, a --kv-cache-dtype KV cache, float16 by default as llama.cpp's).
   Prefill tok/s = prompt tokens / time to the first token; decode tok/s = decode steps / time from the first token
   to the last (each engine's own greedy pick included). The machine's read bandwidth (hybridmoe's probe,
   `_native.measure_read_bandwidth`, --threads threads over 4x the last-level cache, the best of a plain read and
   reads that prefetch 2 KB and 8 KB ahead) is measured before and after every run.
4. Bytes per decoded token, from each file's own tensor sizes: attention, norms, the router, top-k of the layer's
   experts (uniform expert sizes: the layer's expert bytes * k / E), the LM head, one embedding row, and the KV
   cache read at the mean decode context (2 bytes an element for both). Fraction of bandwidth = bytes/token *
   decode tok/s / the median of the probes beside that format's runs.
5. Our decode's time in the kernels: every run of ours has timers around its kernel calls (`layers.linear.matmul`,
   every projection, `layers.linear.LinearGroup`, q / k / v together, and `FusedMoE.submit` .. `wait` /
   `FusedMoE.__call__`, the routed experts; each includes its thin Python wrapper; 17 calls a decode step at 4
   layers, a few microseconds of timers in a step of 20-100 ms), and around the decode stack's run
   (`models.decode_stack`: every layer in one native call, attention, norms, RoPE and routing included; then 2 calls
   a step, the stack and the LM head), summed over the decode steps against the decode's wall time, median over the
   runs; the rest (sampling, the scheduler, Python; without the stack also attention, norms, RoPE and routing) is
   "outside the kernels".
6. The host: the development VM is shared, so each run also records, for prefill and decode apiece, how many CPUs'
   worth of time the rest of the machine was busy (/proc/stat less this process), its involuntary context
   switches and its major page faults. Cells are "median (best)" over the rounds: llama.cpp's decode, whose
   threads meet at a spinning barrier after every graph node, slows down several times over when another process
   takes one of the two CPUs; ours meets at the pool after every kernel call (17 a step at 4 layers; the decode
   stack makes them from C++).

The tokenizer: the random checkpoint has none, and llama.cpp's converter needs one it accepts as Qwen2's. This
script writes a real byte-level BPE of exactly the model's vocabulary (151936 ids) with `tokenizers`: GPT-2's byte
alphabet (256), every byte pair (65,536 merges), then byte-pair + byte merges until 151,643 regular tokens, and
Qwen's special tokens and added `<|extra_N|>` tokens for the remaining 293 ids; Qwen2's pre-tokenizer regex, NFC,
byte-level decoder. Synthetic merges rather than a trained tokenizer: nothing here has a corpus that yields 151k
merges, and any id the random model samples must decode in our engine and be a vocabulary entry in llama.cpp's
(padding the vocabulary with the converter's [PAD] tokens would leave ids our detokenizer does not know). The
converter identifies a BPE pre-tokenizer by a hash of its tokens on a test text, which only real vocabularies
match, so it runs with `get_vocab_base_pre` returning "qwen2" (the pre-tokenizer this tokenizer does use).

Internal subcommands (the script runs them in subprocesses; `_llama`, `_convert`, `_quantize_gguf` and
`_gguf_sizes` run in the llama.cpp venv): _ours MODEL, _llama GGUF, _convert, _quantize_gguf, _gguf_sizes.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import mmap
import os
import random
import re
import shutil
import statistics
import struct
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve()
SDIST_NAME = "llama-cpp-python"
# ours -> llama.cpp's format of the same bits per weight
PAIRS = {"bf16": "bf16", "int8": "q8_0", "int4": "q4_0", "int4-head4": "q4_0-output-q4_0"}
# `hybridmoe quantize` arguments of our formats
QUANTIZE = {"int8": ["--to", "int8"], "int4": ["--to", "int4"], "int4-head4": ["--to", "int4", "--lm-head", "int4"]}
ENGINES = ("ours", "llama.cpp")
# llama-cpp-python's own dependencies (its pyproject.toml): the build installs the package alone
SDIST_DEPENDENCIES = ("typing-extensions>=4.5.0", "numpy>=1.20.0", "diskcache>=5.6.1", "jinja2>=2.11.3")
CMAKE_ARGS = ("-DGGML_NATIVE=ON -DLLAVA_BUILD=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF "
              "-DLLAMA_BUILD_TOOLS=OFF -DLLAMA_BUILD_SERVER=OFF")
# llama.cpp's AMX path (its AMX buffer type, for q8_0/q4_0 2-D weights; bf16 weights and the experts' 3-D tensors
# never use it) dies with SIGILL at its first tileloadd, in ggml_backend_amx_mul_mat on the main thread, on the
# development VM (Xeon, family 6 model 207, KVM; llama-cpp-python 0.3.36), where our own AMX kernels run. llama.cpp
# PR #26954 (open when this was written) describes such crashes: a tile configuration the compiler drops from the
# stack, and the XTILEDATA permission requested on one thread only. So by default the build leaves AMX out
# (GCC's explicit -mno-* win over -march=native) and llama.cpp takes its AVX-512 paths (weight repacking, VNNI,
# BF16) in every format; --llama-cflags "" builds it with AMX.
NO_AMX = "-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
CONVERTER_REQUIREMENTS = ("transformers==4.57.6", "numpy~=2.2.6", "sentencepiece>=0.1.98,<0.3.0",
                          "protobuf>=4.21.0,<5.0.0")
VOCAB = 151936
REGULAR_TOKENS = 151643  # Qwen2's: <|endoftext|> is id 151643
QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|"
               r"\s*[\r\n]+|\s+(?!\S)|\s+")
RESULT = "RESULT "  # a worker's last line: RESULT {json}


# ---- pure pieces (tests/test_vs_llamacpp_script.py) ----------------------------------------------------------
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=4, help="layers of the Qwen3-30B-A3B-shaped model (default 4)")
    p.add_argument("--threads", type=int, default=2, help="threads of each engine (default 2)")
    p.add_argument("--rounds", type=int, default=3, help="runs of each engine per format, alternating (default 3)")
    p.add_argument("--prompt-tokens", type=int, default=512, help="prefill length (default 512)")
    p.add_argument("--decode-tokens", type=int, default=64, help="timed decode steps after the prefill (default 64)")
    p.add_argument("--formats", default=",".join(PAIRS),
                   help=f"ours, each against llama.cpp's equal: {', '.join(f'{a}/{b}' for a, b in PAIRS.items())}")
    p.add_argument("--cache", type=Path, default=None,
                   help="models and GGUFs (default ~/.cache/hybridmoe/vs-llamacpp)")
    p.add_argument("--llama-venv", type=Path, default=None,
                   help="llama-cpp-python's venv, built when missing (default ~/.cache/hybridmoe/llamacpp-venv)")
    p.add_argument("--build-jobs", type=int, default=2, help="parallel jobs of the llama.cpp build (default 2)")
    p.add_argument("--llama-cflags", default=NO_AMX,
                   help=f"CFLAGS/CXXFLAGS of the llama.cpp build (default {NO_AMX!r}: see NO_AMX); a venv built "
                        "with other flags is rebuilt")
    p.add_argument("--kv-cache-dtype", default="float16", choices=["auto", "bfloat16", "float16", "float32"],
                   help="our KV cache's dtype (default float16, llama.cpp's own default; auto: our compute dtype, "
                        "float32 on a CPU without bf16 units)")
    p.add_argument("--requantize", action="store_true",
                   help="rewrite our int8/int4 copies and the GGUFs even if present (after the engine changed)")
    p.add_argument("--no-kernel-timing", dest="kernel_timing", action="store_false",
                   help="no timers around our kernel calls (a few microseconds of a 50-100 ms decode step)")
    p.add_argument("--run-timeout", type=float, default=900.0, help="seconds one engine run may take (default 900)")
    p.add_argument("--json", type=Path, default=None, help="write the rows and every run's figures to PATH")
    args = p.parse_args(argv)
    args.formats = parse_formats(args.formats)
    for name in ("layers", "threads", "rounds", "prompt_tokens", "decode_tokens", "build_jobs"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    home = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "hybridmoe"
    args.cache = args.cache or home / "vs-llamacpp"
    args.llama_venv = args.llama_venv or home / "llamacpp-venv"
    return args


def parse_formats(text: str) -> list[str]:
    """'bf16,int4' -> ['bf16', 'int4'] (ours; each runs against PAIRS[ours]); unknown names are an error."""
    names = [f.strip() for f in text.split(",") if f.strip()]
    bad = [f for f in names if f not in PAIRS]
    if bad or not names:
        raise SystemExit(f"--formats: {', '.join(bad) or '(none)'} not among {', '.join(PAIRS)}")
    return list(dict.fromkeys(names))


def schedule(formats: list[str], rounds: int) -> list[tuple[str, int, str]]:
    """(format, round, engine) in run order: round after round, in each every format, in each both engines, the
    first engine flipping from one (round, format) to the next, so that each format sees ours, llama.cpp, llama.cpp,
    ours, ... over the rounds and a busy spell of the shared host falls on every format and both engines alike."""
    runs = []
    for r in range(rounds):
        for i, fmt in enumerate(formats):
            order = ENGINES if (r * len(formats) + i) % 2 == 0 else ENGINES[::-1]
            runs += [(fmt, r, engine) for engine in order]
    return runs


def prompt_ids(n: int, seed: int = 0, high: int = REGULAR_TOKENS) -> list[int]:
    """n token ids of regular (non-special) tokens, the same for both engines."""
    rng = random.Random(seed)
    return [rng.randrange(high) for _ in range(n)]


_HF_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
_GGUF_LAYER = re.compile(r"^blk\.(\d+)\.(.+)$")


def classify(name: str) -> tuple[str, int | None]:
    """A tensor's part of a decode step, Hugging Face (ours) or GGUF naming: (part, layer or None); parts:
    attention, norm, router, experts, lm_head, embedding, other."""
    m = _HF_LAYER.match(name)
    if m:
        layer, rest = int(m.group(1)), m.group(2)
        if rest.startswith("self_attn."):
            return ("norm" if "_norm." in rest else "attention"), layer
        if rest.endswith("layernorm.weight"):
            return "norm", layer
        if rest.startswith("mlp.experts."):
            return "experts", layer
        if rest.startswith("mlp.gate."):
            return "router", layer
        return "other", layer
    m = _GGUF_LAYER.match(name)
    if m:
        layer, rest = int(m.group(1)), m.group(2)
        if rest.startswith(("attn_norm.", "ffn_norm.", "attn_q_norm.", "attn_k_norm.")):
            return "norm", layer
        if rest.startswith("attn_"):
            return "attention", layer
        if rest.startswith(("ffn_gate_exps.", "ffn_up_exps.", "ffn_down_exps.")):
            return "experts", layer
        if rest.startswith("ffn_gate_inp."):
            return "router", layer
        return "other", layer
    if name.startswith(("lm_head.", "output.")):
        return "lm_head", None
    if name.startswith(("model.embed_tokens.", "token_embd.")):
        return "embedding", None
    if name.startswith(("model.norm.", "output_norm.")):
        return "norm", None
    return "other", None


def bytes_per_token(sizes: dict[str, int], num_experts: int, top_k: int, vocab: int,
                    kv_bytes: float = 0.0) -> dict[str, float]:
    """Bytes a decode step reads, by part, from {tensor name: bytes}: every non-expert weight once, k of a layer's
    E experts (experts of one layer are the same size), one embedding row, the KV cache read (given); 'total'."""
    parts = dict.fromkeys(("attention", "norm", "router", "experts", "lm_head", "embedding", "other"), 0.0)
    for name, nbytes in sizes.items():
        part, _ = classify(name)
        if part == "experts":
            parts[part] += nbytes * top_k / num_experts
        elif part == "embedding":
            parts[part] += nbytes / vocab
        else:
            parts[part] += nbytes
    parts["kv_cache"] = float(kv_bytes)
    parts["total"] = sum(parts.values())
    return parts


def kv_bytes_per_token(layers: int, kv_heads: int, head_dim: int, context: float, element_bytes: int = 2) -> float:
    """K and V of every cached token, every layer, read once per decode step at `context` cached tokens."""
    return 2.0 * layers * kv_heads * head_dim * element_bytes * context


def bandwidth_fraction(bytes_per_tok: float, tok_s: float, bandwidth_gbs: float) -> float:
    return bytes_per_tok * tok_s / (bandwidth_gbs * 1e9)


def safetensors_sizes(model_dir: Path) -> dict[str, int]:
    """{tensor name: bytes} from the safetensors headers of a model directory (no tensor is read)."""
    sizes = {}
    for f in sorted(Path(model_dir).glob("*.safetensors")):
        with open(f, "rb") as fh:
            (n,) = struct.unpack("<Q", fh.read(8))
            header = json.loads(fh.read(n))
        for name, meta in header.items():
            if name != "__metadata__":
                begin, end = meta["data_offsets"]
                sizes[name] = end - begin
    return sizes


def agreeing_prefix(a: list[int], b: list[int]) -> int:
    """How many tokens two greedy generations share from the start."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def summarize(runs: list[dict], probes: dict[str, list[float]], bytes_tok: dict[tuple[str, str], float],
              kernel_fraction: dict[str, float]) -> list[dict]:
    """One row per (format, engine) over its runs: the median and the best of prefill and decode tok/s, ours over
    llama.cpp's of each, GB per token, the fraction of bandwidth (the median decode over the median probe beside
    the format's runs; the best decode over the best probe), the median of the CPUs the rest of the machine kept
    busy during decode, and our decode's fraction in the kernels."""
    speeds = {}
    for fmt in dict.fromkeys(r["format"] for r in runs):
        for engine in ENGINES:
            mine = [r for r in runs if r["format"] == fmt and r["engine"] == engine]
            if mine:
                speeds[fmt, engine] = mine
    rows = []
    for (fmt, engine), mine in speeds.items():
        row = {"format": fmt, "engine": engine, "model_format": mine[0]["model_format"], "runs": len(mine)}
        for phase in ("prefill", "decode"):
            values = [r[f"{phase}_tok_s"] for r in mine]
            row[f"{phase}_tok_s"], row[f"{phase}_best"] = median(values), max(values)
        others = [r["decode_host"]["others_cpus"] for r in mine if r.get("decode_host")]
        row["others_cpus_decode"] = median([v for v in others if v is not None]) if others else None
        row["bandwidth_gbs"], row["bandwidth_best"] = median(probes.get(fmt, [])), max(probes.get(fmt, [0.0]))
        rows.append(row)
    for row in rows:
        pair = {r["engine"]: r for r in rows if r["format"] == row["format"]}
        ours, theirs = pair.get("ours"), pair.get("llama.cpp")
        for key in ("prefill_tok_s", "prefill_best", "decode_tok_s", "decode_best"):
            row[key.replace("tok_s", "ratio").replace("best", "ratio_best")] = (
                ours[key] / theirs[key] if ours and theirs else None)
        b = bytes_tok.get((row["format"], row["engine"]))
        if b is not None:
            row["gb_per_token"] = b / 1e9
            row["bandwidth_fraction"] = bandwidth_fraction(b, row["decode_tok_s"], row["bandwidth_gbs"])
            row["bandwidth_fraction_best"] = (bandwidth_fraction(b, row["decode_best"], row["bandwidth_best"])
                                              if row["bandwidth_best"] > 0 else None)
        if row["engine"] == "ours" and row["format"] in kernel_fraction:
            row["decode_kernel_fraction"] = kernel_fraction[row["format"]]
    return rows


def format_table(rows: list[dict]) -> str:
    """A markdown table; a cell of two figures is "median (best)" over the runs."""
    head = ("format", "engine", "prefill tok/s", "decode tok/s", "ours/llama.cpp prefill", "ours/llama.cpp decode",
            "GB/token", "of bandwidth", "others' CPUs in decode", "decode in kernels")

    def f(v, spec):
        return "-" if v is None else format(v, spec)

    def two(row, a, b, spec):
        return f"{f(row.get(a), spec)} ({f(row.get(b), spec)})" if row.get(a) is not None else "-"

    lines = [" | ".join(head), " | ".join("---" for _ in head)]
    for r in rows:
        lines.append(" | ".join((
            r["format"], f"{r['engine']} ({r['model_format']})", two(r, "prefill_tok_s", "prefill_best", ".1f"),
            two(r, "decode_tok_s", "decode_best", ".2f"), two(r, "prefill_ratio", "prefill_ratio_best", ".2f"),
            two(r, "decode_ratio", "decode_ratio_best", ".2f"), f(r.get("gb_per_token"), ".3f"),
            two(r, "bandwidth_fraction", "bandwidth_fraction_best", ".2f"), f(r.get("others_cpus_decode"), ".2f"),
            f(r.get("decode_kernel_fraction"), ".2f"))))
    return "\n".join("| " + line + " |" for line in lines)


def parse_result(stdout: str) -> dict:
    """The worker's RESULT line (its last one)."""
    for line in reversed(stdout.splitlines()):
        if line.startswith(RESULT):
            return json.loads(line[len(RESULT):])
    raise RuntimeError("the run printed no RESULT line; its output ends:\n" + stdout[-3000:])


# ---- helpers -------------------------------------------------------------------------------------------
def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def run(cmd: list, timeout: float, env: dict | None = None, echo: bool = False, progress=None) -> str:
    """Run cmd, return its stdout+stderr; kill it after `timeout` seconds; raise with its tail on failure. echo:
    print every line; progress: a function of each line that returns what to print (or None)."""
    import threading

    log("$ " + " ".join(str(c) for c in cmd))
    proc = subprocess.Popen([str(c) for c in cmd], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, **(env or {})}, bufsize=1)
    killed = threading.Event()

    def kill():
        killed.set()
        proc.kill()

    timer = threading.Timer(timeout, kill)
    timer.start()
    out = []
    try:
        for line in proc.stdout:
            out.append(line)
            shown = line.rstrip() if echo else (progress(line) if progress else None)
            if shown:
                print("    " + shown[:300], flush=True)
        proc.wait()
    finally:
        timer.cancel()
    text = "".join(out)
    if killed.is_set():
        raise RuntimeError(f"timed out after {timeout:.0f} s: {' '.join(map(str, cmd))}\n" + text[-3000:])
    if proc.returncode:
        raise RuntimeError(f"exit status {proc.returncode}: {' '.join(map(str, cmd))}\n" + text[-4000:])
    return text


def every(seconds: float, wanted):
    """A progress filter: lines for which wanted(line) holds, at most one per `seconds`."""
    last = [-seconds]

    def show(line: str):
        if wanted(line) and time.monotonic() - last[0] >= seconds:
            last[0] = time.monotonic()
            return line.strip()
        return None
    return show


MADV_POPULATE_READ = 22  # Linux 5.14+; Python's mmap module does not name it


def warm_files(paths: list[Path]) -> float:
    """Put the files in the page cache afresh, as a fault through a mapping advised for huge pages reads them (what
    hybridmoe's CheckpointReader does on a cold start); seconds taken. The cached pages are dropped first: pages
    already cached keep the size they got when they came in (the converter's writes, earlier runs), and 4 KB pages
    read mid-size weights a third slower than 2 MB ones on the AMX host (docs/benchmarks.md, "The page cache's
    pages"), which made the same code measure 0.81 or 0.90 of the bandwidth by what ran before it. Both engines'
    files are warmed so."""
    start = time.perf_counter()
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            if hasattr(os, "posix_fadvise"):  # pages another process maps stay; none does between runs
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            if os.fstat(fd).st_size == 0:
                continue
            with mmap.mmap(fd, 0, access=mmap.ACCESS_READ) as mapped:
                with contextlib.suppress(AttributeError, OSError):
                    mapped.madvise(mmap.MADV_HUGEPAGE)
                try:
                    mapped.madvise(MADV_POPULATE_READ)
                except OSError:  # an older kernel: fault every page
                    for i in range(0, len(mapped), mmap.PAGESIZE):
                        mapped[i]
        finally:
            os.close(fd)
    return time.perf_counter() - start


class Snapshot:
    """What the host did around a timed phase: wall clock, this process's CPU time (all its threads), the whole
    machine's busy CPU time (/proc/stat), this process's involuntary context switches and major page faults."""

    def __init__(self, wall: float, own_cpu: float, busy_cpu: float, preempted: int, major_faults: int):
        self.wall, self.own_cpu, self.busy_cpu = wall, own_cpu, busy_cpu
        self.preempted, self.major_faults = preempted, major_faults

    @classmethod
    def take(cls) -> "Snapshot":
        import resource

        u = resource.getrusage(resource.RUSAGE_SELF)
        return cls(time.perf_counter(), u.ru_utime + u.ru_stime, busy_cpu_s(), u.ru_nivcsw, u.ru_majflt)

    def since(self, before: "Snapshot") -> dict:
        """others_cpus: CPUs' worth of time the rest of the machine was busy during the phase (the engine's
        threads compete with it: 0 on a quiet machine); preempted: the process's involuntary context switches;
        major_faults: pages read from disk (none when the weights stayed in the page cache)."""
        wall = self.wall - before.wall
        own = self.own_cpu - before.own_cpu
        others = (self.busy_cpu - before.busy_cpu) - own
        return {"wall_s": wall, "own_cpus": own / wall if wall > 0 else None,
                "others_cpus": max(0.0, others) / wall if wall > 0 else None,
                "preempted": self.preempted - before.preempted,
                "major_faults": self.major_faults - before.major_faults}


def busy_cpu_s() -> float:
    """Seconds of busy CPU time of the whole machine since boot (/proc/stat: all but idle and iowait; NaN where
    there is no /proc/stat)."""
    try:
        with open("/proc/stat") as f:
            fields = [int(v) for v in f.readline().split()[1:]]
    except (OSError, ValueError):
        return float("nan")
    busy = sum(fields[:8]) - fields[3] - fields[4]  # user nice system idle iowait irq softirq steal
    return busy / os.sysconf("SC_CLK_TCK")


def dir_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in Path(path).rglob("*") if f.is_file())


# ---- 1. llama.cpp's venv ---------------------------------------------------------------------------------
def llama_python(venv: Path) -> Path:
    return venv / "bin" / "python"


def sdist_dir(cache: Path) -> Path:
    """The unpacked llama-cpp-python sdist (downloaded once): vendor/llama.cpp holds the converter."""
    src = cache / "llamacpp-src"
    found = sorted(d for d in src.glob("llama_cpp_python-*") if d.is_dir()) if src.is_dir() else []
    if found:
        return found[-1]
    src.mkdir(parents=True, exist_ok=True)
    run([sys.executable, "-m", "pip", "download", "--no-binary", ":all:", "--no-deps", "-d", src, SDIST_NAME], 900,
        echo=True)
    tarball = sorted(src.glob("llama_cpp_python-*.tar.gz"))[-1]
    shutil.unpack_archive(str(tarball), str(src))
    return sorted(d for d in src.glob("llama_cpp_python-*") if d.is_dir())[-1]


def build_env(cflags: str, jobs: int) -> dict[str, str]:
    return {"CMAKE_ARGS": CMAKE_ARGS, "CFLAGS": cflags, "CXXFLAGS": cflags, "CMAKE_BUILD_PARALLEL_LEVEL": str(jobs)}


def ensure_llama_venv(venv: Path, sdist: Path, jobs: int, cflags: str = NO_AMX) -> dict:
    """llama-cpp-python built from its sdist plus the converter's imports, in `venv` (rebuilt when the sdist or the
    build flags differ from the stamp of the last build); returns what was done."""
    py = llama_python(venv)
    env = build_env(cflags, jobs)
    wanted = {"sdist": sdist.name, "CMAKE_ARGS": env["CMAKE_ARGS"], "CFLAGS": cflags}
    stamp = venv / "hybridmoe-llamacpp-build.json"
    done = {"venv": str(venv), **wanted}
    if not py.exists():
        run([sys.executable, "-m", "venv", venv], 300)
    probe = subprocess.run([str(py), "-c", "import llama_cpp, sys; print(llama_cpp.__version__)"],
                           capture_output=True, text=True)
    built = json.loads(stamp.read_text()) if stamp.is_file() else None
    if probe.returncode != 0 or built != wanted:
        log(f"building llama-cpp-python from {sdist.name} ({jobs} jobs, CMAKE_ARGS={CMAKE_ARGS}, CFLAGS={cflags}); "
            "this takes a while (33 min on the 2-vCPU VM)")
        tarballs = sorted(sdist.parent.glob(sdist.name + ".tar.gz"))
        start = time.monotonic()
        steps = re.compile(r"^\s*\[(\d+)/(\d+)\]")
        last = [0.0]

        def progress(line: str):
            m = steps.match(line)
            if m and (time.monotonic() - last[0] > 20 or m.group(1) == m.group(2)):
                last[0] = time.monotonic()
                return f"build step {m.group(1)}/{m.group(2)} ({time.monotonic() - start:.0f} s)"
            return None

        run([py, "-m", "pip", "install", "-v", "--force-reinstall", "--no-deps", "--no-binary", SDIST_NAME,
             tarballs[-1] if tarballs else sdist], 4 * 3600, env=env, progress=progress)
        run([py, "-m", "pip", "install", *SDIST_DEPENDENCIES], 600)
        stamp.write_text(json.dumps(wanted, indent=2) + "\n")
        done["build_s"] = time.monotonic() - start
        log(f"llama-cpp-python built in {done['build_s']:.0f} s")
    probe = subprocess.run([str(py), "-c", "import transformers, torch, gguf, sentencepiece"],
                           capture_output=True, text=True)
    if probe.returncode != 0:
        import torch  # this venv's torch version, CPU wheels where pip finds them

        run([py, "-m", "pip", "install", f"torch=={torch.__version__.split('+')[0]}", *CONVERTER_REQUIREMENTS,
             sdist / "vendor" / "llama.cpp" / "gguf-py"], 1800, echo=False)
    done["llama_cpp_version"] = subprocess.run(
        [str(py), "-c", "import llama_cpp; print(llama_cpp.__version__)"], capture_output=True, text=True,
        check=True).stdout.strip()
    return done


# ---- 2. models -------------------------------------------------------------------------------------------
def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character map of byte-level BPE."""
    bs = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs)))


def synthetic_bpe(vocab_size: int = VOCAB, regular: int = REGULAR_TOKENS):
    """(vocab {token: id}, merges [(a, b)], specials [str]) of a byte-level BPE with `regular` regular tokens
    (bytes, every byte pair, byte pair + byte) and vocab_size - regular special tokens (see the docstring)."""
    b2u = bytes_to_unicode()
    order = sorted(range(256), key=lambda b: (not chr(b).isalpha(), not chr(b).isalnum(), b != 32, b))
    syms = [b2u[b] for b in order]
    vocab = {b2u[b]: b for b in range(256)}
    merges = []
    for a in syms:
        for b in syms:
            if len(vocab) >= regular:
                break
            merges.append((a, b))
            vocab[a + b] = len(vocab)
    pairs = [a + b for a in syms for b in syms]
    i = 0
    while len(vocab) < regular:
        p, c = pairs[i // 256], syms[i % 256]
        i += 1
        merges.append((p, c))
        vocab[p + c] = len(vocab)
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    specials += [f"<|extra_{j}|>" for j in range(vocab_size - regular - len(specials))]
    return vocab, merges, specials


def write_tokenizer(model_dir: Path) -> None:
    """tokenizer.json + tokenizer_config.json of synthetic_bpe() into model_dir."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers

    vocab, merges, specials = synthetic_bpe()
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN2_SPLIT), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in specials])
    assert tok.get_vocab_size() == VOCAB, tok.get_vocab_size()
    tok.save(str(model_dir / "tokenizer.json"))
    (model_dir / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|endoftext|>", "pad_token": "<|endoftext|>",
        "bos_token": None, "model_max_length": 131072, "clean_up_tokenization_spaces": False}, indent=2))


def ensure_models(args, llama_py: Path, sdist: Path) -> dict[str, dict[str, Path]]:
    """{ours format: {"ours": checkpoint dir, "llama.cpp": gguf}} for args.formats, made when missing."""
    from hybridmoe.bench.predicted_vs_measured import qwen_shaped_model

    args.cache.mkdir(parents=True, exist_ok=True)
    free = shutil.disk_usage(args.cache).free
    log(f"{free / 1e9:.0f} GB free under {args.cache} (at 4 layers: the bf16 checkpoint 6.2 GB, each engine's "
        "four formats 13.6-14.0 GB)")
    base = qwen_shaped_model(args.layers, args.cache)
    if not (base / "tokenizer.json").is_file():
        log("writing the tokenizer (byte-level BPE, 151936 ids)")
        write_tokenizer(base)
    cli = Path(sys.executable).parent / "hybridmoe"
    models: dict[str, dict[str, Path]] = {}
    gguf_dir = args.cache / "gguf"
    gguf_dir.mkdir(exist_ok=True)
    for fmt in args.formats:
        ours = base if fmt == "bf16" else base.parent / f"{base.name}-{fmt}-g32"
        if fmt != "bf16" and (args.requantize or not (ours / "config.json").is_file()):
            run([cli, "quantize", "--model", base, *QUANTIZE[fmt], "--group", "32", "--out", ours, "--overwrite"],
                7200, echo=True)
        gguf = gguf_dir / f"{base.name}-{PAIRS[fmt]}.gguf"
        if args.requantize or not gguf.is_file():
            if PAIRS[fmt] in ("bf16", "q8_0"):
                run([llama_py, HERE, "_convert", "--llama-cpp", sdist / "vendor" / "llama.cpp", "--model", base,
                     "--outtype", PAIRS[fmt], "--out", gguf], 7200,
                    progress=every(30, lambda line: "Writing" in line or "INFO:hf-to-gguf:Model" in line))
            else:
                source = gguf_dir / f"{base.name}-bf16.gguf"
                if not source.is_file():
                    run([llama_py, HERE, "_convert", "--llama-cpp", sdist / "vendor" / "llama.cpp", "--model", base,
                         "--outtype", "bf16", "--out", source], 7200)
                run([llama_py, HERE, "_quantize_gguf", source, gguf, PAIRS[fmt], "--threads", str(args.threads)], 7200)
        models[fmt] = {"ours": ours, "llama.cpp": gguf}
        log(f"{fmt}: ours {ours} ({dir_bytes(ours) / 1e9:.2f} GB), llama.cpp {gguf.name} "
            f"({gguf.stat().st_size / 1e9:.2f} GB)")
    return models


# ---- 3. the runs -----------------------------------------------------------------------------------------
class Probe:
    """hybridmoe's read-bandwidth probe on `threads` threads over 4x the last-level cache (at least 1 GiB);
    the buffer is allocated per probe so that it does not hold memory while the engines run."""

    def __init__(self, threads: int):
        from hybridmoe.kernels import isa

        isa.configure_threads(threads)
        from hybridmoe.profiling.timing import last_level_cache_bytes

        self.nbytes = max(1 << 30, 4 * last_level_cache_bytes())

    def gbs(self, passes: int = 3) -> float:
        import numpy as np

        from hybridmoe.kernels import _native

        buf = np.ones(self.nbytes // 8, dtype=np.uint64)
        try:
            return _native.measure_read_bandwidth(buf, passes) / 1e9
        finally:
            del buf


def engine_run(args, engine: str, model: Path, llama_py: Path, prompt_file: Path, kernel_timing: bool = False) -> dict:
    env = {"OMP_NUM_THREADS": str(args.threads), "HYBRIDMOE_NUM_THREADS": str(args.threads)}
    common = ["--threads", args.threads, "--prompt", prompt_file, "--decode-tokens", args.decode_tokens]
    if engine == "ours":
        cmd = [sys.executable, HERE, "_ours", model, *common, "--kv-cache-dtype", args.kv_cache_dtype] + (
            ["--kernel-timing"] if kernel_timing else [])
    else:
        cmd = [llama_py, HERE, "_llama", model, *common]
    return parse_result(run(cmd, args.run_timeout, env=env))


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    started = time.monotonic()
    sdist = sdist_dir(args.cache)
    venv = ensure_llama_venv(args.llama_venv, sdist, args.build_jobs, args.llama_cflags)
    llama_py = llama_python(args.llama_venv)
    models = ensure_models(args, llama_py, sdist)
    prompt_file = args.cache / f"prompt-{args.prompt_tokens}.json"
    prompt_file.write_text(json.dumps(prompt_ids(args.prompt_tokens)))

    from hybridmoe.config import load_config

    config = load_config(models[args.formats[0]]["ours"])
    moe = config.moe
    kv = kv_bytes_per_token(config.num_layers, config.attention.num_kv_heads,
                            config.attention.head_dim, args.prompt_tokens + args.decode_tokens / 2)
    bytes_tok, parts = {}, {}
    for fmt in args.formats:
        for engine in ENGINES:
            if engine == "ours":
                sizes = safetensors_sizes(models[fmt]["ours"])
            else:
                sizes = json.loads(run([llama_py, HERE, "_gguf_sizes", models[fmt]["llama.cpp"]], 600).splitlines()[-1])
            b = bytes_per_token(sizes, moe.num_experts, moe.num_experts_per_tok, config.vocab_size, kv)
            bytes_tok[(fmt, engine)] = b["total"]
            parts[f"{fmt} {engine}"] = b

    probe = Probe(args.threads)
    probes: dict[str, list[float]] = {}
    runs: list[dict] = []
    machine = machine_info()
    log(f"machine: {machine['cpu']}, {machine['cpus']} CPUs; {args.threads} threads per engine")
    for fmt, rnd, engine in schedule(args.formats, args.rounds):
        probes.setdefault(fmt, []).append(probe.gbs())
        log(f"{fmt} round {rnd + 1}/{args.rounds}: {engine} (probe {probes[fmt][-1]:.1f} GB/s, load "
            f"{os.getloadavg()[0]:.1f})")
        result = engine_run(args, engine, models[fmt][engine], llama_py, prompt_file,
                            kernel_timing=args.kernel_timing)
        result.update(format=fmt, round=rnd, engine=engine, load_average=os.getloadavg()[0])
        runs.append(result)
        host = result["decode_host"]
        log(f"    prefill {result['prefill_tok_s']:.1f} tok/s, decode {result['decode_tok_s']:.2f} tok/s; during "
            f"decode the rest of the machine busy {host['others_cpus']:.2f} CPUs, {host['preempted']} preemptions, "
            f"{host['major_faults']} major page faults" + (
                f"; {result['kernel_timing']['fraction']:.2f} of decode in kernel calls "
                f"({result['kernel_timing']['calls_per_step']:.0f} a step)" if "kernel_timing" in result else ""))
    kernel = {fmt: median([r["kernel_timing"]["fraction"] for r in runs
                           if r["format"] == fmt and "kernel_timing" in r]) for fmt in args.formats}
    kernel = {fmt: v for fmt, v in kernel.items() if v == v}
    rows = summarize(runs, probes, bytes_tok, kernel)
    agree = {fmt: agreeing_prefix(*[next(r["tokens"] for r in runs if (r["format"], r["engine"]) == (fmt, e))
                                    for e in ENGINES]) for fmt in args.formats}
    print()
    print(format_table(rows))
    print("greedy tokens, ours and llama.cpp alike from the start: " +
          ", ".join(f"{fmt} {n} of {args.decode_tokens + 1}" for fmt, n in agree.items()))
    print(f"\n{machine['cpu']}, {args.threads} threads per engine, {args.layers} layers, prompt {args.prompt_tokens}, "
          f"{args.decode_tokens} decode steps; cells: median (best) of {args.rounds} alternating runs; probes GB/s: "
          +
          "; ".join(f"{f} {min(v):.1f}-{max(v):.1f}" for f, v in probes.items()) +
          f"; {time.monotonic() - started:.0f} s in all")
    if args.json:
        args.json.write_text(json.dumps({
            "command": " ".join([Path(sys.argv[0]).name] + (argv if argv is not None else sys.argv[1:])),
            "machine": machine, "llama_cpp": venv, "threads": args.threads, "layers": args.layers,
            "prompt_tokens": args.prompt_tokens, "decode_tokens": args.decode_tokens, "rows": rows, "runs": runs,
            "greedy_tokens_agreeing": agree, "probes_gbs": probes,
            "bytes_per_token_parts": parts,
            "models": {f: {e: str(p) for e, p in m.items()} for f, m in models.items()}}, indent=2) + "\n")
    return 0


def machine_info() -> dict:
    cpu = "unknown"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    commit = subprocess.run(["git", "-C", str(HERE.parent), "describe", "--always", "--dirty"], capture_output=True,
                            text=True).stdout.strip() or None
    return {"cpu": cpu, "cpus": os.cpu_count(), "load_average": os.getloadavg(), "hybridmoe_commit": commit}


# ---- workers (subprocesses) ----------------------------------------------------------------------------
def _worker_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    p.add_argument("model", type=Path)
    p.add_argument("--threads", type=int, required=True)
    p.add_argument("--prompt", type=Path, required=True)
    p.add_argument("--decode-tokens", type=int, required=True)
    p.add_argument("--kernel-timing", action="store_true")
    p.add_argument("--kv-cache-dtype", default="auto")
    return p.parse_args(argv)


def _instrument_kernels(state: dict) -> list[str]:
    """Timers around our kernel calls (see the docstring); returns what was wrapped. state: on, kernel_s, calls."""
    import hybridmoe.layers.linear as linear
    from hybridmoe.kernels import moe as kmoe

    clock = time.perf_counter
    wrapped = []
    pending: dict[int, float] = {}

    def timed(fn):
        def call(*a, **k):
            if not state["on"]:
                return fn(*a, **k)
            t = clock()
            try:
                return fn(*a, **k)
            finally:
                state["kernel_s"] += clock() - t
                state["calls"] += 1
        return call

    if hasattr(linear, "matmul"):
        linear.matmul = timed(linear.matmul)
        wrapped.append("layers.linear.matmul")
    if hasattr(linear, "LinearGroup"):  # q / k / v in one call
        linear.LinearGroup.__call__ = timed(linear.LinearGroup.__call__)
        wrapped.append("layers.linear.LinearGroup.__call__")
    fused = kmoe.FusedMoE
    fused.__call__ = timed(fused.__call__)
    submit, wait = fused.submit, fused.wait

    def timed_submit(self, *a, **k):
        t = clock()
        handle = submit(self, *a, **k)
        if state["on"]:
            pending[id(handle)] = t
        return handle

    def timed_wait(self, handle, *a, **k):
        try:
            return wait(self, handle, *a, **k)
        finally:
            t = pending.pop(id(handle), None)
            if t is not None:
                state["kernel_s"] += clock() - t
                state["calls"] += 1

    fused.submit, fused.wait = timed_submit, timed_wait
    wrapped += ["kernels.moe.FusedMoE.__call__", "kernels.moe.FusedMoE.submit..wait"]
    try:  # a decode step's layers in one native call
        from hybridmoe.models.decode_stack import DecodeStack
    except ImportError:
        return wrapped
    DecodeStack.run = timed(DecodeStack.run)
    return wrapped + ["models.decode_stack.DecodeStack.run"]


def worker_ours(argv: list[str]) -> int:
    a = _worker_args(argv)
    os.environ["HYBRIDMOE_NUM_THREADS"] = str(a.threads)
    import torch

    torch.set_num_threads(a.threads)
    from hybridmoe.kernels import isa

    isa.configure_threads(a.threads)
    state = {"on": False, "kernel_s": 0.0, "calls": 0}
    wrapped = _instrument_kernels(state) if a.kernel_timing else []
    from hybridmoe.models.loader import resolve_dtype
    from hybridmoe.runtime.engine import EngineConfig, LLMEngine
    from hybridmoe.runtime.sampling_params import SamplingParams

    prompt = json.loads(a.prompt.read_text())
    warm_s = warm_files(sorted(a.model.glob("*.safetensors")))
    t = time.perf_counter()
    engine = LLMEngine(a.model, EngineConfig(dtype="auto", kv_cache_gb=0.25, kv_cache_dtype=a.kv_cache_dtype,
                                             enable_prefix_caching=False,
                                             max_num_batched_tokens=max(2048, len(prompt))), show_progress=False)
    load_s = time.perf_counter() - t

    def generate(ids: list[int], steps: int) -> dict:
        params = SamplingParams(temperature=0.0, max_tokens=steps + 1, ignore_eos=True)
        start = time.perf_counter()
        engine.add_request(ids, params)
        first, tokens = None, []
        marks = [Snapshot.take()]
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.new_token_ids and first is None:
                    first = time.perf_counter()
                    marks.append(Snapshot.take())
                    state.update(kernel_s=0.0, calls=0, on=a.kernel_timing)
                tokens = out.token_ids
        end = time.perf_counter()
        marks.append(Snapshot.take())
        state["on"] = False
        return {"prefill_s": first - start, "decode_s": end - first, "tokens": list(tokens),
                "prefill_host": marks[1].since(marks[0]), "decode_host": marks[2].since(marks[1])}

    warm = [(i * 7919 + 13) % REGULAR_TOKENS for i in range(len(prompt))]  # a different prompt, the same length
    generate(warm, 4)
    r = generate(prompt, a.decode_tokens)
    steps = len(r["tokens"]) - 1
    result = {"engine": "ours", "model_format": _our_format(a.model), "prompt_tokens": len(prompt),
              "decode_steps": steps, "prefill_s": r["prefill_s"], "decode_s": r["decode_s"],
              "prefill_tok_s": len(prompt) / r["prefill_s"], "decode_tok_s": steps / r["decode_s"],
              "load_s": load_s, "warm_files_s": warm_s, "prefill_host": r["prefill_host"],
              "decode_host": r["decode_host"], "tokens": r["tokens"],
              "torch_threads": torch.get_num_threads(), "dtype": str(resolve_dtype("auto")),
              "kv_cache_dtype": str(engine.runner.kv_dtype)}
    if a.kernel_timing:
        result["kernel_timing"] = {"wrapped": wrapped, "kernel_s": state["kernel_s"], "decode_s": r["decode_s"],
                                   "fraction": state["kernel_s"] / r["decode_s"],
                                   "calls_per_step": state["calls"] / max(steps, 1)}
    print(RESULT + json.dumps(result), flush=True)
    return 0


def _our_format(model: Path) -> str:
    q = json.loads((model / "config.json").read_text()).get("expert_quantization")
    if not q:
        return "bf16"
    head = ""
    if q.get("scope") == "all":  # the LM head's own format (--lm-head), where it is not the model's
        import torch

        from hybridmoe.checkpoint.safetensors_reader import CheckpointReader

        reader = CheckpointReader(model)
        if "lm_head.weight" in reader:
            dtype = reader.entry("lm_head.weight").dtype
            stored = {torch.uint8: "int4", torch.int8: "int8"}.get(dtype, str(dtype).removeprefix("torch."))
            head = f", LM head {stored}" if stored != q.get("method") else ""
    return f"{q.get('method')} g{q.get('group_size')} {q.get('scope', 'experts')}{head}"


def _gguf_format(gguf: Path) -> str:
    """The llama.cpp format a GGUF of this script's was written in (its name ends with it: PAIRS' values)."""
    return next(f for f in sorted(PAIRS.values(), key=len, reverse=True) if gguf.stem.endswith("-" + f))


def worker_llama(argv: list[str]) -> int:
    a = _worker_args(argv)
    import numpy as np
    import llama_cpp
    from llama_cpp import Llama

    prompt = json.loads(a.prompt.read_text())
    warm_s = warm_files([a.model])
    t = time.perf_counter()
    n = len(prompt)
    llm = Llama(model_path=str(a.model), n_ctx=n + a.decode_tokens + 16, n_threads=a.threads,
                n_threads_batch=a.threads, n_batch=n, n_ubatch=n, logits_all=False, verbose=False)
    load_s = time.perf_counter() - t
    ctx = llm._ctx.ctx
    n_vocab = llm.n_vocab()

    def greedy() -> int:
        logits = np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(ctx, -1), shape=(n_vocab,))
        return int(np.argmax(logits))

    def generate(ids: list[int], steps: int) -> dict:
        llm.reset()
        marks = [Snapshot.take()]
        start = time.perf_counter()
        llm.eval(ids)
        tok = greedy()
        first = time.perf_counter()
        marks.append(Snapshot.take())
        tokens = [tok]
        for _ in range(steps):
            llm.eval([tok])
            tok = greedy()
            tokens.append(tok)
        end = time.perf_counter()
        marks.append(Snapshot.take())
        return {"prefill_s": first - start, "decode_s": end - first, "tokens": tokens,
                "prefill_host": marks[1].since(marks[0]), "decode_host": marks[2].since(marks[1])}

    warm = [(i * 7919 + 13) % REGULAR_TOKENS for i in range(n)]
    generate(warm, 4)
    llama_cpp.llama_perf_context_reset(ctx)
    r = generate(prompt, a.decode_tokens)
    perf = llama_cpp.llama_perf_context(ctx)
    steps = len(r["tokens"]) - 1
    result = {"engine": "llama.cpp", "model_format": _gguf_format(a.model), "prompt_tokens": n,
              "decode_steps": steps, "prefill_s": r["prefill_s"], "decode_s": r["decode_s"],
              "prefill_tok_s": n / r["prefill_s"], "decode_tok_s": steps / r["decode_s"], "load_s": load_s,
              "warm_files_s": warm_s, "prefill_host": r["prefill_host"], "decode_host": r["decode_host"],
              "tokens": r["tokens"],
              "llama_cpp_version": llama_cpp.__version__,
              "llama_perf": {"t_p_eval_ms": perf.t_p_eval_ms, "n_p_eval": perf.n_p_eval,
                             "t_eval_ms": perf.t_eval_ms, "n_eval": perf.n_eval},
              "system_info": llama_cpp.llama_print_system_info().decode(errors="replace")}
    print(RESULT + json.dumps(result), flush=True)
    return 0


def worker_convert(argv: list[str]) -> int:
    """llama.cpp's convert_hf_to_gguf.py, its pre-tokenizer check answered with qwen2 (see the docstring)."""
    p = argparse.ArgumentParser()
    p.add_argument("--llama-cpp", type=Path, required=True)
    p.add_argument("--model", type=Path, required=True)
    p.add_argument("--outtype", required=True)
    p.add_argument("--out", type=Path, required=True)
    a = p.parse_args(argv)
    sys.path[:0] = [str(a.llama_cpp), str(a.llama_cpp / "gguf-py")]
    import convert_hf_to_gguf
    from conversion import base

    base.TextModel.get_vocab_base_pre = lambda self, tokenizer: "qwen2"
    tmp = a.out.with_suffix(".part")
    sys.argv = ["convert_hf_to_gguf.py", str(a.model), "--outtype", a.outtype, "--outfile", str(tmp)]
    convert_hf_to_gguf.main()
    tmp.rename(a.out)
    return 0


def worker_quantize_gguf(argv: list[str]) -> int:
    """llama.cpp's quantiser (llama_model_quantize through the bindings) with its default recipe for the type."""
    p = argparse.ArgumentParser()
    p.add_argument("source", type=Path)
    p.add_argument("out", type=Path)
    p.add_argument("type", choices=["q4_0", "q8_0", "q4_0-output-q4_0"])
    p.add_argument("--threads", type=int, default=2)
    a = p.parse_args(argv)
    import ctypes

    import llama_cpp

    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = {"q8_0": llama_cpp.LLAMA_FTYPE_MOSTLY_Q8_0}.get(a.type, llama_cpp.LLAMA_FTYPE_MOSTLY_Q4_0)
    if a.type == "q4_0-output-q4_0":  # llama-quantize --output-tensor-type q4_0
        params.output_tensor_type = llama_cpp.GGML_TYPE_Q4_0
    params.nthread = a.threads
    tmp = a.out.with_suffix(".part")
    rc = llama_cpp.llama_model_quantize(str(a.source).encode(), str(tmp).encode(), ctypes.byref(params))
    if rc != 0:
        raise SystemExit(f"llama_model_quantize returned {rc}")
    tmp.rename(a.out)
    return 0


def worker_gguf_sizes(argv: list[str]) -> int:
    from gguf import GGUFReader

    reader = GGUFReader(argv[0])
    print(json.dumps({t.name: int(t.n_bytes) for t in reader.tensors}))
    return 0


WORKERS = {"_ours": worker_ours, "_llama": worker_llama, "_convert": worker_convert,
           "_quantize_gguf": worker_quantize_gguf, "_gguf_sizes": worker_gguf_sizes}

if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] in WORKERS:
        sys.exit(WORKERS[sys.argv[1]](sys.argv[2:]))
    sys.exit(main())
