"""Whether a model tolerates INT4 KV: the verdict of a needle-in-a-haystack probe, cached per model.

The probe (run by `hybridmoe eval kv-probe`) runs `TRIALS` needle trials with the prompt's KV compressed under
the three-tier ladder at b = 0.3; INT4 is allowed when at least `MIN_PASS` succeed, otherwise the ladder is
full precision + INT8. Verdicts are JSON files named by the model's fingerprint (a hash of its config and
weights) under hybridmoe's cache directory (~/.cache/hybridmoe/kv-probe; $HYBRIDMOE_CACHE moves it) or a directory given.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path

from hybridmoe.kv.allocation import LADDER_2, LADDER_3, Tier

TRIALS = 3
MIN_PASS = 2
PROBE_BUDGET = 0.3
FULL_HASH_LIMIT = 1 << 30  # weights up to 1 GiB are hashed whole; larger ones by samples
SAMPLES, SAMPLE_BYTES = 64, 1 << 20


def model_fingerprint(model_dir: str | Path) -> str:
    """sha256 (16 hex digits) of config.json and the weight files (whole up to 1 GiB in all, else each file's
    size and 64 evenly spaced 1 MiB samples)."""
    model_dir = Path(model_dir)
    digest = hashlib.sha256((model_dir / "config.json").read_bytes())
    files = sorted(model_dir.glob("*.safetensors"))
    whole = sum(f.stat().st_size for f in files) <= FULL_HASH_LIMIT
    for f in files:
        size = f.stat().st_size
        digest.update(f"{f.name}:{size}".encode())
        with f.open("rb") as fh:
            if whole:
                for block in iter(lambda: fh.read(1 << 22), b""):
                    digest.update(block)
            else:
                for i in range(SAMPLES):
                    fh.seek(i * max(0, size - SAMPLE_BYTES) // (SAMPLES - 1))
                    digest.update(fh.read(SAMPLE_BYTES))
    return digest.hexdigest()[:16]


def decide(successes: list[bool], min_pass: int = MIN_PASS) -> bool:
    """INT4 allowed when at least min_pass trials succeeded."""
    return sum(bool(s) for s in successes) >= min_pass


def ladder_for(int4_allowed: bool) -> tuple[Tier, ...]:
    return LADDER_3 if int4_allowed else LADDER_2


@dataclass
class ProbeVerdict:
    fingerprint: str
    int4_allowed: bool
    successes: list[bool]
    budget: float = PROBE_BUDGET
    prompt_tokens: int = 0
    model_dir: str = ""

    @property
    def label(self) -> str:
        return "int4-allowed" if self.int4_allowed else "int4-refused"


def default_cache_dir() -> Path:
    """$HYBRIDMOE_CACHE/kv-probe, else $XDG_CACHE_HOME/hybridmoe/kv-probe, else ~/.cache/hybridmoe/kv-probe
    (hybridmoe's cache directory, as checkpoint.default_model.cache_dir finds it)."""
    if os.environ.get("HYBRIDMOE_CACHE"):
        return Path(os.environ["HYBRIDMOE_CACHE"]) / "kv-probe"
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "hybridmoe" / "kv-probe"


class VerdictCache:
    def __init__(self, directory: str | Path | None = None):
        self.directory = Path(directory) if directory else default_cache_dir()

    def path(self, fingerprint: str) -> Path:
        return self.directory / f"{fingerprint}.json"

    def get(self, fingerprint: str) -> ProbeVerdict | None:
        path = self.path(fingerprint)
        if not path.exists():
            return None
        try:
            return ProbeVerdict(**json.loads(path.read_text()))
        except (ValueError, TypeError):
            return None  # unreadable: probe again

    def put(self, verdict: ProbeVerdict) -> Path:
        self.directory.mkdir(parents=True, exist_ok=True)
        path = self.path(verdict.fingerprint)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(asdict(verdict), indent=1))
        tmp.replace(path)
        return path
