"""Where `hybridmoe demo` (and the other commands, when no --model is given) find their model.

The trained demo model shipped in hybridmoe/assets/demo_model is the default; the name `demo` (`--model demo`,
`LLM("demo")`) means it too. `demo-gqa` names its companion in hybridmoe/assets/gqa_model, a Qwen3-MoE model (GQA
attention) trained the same way (MODEL_CARD.md). Without the demo model, a small
DeepSeek-V3-architecture model with deterministic random weights is generated once into the user cache
(HYBRIDMOE_CACHE, else $XDG_CACHE_HOME/hybridmoe, else ~/.cache/hybridmoe).
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

ASSET_DIR = Path(__file__).resolve().parent.parent / "assets" / "demo_model"
GQA_ASSET_DIR = ASSET_DIR.parent / "gqa_model"
RANDOM_MODEL_NAME = "random-deepseek-v3-v1"
RANDOM_MODEL_CONFIG = dict(
    vocab_size=1024, hidden_size=256, intermediate_size=512, moe_intermediate_size=128, num_hidden_layers=4,
    num_attention_heads=4, num_key_value_heads=4, n_routed_experts=16, num_experts_per_tok=4, n_group=4,
    topk_group=2, n_shared_experts=1, first_k_dense_replace=1, q_lora_rank=128, kv_lora_rank=128,
    qk_nope_head_dim=64, qk_rope_head_dim=64, v_head_dim=64, max_position_embeddings=4096,
)


DEMO_MODEL_NAME = "demo"
GQA_MODEL_NAME = "demo-gqa"


def resolve_model_dir(model: str | Path | None) -> Path:
    """A model argument -> its directory: None or `demo` is the embedded demo model (default_model_dir), `demo-gqa`
    its GQA companion, anything else a local model directory (./demo names a directory called demo)."""
    if model is None or (isinstance(model, str) and model == DEMO_MODEL_NAME):
        return default_model_dir()
    if isinstance(model, str) and model == GQA_MODEL_NAME:
        if not (GQA_ASSET_DIR / "config.json").is_file():
            raise FileNotFoundError(f"{GQA_MODEL_NAME}: this installation has no {GQA_ASSET_DIR}")
        return GQA_ASSET_DIR
    return Path(model)


def cache_dir() -> Path:
    if os.environ.get("HYBRIDMOE_CACHE"):
        return Path(os.environ["HYBRIDMOE_CACHE"])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "hybridmoe"


def default_model_dir() -> Path:
    """The shipped demo model if present, else the deterministic random model (generated on first use)."""
    if (ASSET_DIR / "config.json").is_file():
        return ASSET_DIR
    return random_model_dir()


def random_model_dir() -> Path:
    from hybridmoe.checkpoint.synthetic import save_tiny_model

    target = cache_dir() / RANDOM_MODEL_NAME
    if (target / "config.json").is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=RANDOM_MODEL_NAME + ".", dir=target.parent))
    save_tiny_model(staging, "deepseek_v3", seed=0, std=0.05, **RANDOM_MODEL_CONFIG)
    try:
        staging.rename(target)  # atomic: a concurrent first use sees a complete directory or none
    except OSError:  # another process finished first
        shutil.rmtree(staging, ignore_errors=True)
    return target
