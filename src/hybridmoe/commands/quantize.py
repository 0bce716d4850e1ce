"""`hybridmoe quantize [--model DIR] --to int4|int8 [--group 32|128] [--lm-head int8|int4|keep] --out DIR2
[--experts-only] [--overwrite]`:
weights -> int4 or int8 per group for the CPU kernels, as llama.cpp's q4_0/q8_0 files do (default model: the
embedded demo model).

Reads BF16/FP16/FP32 or FP8 (block-scaled, dequantised exactly) weights from a checkpoint directory and writes a copy in
which every projection is replaced by its int codes under the same name (int4: uint8 [N, Kp/2], two codes per byte;
int8: int8 [N, Kp]; layout in hybridmoe.kernels.formats) plus `<name>_scale` (bfloat16/float16 [N, Kp/g]): the routed
experts (`...experts.N.{gate,up,down}_proj.weight`, Mixtral's `w1/w3/w2`) and, unless --experts-only, attention
projections, dense and shared-expert MLPs and the LM head. The LM head is written in int8 by default even for --to int4:
its error goes straight into every logit, and it is one matrix (llama.cpp's k-quant mixes likewise keep the output
tensor at 6-8 bits). `--lm-head int4` trades that for speed: the LM head is the largest matrix a decode step reads
(Qwen3-30B-A3B in int4: 331 of about 1,900 MB a token in int8, 175 in int4), at the perplexity cost MODEL_CARD.md
reports; `--lm-head keep` leaves it at its precision. Embeddings, norms, routers (their choice of experts is sensitive
and they are small) and MLA's kv_b_proj (absorbed per head into the query and the output) stay as they are, like
everything else, copied shard by shard. config.json gains `expert_quantization` = {"method", "group_size",
"scale_dtype", "layout", "scope": "all" | "experts"}. The copy is written next to DIR2 and moved into place when
complete, its files readable as the umask allows; an existing DIR2 is replaced only with --overwrite (and only when it
is a model directory or empty).

Afterwards it reports the output error of a sample of experts and of other projections, computed by the CPU
kernels from the written int weights, against the source weights in float64 on random sample activations.

Legend: N output rows, K input columns, Kp K padded to whole groups, g group size, H hidden, I intermediate.
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import tempfile
from pathlib import Path

import torch

EXPERT_WEIGHT = re.compile(r"^(?P<prefix>.*\.experts\.\d+)\.(?P<proj>gate_proj|up_proj|down_proj|w1|w3|w2)\.weight$")
GATE_UP_DOWN = {"gate_proj": 0, "up_proj": 1, "down_proj": 2, "w1": 0, "w3": 1, "w2": 2}
# every other projection a Linear multiplies (attention, dense and shared MLPs): not routers, not MLA's kv_b_proj
PROJECTION_WEIGHT = re.compile(r"^(?!.*\.experts\.)(?!.*kv_b_proj).*_proj(_with_mqa)?\.weight$")
LM_HEAD = "lm_head.weight"
INT_SCALE_SUFFIX = "_scale"
LAYOUT = "hybridmoe-int-v1"
SCALE_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16}


def register(subparsers) -> None:
    p = subparsers.add_parser("quantize", help="convert a model's projections to int4/int8 for the CPU kernels")
    p.add_argument("--model", default="demo",
                   help="source checkpoint directory (BF16/FP16/FP32 or FP8), or demo (the default): the embedded "
                        "demo model")
    p.add_argument("--to", required=True, choices=("int4", "int8"), help="target format (the LM head: --lm-head)")
    p.add_argument("--group", type=int, default=32, choices=(32, 128), help="columns per scale (default 32)")
    p.add_argument("--scale-dtype", default="bfloat16", choices=tuple(SCALE_DTYPES), help="scale dtype")
    p.add_argument("--out", required=True, help="output checkpoint directory")
    p.add_argument("--samples", type=int, default=8, help="experts whose outputs are checked (default 8)")
    p.add_argument("--lm-head", default="int8", choices=("int8", "int4", "keep"),
                   help="the LM head's format (default int8, also under --to int4: every logit carries its error; "
                        "int4 reads half the bytes a decode step spends on it; keep: its stored precision)")
    p.add_argument("--experts-only", action="store_true",
                   help="quantise only the routed experts; attention, MLPs and the LM head keep their precision")
    p.add_argument("--overwrite", action="store_true", help="replace --out if it exists (a model directory)")
    p.set_defaults(func=run)


def expert_names(names: list[str]) -> dict[str, list[str]]:
    """prefix ("model.layers.3.mlp.experts.7") -> [gate, up, down] tensor names, for every complete expert."""
    experts: dict[str, list[str | None]] = {}
    for name in names:
        match = EXPERT_WEIGHT.match(name)
        if match:
            experts.setdefault(match["prefix"], [None, None, None])[GATE_UP_DOWN[match["proj"]]] = name
    return {prefix: triple for prefix, triple in experts.items() if None not in triple}


def projection_names(names: list[str], experts_only: bool, lm_head: str = "int8") -> dict[str, str]:
    """Every non-expert weight `quantize` converts -> its format: "" (the --to format) or, for the LM head, lm_head
    ("int8" | "int4"; "keep": the LM head is not converted); empty with --experts-only."""
    if experts_only:
        return {}
    return {name: lm_head if name == LM_HEAD else "" for name in names
            if PROJECTION_WEIGHT.match(name) or (name == LM_HEAD and lm_head != "keep")}


def source_weight(reader, name: str, block: tuple[int, int]) -> torch.Tensor:
    """A source weight as float32 (FP8 dequantised exactly with its block scales)."""
    from hybridmoe.checkpoint.fp8 import SCALE_SUFFIX, dequantize_fp8

    tensor = reader.get(name)
    if tensor.dtype == torch.float8_e4m3fn:
        if name + SCALE_SUFFIX not in reader:
            raise ValueError(f"FP8 tensor {name!r} has no {name + SCALE_SUFFIX!r}")
        return dequantize_fp8(tensor, reader.get(name + SCALE_SUFFIX), block, torch.float32)
    if not tensor.dtype.is_floating_point:
        raise ValueError(f"tensor {name!r} is {tensor.dtype}; expected float or FP8 expert weights "
                         "(already quantised?)")
    return tensor.float()


def run(args) -> int:
    from hybridmoe.checkpoint.default_model import resolve_model_dir
    from hybridmoe.checkpoint.fp8 import SCALE_SUFFIX
    from hybridmoe.checkpoint.safetensors_reader import CheckpointReader
    from hybridmoe.config import load_config

    src, dst = resolve_model_dir(args.model), Path(args.out)
    if src.resolve() == dst.resolve():
        raise ValueError(f"--out {dst} must differ from --model")
    _check_out(dst, args.overwrite)
    config = load_config(src)
    if config.raw.get("expert_quantization"):
        raise ValueError(f"{src}: experts are already quantised ({config.raw['expert_quantization']}); "
                         "quantize reads BF16/FP16/FP32 or FP8 experts")
    block = config.quantization.block_size if config.quantization else (128, 128)
    reader = CheckpointReader(src)
    experts = expert_names(reader.names())
    if not experts:
        raise ValueError(f"{src}: no routed-expert weights found (names like ...experts.N.gate_proj.weight)")
    targets = {name: args.to for triple in experts.values() for name in triple}
    projections = projection_names(reader.names(), args.experts_only, args.lm_head)
    targets.update({name: fmt or args.to for name, fmt in projections.items()})
    dst.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{dst.name}.partial-", dir=dst.parent))
    try:
        source_bytes, written_bytes, weight_map = _write_copy(reader, staging, targets, block, args, SCALE_SUFFIX)
        _write_metadata(src, staging, weight_map, args)
        _readable_as_umask_allows(staging)
        if dst.exists():
            shutil.rmtree(dst)  # _check_out allowed it: --overwrite of a model directory (or an empty one)
        staging.rename(dst)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    others = len(targets) - 3 * len(experts)
    print(f"wrote {dst}: {len(experts)} experts" + (f" and {others} other projections" if others else "")
          + f", {source_bytes / 2**20:.1f} MiB of weights -> {written_bytes / 2**20:.1f} MiB ({args.to}"
          + (f", LM head {targets[LM_HEAD]}" if targets.get(LM_HEAD, args.to) != args.to else "")
          + f", group {args.group}, {args.scale_dtype} scales)")
    _report_error(reader, CheckpointReader(dst), experts, targets, args, block)
    return 0


def _check_out(dst: Path, overwrite: bool) -> None:
    if not dst.exists():
        return
    if not dst.is_dir():
        raise ValueError(f"--out {dst} exists and is not a directory")
    if any(dst.iterdir()):
        if not overwrite:
            raise ValueError(f"--out {dst} already exists; pass --overwrite to replace it")
        if not (dst / "config.json").is_file():
            raise ValueError(f"--out {dst} is not a model directory (no config.json): not replacing it")


def _readable_as_umask_allows(directory: Path) -> None:
    """safetensors writes its files 0600 and mkdtemp makes its directory 0700: give them the modes of files the
    user's umask makes (0644 and 0755 under umask 022)."""
    umask = os.umask(0)
    os.umask(umask)
    directory.chmod(0o777 & ~umask)
    for item in directory.iterdir():
        item.chmod(0o666 & ~umask)


def _write_copy(reader, dst: Path, targets: dict[str, str], block, args,
                scale_suffix: str) -> tuple[int, int, dict[str, str]]:
    """Every shard of the source, the `targets` (name -> int4|int8) quantised, into dst; -> (source, written)
    bytes of the quantised weights and the weight map (tensor name -> file name)."""
    from rich.progress import Progress
    from safetensors.torch import save_file

    from hybridmoe.kernels import formats

    quantizers = {"int4": formats.quantize_int4, "int8": formats.quantize_int8}
    scale_dtype = SCALE_DTYPES[args.scale_dtype]
    by_file: dict[Path, list[str]] = {}
    for name in reader.names():
        by_file.setdefault(Path(reader.entry(name).file), []).append(name)
    weight_map: dict[str, str] = {}
    source_bytes = written_bytes = 0
    with Progress() as progress:
        task = progress.add_task(f"quantising to {args.to} (group {args.group})", total=len(targets))
        for file, names in by_file.items():
            tensors: dict[str, torch.Tensor] = {}
            for name in names:
                if name.endswith(scale_suffix) and name[: -len(scale_suffix)] in targets:
                    source_bytes += reader.entry(name).nbytes
                    continue  # the FP8 block scale of a quantised weight: replaced by the int group scales
                if name in targets:
                    source_bytes += reader.entry(name).nbytes
                    data, scales = quantizers[targets[name]](source_weight(reader, name, block), args.group,
                                                             scale_dtype)
                    tensors[name], tensors[name + INT_SCALE_SUFFIX] = data, scales
                    written_bytes += data.numel() * data.element_size() + scales.numel() * scales.element_size()
                    progress.advance(task)
                else:
                    tensors[name] = reader.get(name).clone()
            save_file(tensors, str(dst / file.name), metadata={"format": "pt"})
            weight_map.update({name: file.name for name in tensors})
    return source_bytes, written_bytes, weight_map


def _write_metadata(src: Path, dst: Path, weight_map: dict[str, str], args) -> None:
    index = src / "model.safetensors.index.json"
    if index.exists():
        meta = json.loads(index.read_text()).get("metadata", {})
        (dst / index.name).write_text(json.dumps({"metadata": meta, "weight_map": weight_map}, indent=2) + "\n")
    for item in src.iterdir():
        if item.is_file() and not item.name.endswith(".safetensors") and item.name not in (index.name, "config.json"):
            shutil.copy2(item, dst / item.name)
    raw = json.loads((src / "config.json").read_text())
    raw["expert_quantization"] = {"method": args.to, "group_size": args.group, "scale_dtype": args.scale_dtype,
                                  "layout": LAYOUT, "scope": "experts" if args.experts_only else "all"}
    (dst / "config.json").write_text(json.dumps(raw, indent=2) + "\n")


def expert_output_errors(source, written, experts: dict[str, list[str]], fmt: str, samples: int,
                         block: tuple[int, int], seed: int = 0) -> list[float]:
    """Relative error (max-norm) of each sampled expert's output: CPU kernels on the written int weights vs
    float64 on the source weights, for 16 random activation rows ~ N(0, 1)."""
    from hybridmoe.kernels.moe import FusedMoE
    from hybridmoe.kernels.reference import silu

    rng = random.Random(seed)
    picked = rng.sample(sorted(experts), min(samples, len(experts)))
    errors = []
    for prefix in picked:
        gate, up, down = (source_weight(source, name, block).double() for name in experts[prefix])
        x = torch.randn(16, gate.shape[1], generator=torch.Generator().manual_seed(rng.randrange(2**31)))
        ref = (silu(x.double() @ gate.T) * (x.double() @ up.T)) @ down.T  # [16, H]
        data = [written.get(name) for name in experts[prefix]]
        scales = [written.get(name + INT_SCALE_SUFFIX) for name in experts[prefix]]
        moe = FusedMoE(fmt, [data[0]], [data[1]], [data[2]], [scales[0]], [scales[1]], [scales[2]],
                       hidden_size=gate.shape[1], intermediate_size=gate.shape[0])
        out = moe(x, torch.zeros(16, 1, dtype=torch.int64), torch.ones(16, 1))
        errors.append(((out.double() - ref).abs().max() / ref.abs().max()).item())
    return errors


def projection_output_errors(source, written, names: list[str], samples: int, block: tuple[int, int],
                             seed: int = 0) -> list[float]:
    """Relative error (max-norm) of sampled projections: the kernels' Linear on the written int weights vs float64
    on the source weights, for 16 random activation rows ~ N(0, 1)."""
    from hybridmoe.layers.linear import Linear

    rng = random.Random(seed)
    errors = []
    for name in rng.sample(sorted(names), min(samples, len(names))):
        w = source_weight(source, name, block).double()
        x = torch.randn(16, w.shape[1], generator=torch.Generator().manual_seed(rng.randrange(2**31)))
        data, scales = written.get(name), written.get(name + INT_SCALE_SUFFIX)
        linear = Linear("int4" if data.dtype == torch.uint8 else "int8", data, scales, cols=w.shape[1])
        ref = x.double() @ w.T
        errors.append(((linear(x).double() - ref).abs().max() / ref.abs().max()).item())
    return errors


def _report_error(source, written, experts, targets, args, block) -> None:
    errors = expert_output_errors(source, written, experts, args.to, args.samples, block)
    print(f"expert output error vs source ({len(errors)} sampled experts, 16 random activations each, "
          f"max |out - ref| / max |ref|): mean {sum(errors) / len(errors):.4f}, max {max(errors):.4f}")
    expert_tensors = {name for triple in experts.values() for name in triple}
    others = [name for name in targets if name not in expert_tensors]
    if others:
        errors = projection_output_errors(source, written, others, args.samples, block)
        head = f", the LM head {targets[LM_HEAD]}" if LM_HEAD in targets else ""
        print(f"projection output error vs source ({len(errors)} sampled projections{head}): "
              f"mean {sum(errors) / len(errors):.4f}, max {max(errors):.4f}")
