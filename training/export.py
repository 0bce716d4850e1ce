"""Write a trained model as the shipped Hugging Face directory (bf16 safetensors + tokenizer + recipe).

`export_model` saves through transformers' save_pretrained (which writes per-expert keys), adds (to a
DeepSeek-V3 model) the routing fields that transformers 5 leaves out (scoring_func, topk_method), copies the
tokenizer with its chat template (as chat_template.jinja and inside tokenizer_config.json, for readers of
either), and records the recipe. The router's e_score_correction_bias stays float32, as in DeepSeek-V3's
own checkpoints (in bf16 a rounded bias can change which experts a token picks); everything else is bf16.
`write_fp8_copy` makes the FP8 copy with the project's own converter.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from transformers import GenerationConfig

from recipe import CHAT_TEMPLATE_FILE, DATA_DIR, EOS_TOKEN

ROUTING_FIELDS = {"scoring_func": "sigmoid", "topk_method": "noaux_tc"}


def export_model(model, out_dir: Path, recipe: dict, tokenizer_dir: Path = DATA_DIR / "tokenizer") -> None:
    out_dir = Path(out_dir)
    if out_dir.exists():
        shutil.rmtree(out_dir)
    state_dtype = next(model.parameters()).dtype
    biases = {name: buffer.detach().float().cpu().clone() for name, buffer in model.named_buffers()
              if name.endswith("e_score_correction_bias")}
    model.to(torch.bfloat16)
    try:
        eos_id = model.config.eos_token_id
        model.generation_config = GenerationConfig(bos_token_id=model.config.bos_token_id, eos_token_id=eos_id,
                                                   pad_token_id=model.config.pad_token_id, do_sample=False)
        model.save_pretrained(out_dir, safe_serialization=True)
    finally:
        model.to(state_dtype)
    weights_path = out_dir / "model.safetensors"
    tensors = load_file(str(weights_path))
    missing = set(biases) - set(tensors)
    if missing:
        raise RuntimeError(f"save_pretrained wrote no {sorted(missing)[0]} into {weights_path}")
    tensors.update(biases)
    save_file(tensors, str(weights_path), metadata={"format": "pt"})
    config_path = out_dir / "config.json"
    config = json.loads(config_path.read_text())
    if config["model_type"] == "deepseek_v3":
        config.update(ROUTING_FIELDS)
    config_path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tokenizer_dir / name, out_dir / name)
    template = CHAT_TEMPLATE_FILE.read_text()
    (out_dir / "chat_template.jinja").write_text(template)
    tok_config_path = out_dir / "tokenizer_config.json"
    tok_config = json.loads(tok_config_path.read_text())
    tok_config.update(chat_template=template, add_bos_token=True, eos_token=EOS_TOKEN)
    tok_config_path.write_text(json.dumps(tok_config, indent=2, sort_keys=True) + "\n")
    (out_dir / "recipe.json").write_text(json.dumps(recipe, indent=2, sort_keys=True, default=str) + "\n")


def write_fp8_copy(bf16_dir: Path, fp8_dir: Path) -> None:
    """DeepSeek-V3's FP8 format (e4m3 + float32 scale per 128x128 block) via hybridmoe's converter."""
    from hybridmoe.checkpoint.fp8 import write_fp8_checkpoint

    if Path(fp8_dir).exists():
        shutil.rmtree(fp8_dir)
    write_fp8_checkpoint(bf16_dir, fp8_dir, block=(128, 128))


def main() -> None:
    """Re-export a run's final checkpoint (and its FP8 copy) without training again."""
    import argparse

    import data_stream
    from recipe import DEMO_MODEL_DIR, DEMO_MODEL_FP8_DIR, RUNS_DIR
    from train import build_model

    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("--run", default="demo")
    parser.add_argument("--out", type=Path, default=DEMO_MODEL_DIR)
    parser.add_argument("--fp8-out", type=Path, default=DEMO_MODEL_FP8_DIR)
    args = parser.parse_args()
    run_dir = RUNS_DIR / args.run
    state = torch.load(run_dir / "checkpoint.pt", map_location="cpu", weights_only=False)
    model = build_model(data_stream.load_tokenizer())
    model.load_state_dict(state["model"])
    record = json.loads((run_dir / "recipe.json").read_text())
    record.update(steps_trained=state["step"], tokens_seen=state["tokens_seen"],
                  parameters=sum(p.numel() for p in model.parameters()))
    export_model(model, args.out, record)
    write_fp8_copy(args.out, args.fp8_out)
    print(f"exported step {state['step']} to {args.out} and {args.fp8_out}")


if __name__ == "__main__":
    main()
