"""Which CPUs each worker may run on: a list like "0-3,8" parsed and checked against this process's CPUs.

On a machine where prefill and decode compute on the same cores (the CPU stand-in; routed experts on the CPU
kernels), pinning the two workers to separate cores keeps the prefill's compute off the decode worker's cores:
the decoding users' TPOT no longer rises while a prompt prefills, and the prefill has fewer cores. A worker's
kernel pool and torch's threads take the size of its set (the pool sizes itself from the CPUs it may use).
"""

from __future__ import annotations

import os


def parse_cpu_list(text: str) -> list[int]:
    """"0-3,8" -> [0, 1, 2, 3, 8] (sorted, without repeats); ValueError naming the text when malformed."""
    cpus: set[int] = set()
    try:
        for part in text.split(","):
            part = part.strip()
            if "-" in part:
                lo, hi = (int(x) for x in part.split("-"))
                if lo > hi:
                    raise ValueError
                cpus.update(range(lo, hi + 1))
            else:
                cpus.add(int(part))
    except ValueError:
        raise ValueError(f"CPU list {text!r}: expected numbers and ranges like 0-3,8") from None
    if not cpus or min(cpus) < 0:
        raise ValueError(f"CPU list {text!r}: expected numbers and ranges like 0-3,8")
    return sorted(cpus)


def check_cpus(cpus: list[int] | str | None, what: str) -> list[int] | None:
    """cpus (a list, or its text) checked against the CPUs this process may use; None stays None."""
    if cpus is None:
        return None
    cpus = parse_cpu_list(cpus) if isinstance(cpus, str) else sorted(set(int(c) for c in cpus))
    allowed = os.sched_getaffinity(0)
    outside = [c for c in cpus if c not in allowed]
    if not cpus or outside:
        raise ValueError(f"{what}: CPUs {outside or cpus} are not among this process's CPUs {sorted(allowed)}")
    return cpus


def split_cpus(text: str, prefill_share: float) -> tuple[list[int], list[int]] | None:
    """(prefill CPUs, decode CPUs) for benchmarks' --split: "PREFILL:DECODE" lists; "auto": the first
    prefill_share of this process's CPUs (at least one) and the rest; "none", or auto on one CPU: None."""
    if text == "none":
        return None
    if text != "auto":
        if text.count(":") != 1:
            raise ValueError(f"--split {text!r}: expected auto, none or PREFILL_CPUS:DECODE_CPUS")
        prefill, decode = text.split(":")
        return parse_cpu_list(prefill), parse_cpu_list(decode)
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        return None
    cut = max(1, int(len(cpus) * prefill_share))
    return cpus[:cut], cpus[cut:]


def pin_to(cpus: list[int]) -> None:
    """This process (a worker, before it loads anything) on cpus, torch's threads as many."""
    import torch

    os.sched_setaffinity(0, cpus)
    torch.set_num_threads(len(cpus))
