"""Hardware profiles: what a CPU, an accelerator and the link between them can do, with where each number
came from.

A profile is a versioned JSON file. Every number is an object {"value": x, "source": "..."}: a datasheet
citation, a measurement (`hybridmoe profile` writes "measured: ..."), or a named assumption. Reference
profiles of machines we cannot run here ship in placement/data/hardware/ (one part each: a GPU with its host
link, or a CPU with its memory); a measured profile holds both parts of this machine. A `Machine` is a CPU
part plus an optional accelerator part and a GPU count (`machine("rtx5090,epyc-genoa-2s", gpus=2)`).

Measured profiles may carry tables (throughput against tokens T or context length) that the cost model
interpolates, and this engine's op tables for one model (op_tables.py); reference profiles give rooflines
(peak x efficiency).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

from hybridmoe.placement.op_tables import OpTables

SCHEMA = "hybridmoe-hardware-profile"
VERSION = 1
REFERENCE_PROFILES = ("rtx4090", "rtx5090", "h200", "xeon-spr-2s", "xeon-gnr-2s", "epyc-genoa-2s",
                      "epyc-turin-2s", "desktop-2ch")


class ProfileError(ValueError):
    """A hardware profile that cannot be used; the message names the file and the field."""


Table = tuple[tuple[float, float], ...]  # sorted (x, y) points


@dataclass(frozen=True)
class CpuSpec:
    name: str
    description: str
    cores: int
    memory_gb: float  # host memory capacity
    memory_read_gbs: float  # sustained read bandwidth, all sockets, NUMA-local
    stream_efficiency: float  # fraction of memory_read_gbs a weight-streaming kernel reaches
    peak_tflops: float  # dense bf16 (or fp32 where no bf16 units) arithmetic peak of the vector units
    matmul_efficiency: float  # fraction of peak_tflops a large GEMM reaches
    decode_gweights_s: dict[str, float]  # format -> weights/s the cores can unpack to fp32 (GEMV ceiling)
    dispatch_us: float | None = None  # fixed cost of one expert-kernel call and its hand-off (None: fitted)
    copy_slowdown: float | None = None  # CPU bandwidth left while PCIe copies run (None: derive)
    expert_table: dict[str, Table] = field(default_factory=dict)  # format -> (T, weight GB/s) measured
    attention_table: Table = ()  # (context, achieved TFLOP/s) measured
    op_tables: OpTables | None = None  # this engine's op times for one model's shapes (op_tables.py)
    sources: dict[str, str] = field(default_factory=dict, compare=False)


@dataclass(frozen=True)
class GpuSpec:
    name: str
    description: str
    memory_gb: float
    reserved_gb: float  # runtime context, allocator and fragmentation: not usable for the plan
    memory_gbs: float
    memory_efficiency: float
    peak_tflops: dict[str, float]  # compute key (fp32|bf16|fp8|int8) -> dense tensor peak
    matmul_efficiency: float
    h2d_gbs: float  # pinned host -> device, achieved
    d2h_gbs: float
    link_latency_us: float  # one small copy or kernel hand-off across the link
    p2p_gbs: float | None = None  # direct GPU<->GPU bandwidth (None: copies go through host memory)
    attention_efficiency: float | None = None  # of the bf16 peak (None: assume matmul_efficiency)
    stand_in: bool = False  # the CPU measured in place of an accelerator
    matmul_table: dict[str, Table] = field(default_factory=dict)  # key -> (T, achieved TFLOP/s)
    attention_table: Table = ()  # (context, achieved TFLOP/s)
    sources: dict[str, str] = field(default_factory=dict, compare=False)


@dataclass(frozen=True)
class Machine:
    name: str
    cpu: CpuSpec
    gpu: GpuSpec | None = None
    num_gpus: int = 1

    def __post_init__(self):
        if self.gpu is None and self.num_gpus not in (0, 1):
            raise ProfileError(f"machine {self.name}: {self.num_gpus} GPUs asked for but no GPU profile given")
        if self.gpu is not None and self.num_gpus < 1:
            raise ProfileError(f"machine {self.name}: num_gpus must be >= 1, got {self.num_gpus}")


# ---- reading ---------------------------------------------------------------------------------------------
class _Reader:
    def __init__(self, data: dict[str, Any], where: str, references: frozenset[str] = frozenset()):
        self.data, self.where, self.sources, self.references = data, where, {}, references

    def error(self, name: str, why: str) -> ProfileError:
        return ProfileError(f"{self.where}: field '{name}' {why}")

    def number(self, name: str, default: Any = ..., positive: bool = True) -> Any:
        if name not in self.data:
            if default is ...:
                raise self.error(name, "is missing")
            return default
        item = self.data[name]
        if not isinstance(item, dict) or "value" not in item or not str(item.get("source", "")).strip():
            raise self.error(name, 'must be {"value": number, "source": "where it came from"}')
        cited = str(item["source"]).split(":")[0].split()[0]
        if self.references and cited not in self.references and not cited.startswith("measured"):
            raise self.error(name, f"source {item['source']!r} must start with a reference id "
                                   f"({', '.join(sorted(self.references))}) or 'measured'")
        value = item["value"]
        if isinstance(value, bool) or not isinstance(value, (int, float)) or (positive and value <= 0):
            raise self.error(name, f"value must be a {'positive ' if positive else ''}number, got {value!r}")
        self.sources[name] = str(item["source"])
        return float(value)

    def numbers(self, name: str, default: Any = ...) -> dict[str, float]:
        if name not in self.data:
            if default is ...:
                raise self.error(name, "is missing")
            return default
        inner = _Reader(self.data[name] if isinstance(self.data[name], dict) else {}, f"{self.where}.{name}",
                        self.references)
        if not isinstance(self.data[name], dict) or not self.data[name]:
            raise self.error(name, "must be a non-empty object of {key: {value, source}}")
        out = {key: inner.number(key) for key in self.data[name]}
        self.sources.update({f"{name}.{k}": v for k, v in inner.sources.items()})
        return out

    def table(self, name: str) -> Table:
        rows = self.data.get(name, [])
        if not isinstance(rows, list) or not all(isinstance(r, list) and len(r) == 2 and all(
                isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0 for v in r) for r in rows):
            raise self.error(name, "must be a list of [x, y] pairs of positive numbers")
        if rows:
            self.sources[name] = str(self.data.get(f"{name}_source", "measured"))
        return tuple(sorted((float(x), float(y)) for x, y in rows))

    def tables(self, name: str) -> dict[str, Table]:
        raw = self.data.get(name, {})
        if not isinstance(raw, dict):
            raise self.error(name, "must be an object of {key: [[x, y], ...]}")
        inner = _Reader(raw, f"{self.where}.{name}")
        return {key: inner.table(key) for key in raw}


def _cpu(data: dict[str, Any], where: str, name: str, description: str, refs: frozenset[str]) -> CpuSpec:
    r = _Reader(data, where, refs)
    cpu = dict(
        name=name, description=description, cores=int(r.number("cores")), memory_gb=r.number("memory_gb"),
        memory_read_gbs=r.number("memory_read_gbs"), stream_efficiency=r.number("stream_efficiency"),
        peak_tflops=r.number("peak_tflops"), matmul_efficiency=r.number("matmul_efficiency"),
        decode_gweights_s=r.numbers("decode_gweights_s", {}),
        dispatch_us=r.number("dispatch_us", None), copy_slowdown=r.number("copy_slowdown", None),
        expert_table=r.tables("expert_table"), attention_table=r.table("attention_table"),
        op_tables=_op_tables(data, where))
    return CpuSpec(**cpu, sources=r.sources)


def _op_tables(data: dict[str, Any], where: str) -> OpTables | None:
    if "op_tables" not in data:
        return None
    try:
        return OpTables.from_json(data["op_tables"], f"{where}.op_tables")
    except ValueError as e:
        raise ProfileError(str(e)) from None


def _gpu(data: dict[str, Any], where: str, name: str, description: str, refs: frozenset[str]) -> GpuSpec:
    r = _Reader(data, where, refs)
    gpu = dict(
        name=name, description=description, memory_gb=r.number("memory_gb"),
        reserved_gb=r.number("reserved_gb"), memory_gbs=r.number("memory_gbs"),
        memory_efficiency=r.number("memory_efficiency"), peak_tflops=r.numbers("peak_tflops"),
        matmul_efficiency=r.number("matmul_efficiency"), h2d_gbs=r.number("h2d_gbs"),
        d2h_gbs=r.number("d2h_gbs"), link_latency_us=r.number("link_latency_us"),
        p2p_gbs=r.number("p2p_gbs", None),
        attention_efficiency=r.number("attention_efficiency", None), stand_in=bool(data.get("stand_in", False)),
        matmul_table=r.tables("matmul_table"), attention_table=r.table("attention_table"))
    return GpuSpec(**gpu, sources=r.sources)


@dataclass(frozen=True)
class Profile:
    name: str
    kind: str  # "cpu" | "gpu" | "machine"
    description: str
    cpu: CpuSpec | None
    gpu: GpuSpec | None
    references: dict[str, str]
    raw: dict[str, Any] = field(default_factory=dict, repr=False, compare=False)


def parse_profile(data: Any, where: str = "<profile>") -> Profile:
    """Validate and read a profile dictionary; raises ProfileError naming the field."""
    if not isinstance(data, dict):
        raise ProfileError(f"{where}: expected a JSON object")
    if data.get("schema") != SCHEMA:
        raise ProfileError(f"{where}: field 'schema' must be {SCHEMA!r}, got {data.get('schema')!r}")
    if data.get("version") != VERSION:
        raise ProfileError(f"{where}: field 'version' {data.get('version')!r} is not supported (this reader "
                           f"reads version {VERSION}); re-run `hybridmoe profile`")
    kind = data.get("kind")
    if kind not in ("cpu", "gpu", "machine"):
        raise ProfileError(f"{where}: field 'kind' must be cpu|gpu|machine, got {kind!r}")
    name = str(data.get("name") or Path(where).stem)
    description = str(data.get("description", ""))
    if kind in ("cpu", "machine") and not isinstance(data.get("cpu"), dict):
        raise ProfileError(f"{where}: a {kind} profile needs a 'cpu' object")
    if kind == "gpu" and not isinstance(data.get("gpu"), dict):
        raise ProfileError(f"{where}: a gpu profile needs a 'gpu' object")
    if kind == "machine" and data.get("gpu") is not None and not isinstance(data.get("gpu"), dict):
        raise ProfileError(f"{where}: field 'gpu' must be an object or null")
    references = data.get("references", {})
    if not isinstance(references, dict):
        raise ProfileError(f"{where}: field 'references' must be an object of id -> citation")
    refs = frozenset(references)
    cpu = _cpu(data["cpu"], f"{where}: cpu", name, description, refs) if kind in ("cpu", "machine") else None
    gpu = (_gpu(data["gpu"], f"{where}: gpu", name, description, refs)
           if isinstance(data.get("gpu"), dict) else None)
    return Profile(name, kind, description, cpu, gpu, {str(k): str(v) for k, v in references.items()}, data)


def load_profile(path: str | Path) -> Profile:
    path = Path(path)
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise ProfileError(f"{path}: no such profile file") from None
    except json.JSONDecodeError as e:
        raise ProfileError(f"{path}: invalid JSON ({e})") from None
    return parse_profile(data, str(path))


def reference_profile(name: str) -> Profile:
    key = name.strip().lower()
    if key not in REFERENCE_PROFILES:
        raise ProfileError(f"unknown hardware {name!r}; reference profiles: {', '.join(REFERENCE_PROFILES)} "
                           "(or the path of a profile JSON)")
    text = resources.files("hybridmoe.placement").joinpath(f"data/hardware/{key}.json").read_text()
    return parse_profile(json.loads(text), f"packaged:{key}.json")


def any_profile(name_or_path: str) -> Profile:
    path = Path(name_or_path)
    return load_profile(path) if path.suffix == ".json" or path.is_file() else reference_profile(name_or_path)


def machine(names: str, gpus: int | None = None) -> Machine:
    """A machine from comma-separated profile names or paths: one CPU part and at most one GPU part, or
    one measured machine profile (e.g. "rtx5090,epyc-genoa-2s", "profile.json")."""
    profiles = [any_profile(n) for n in names.split(",") if n.strip()]
    cpus = [p.cpu for p in profiles if p.cpu is not None]
    gpus_found = [p.gpu for p in profiles if p.gpu is not None]
    if len(cpus) != 1:
        raise ProfileError(f"hardware {names!r}: needs exactly one CPU part, found {len(cpus)} "
                           "(combine a GPU with a CPU profile, e.g. rtx5090,epyc-genoa-2s)")
    if len(gpus_found) > 1:
        raise ProfileError(f"hardware {names!r}: more than one GPU part; use --gpus N for several")
    gpu = gpus_found[0] if gpus_found else None
    count = (1 if gpu else 0) if gpus is None else gpus
    return Machine(name="+".join(p.name for p in profiles), cpu=cpus[0], gpu=gpu, num_gpus=count)


def profile_to_json(data: dict[str, Any], path: str | Path) -> None:
    """Write a profile dictionary after checking it reads back."""
    parse_profile(data, str(path))
    Path(path).write_text(json.dumps(data, indent=2) + "\n")
