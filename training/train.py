"""Train the embedded demo model (DeepseekV3ForCausalLM) from scratch and export it.

CPU with one thread by default (the recipe's num_threads); a CUDA device is used when present. The run is
reproducible: a fixed seed drives initialisation and the batch stream, and checkpoints (every
checkpoint_every steps) hold model, optimiser and router-bias state, so --resume continues the same run.
Routing is balanced without an auxiliary loss, as in DeepSeek-V3: after each step every MoE layer's
e_score_correction_bias moves by router_bias_update_rate towards equal expert load.

A continuation names its source run in the variant (init_from: that run's final weights and router biases;
init_optimizer: its AdamW moments too). The shipped model's runs, in order: MODEL_CARD.md, Reproducing; e.g.
  .venv/bin/python training/train.py --variant passkey_long_answers_end --export src/hybridmoe/assets/demo_model
Every run exports into training/runs/<run>/export/ unless --export says otherwise.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from transformers import DeepseekV3Config, DeepseekV3ForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

import data_stream
import recipe
from export import export_model, write_fp8_copy
from recipe import ASSETS_DIR, BOS_TOKEN, EOS_TOKEN, MODEL_CONFIG, PAD_TOKEN, RUNS_DIR, SEED, TRAIN
from warm_start import warm_start_from_demo

FAMILIES = {"deepseek_v3": (DeepseekV3Config, DeepseekV3ForCausalLM), "qwen3_moe": (Qwen3MoeConfig, Qwen3MoeForCausalLM)}


def build_model(tokenizer) -> torch.nn.Module:
    torch.manual_seed(SEED)
    config_class, model_class = FAMILIES[TRAIN["family"]]
    config = config_class(**MODEL_CONFIG, bos_token_id=tokenizer.token_to_id(BOS_TOKEN),
                          eos_token_id=tokenizer.token_to_id(EOS_TOKEN), pad_token_id=tokenizer.token_to_id(PAD_TOKEN))
    config._attn_implementation = "sdpa"
    return model_class(config)


def build_optimizer(model: torch.nn.Module) -> torch.optim.AdamW:
    """AdamW with weight decay on the matrices only; the rate is set every step (learning_rate)."""
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    return torch.optim.AdamW([{"params": decay, "weight_decay": TRAIN["weight_decay"]},
                              {"params": no_decay, "weight_decay": 0.0}], lr=TRAIN["lr"], betas=TRAIN["betas"])


def initialise_from(source: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None) -> None:
    """Start a continuation from another run's checkpoint: its weights (router biases included) and, when an
    optimiser is given, its AdamW moments. A fresh optimiser's first steps (no second-moment estimate yet)
    cost every fresh-optimiser continuation part of the retrieval it started from (MODEL_CARD.md)."""
    state = torch.load(source, map_location=next(model.parameters()).device, weights_only=False)
    model.load_state_dict(state["model"])
    if optimizer is not None:
        optimizer.load_state_dict(state["optimizer"])


def recipe_record(steps: int) -> dict:
    names = ("SEED", "VOCAB_SIZE", "SPECIAL_TOKENS", "MODEL_CONFIG", "TRAIN", "TEXT_MIX", "PASSKEY_FILLER_MIX",
             "NUM_SYNTHETIC_CHATS", "HELDOUT_FRACTION", "FORTUNE_FILES_EXCLUDED")
    record = {name.lower(): getattr(recipe, name) for name in names}
    record["train"] = {**TRAIN, "steps": steps}
    record["torch"] = torch.__version__
    return record


def learning_rate(step: int, steps: int) -> float:
    """Warm-up, stable, decay (WSD): linear warm-up, constant peak, cosine to min_lr_ratio * lr in the last
    decay_fraction of the steps. Runs of different lengths share every step before their decay starts, so a
    stable-phase checkpoint resumed with a smaller --steps gives exactly the run a fresh one would."""
    peak, warmup = TRAIN["lr"], TRAIN["warmup_steps"]
    decay_start = int(steps * (1 - TRAIN["decay_fraction"]))
    if step < warmup:
        return peak * (step + 1) / warmup
    if step < decay_start:
        return peak
    progress = (step - decay_start) / max(1, steps - decay_start)
    return peak * (TRAIN["min_lr_ratio"] + (1 - TRAIN["min_lr_ratio"]) * 0.5 * (1 + math.cos(math.pi * progress)))


class RouterLoadBalancer:
    """Balances expert load in every MoE layer the way DeepSeek-V3 does, from forward hooks on the routers.

    Mainly without an auxiliary loss: after each step the correction bias of an overloaded expert goes down
    and that of an underloaded one up by `rate`. Plus DeepSeek-V3's complementary balance loss
    alpha * sum_i f_i * P_i (f_i: load relative to uniform, P_i: mean normalised score), here over the
    batch, which keeps this short run from collapsing onto one expert while the residual stream is young.
    A Qwen3-MoE router has no correction bias and scores by softmax: the loss alone balances it (Qwen's own
    load-balancing loss is this one over softmax scores).
    """

    def __init__(self, model: torch.nn.Module, rate: float, alpha: float):
        self.rate, self.alpha = rate, alpha
        self.gates = [layer.mlp.gate for layer in model.model.layers if hasattr(layer.mlp, "gate")]
        self.counts = [torch.zeros(g.num_experts) for g in self.gates]
        self.aux_losses: list[torch.Tensor] = []
        for index, gate in enumerate(self.gates):
            gate.register_forward_hook(self._hook(index))

    def _hook(self, index: int):
        def record(module, _inputs, output):
            router_logits, _, topk_indices = output  # [T, E], _, [T, K]
            load = torch.bincount(topk_indices.flatten(), minlength=module.num_experts).float()  # [E]
            self.counts[index] += load.cpu()
            if module.training and self.alpha > 0:
                biased = hasattr(module, "e_score_correction_bias")
                scores = router_logits.sigmoid() if biased else router_logits.softmax(-1)  # [T, E]
                mean_share = (scores / scores.sum(-1, keepdim=True)).mean(0)  # [E]
                relative_load = load * module.num_experts / topk_indices.numel()  # [E], 1 when uniform
                self.aux_losses.append(self.alpha * (relative_load * mean_share).sum())
        return record

    def take_aux_loss(self) -> torch.Tensor | float:
        total = sum(self.aux_losses) if self.aux_losses else 0.0
        self.aux_losses = []
        return total

    @torch.no_grad()
    def update(self) -> float:
        """Apply one bias step per layer; returns the worst max/mean expert load since the last update."""
        worst = 0.0
        for gate, counts in zip(self.gates, self.counts):
            mean = counts.mean()
            if hasattr(gate, "e_score_correction_bias"):
                gate.e_score_correction_bias += self.rate * torch.sign(mean - counts).to(gate.e_score_correction_bias.device)
            worst = max(worst, (counts.max() / mean.clamp(min=1)).item())
            counts.zero_()
        return worst


def weighted_loss(model, input_ids: torch.Tensor, weights: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """input_ids [B, T+1], weights [B, T] -> (weighted mean cross-entropy, per-target cross-entropy [B, T])."""
    logits = model(input_ids=input_ids[:, :-1]).logits.float()  # [B, T, V]
    token_loss = F.cross_entropy(logits.flatten(0, 1), input_ids[:, 1:].flatten(), reduction="none").view_as(weights)
    return (token_loss * weights).sum() / weights.sum(), token_loss.detach()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--run", default="demo", help="run name: checkpoints go to training/runs/<run>/")
    parser.add_argument("--steps", type=int, default=TRAIN["steps"])
    parser.add_argument("--resume", action="store_true", help="continue from training/runs/<run>/checkpoint.pt")
    parser.add_argument("--stop-after", type=int, default=None,
                        help="stop after this many steps of the --steps schedule (checkpoint saved, nothing exported)")
    parser.add_argument("--export", type=Path, default=None,
                        help="where the final model goes (default: training/runs/<run>/export/demo_model; the shipped "
                             "model: src/hybridmoe/assets/demo_model)")
    parser.add_argument("--variant", choices=sorted(recipe.VARIANTS), default=None,
                        help="train a recipe variant (recipe.VARIANTS) instead of the base (phased) recipe")
    args = parser.parse_args()
    if args.variant:
        recipe.apply_variant(args.variant)
        if args.run == "demo":
            args.run = args.variant
        if args.steps == parser.get_default("steps"):
            args.steps = TRAIN["steps"]
    if args.export is None:
        args.export = RUNS_DIR / args.run / "export" / "demo_model"

    torch.set_num_threads(TRAIN["num_threads"])
    random.seed(SEED)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    run_dir = RUNS_DIR / args.run
    run_dir.mkdir(parents=True, exist_ok=True)
    record = recipe_record(args.steps)
    (run_dir / "recipe.json").write_text(json.dumps(record, indent=2, default=str))

    tokenizer = data_stream.load_tokenizer()
    stream = data_stream.MixedBatches if TRAIN["stream"] == "mixed" else data_stream.TrainingBatches
    batches = iter(stream(tokenizer, data_stream.tokenize_split(tokenizer, "train"), TRAIN.get("stream_seed", SEED)))
    model = build_model(tokenizer).to(device)
    checkpoint_path = run_dir / "checkpoint.pt"
    optimizer = build_optimizer(model)
    if TRAIN.get("init_from") and not (args.resume and checkpoint_path.exists()):
        source = RUNS_DIR / TRAIN["init_from"] / "checkpoint.pt"
        with_moments = bool(TRAIN.get("init_optimizer"))
        initialise_from(source, model, optimizer if with_moments else None)
        print(f"initialised from {source}" + (" (weights and optimiser state)" if with_moments else ""), flush=True)
    elif TRAIN.get("warm_start") and not (args.resume and checkpoint_path.exists()):
        fresh = warm_start_from_demo(model, ASSETS_DIR / TRAIN["warm_start"])
        print(f"warm start from {ASSETS_DIR / TRAIN['warm_start']}; fresh: {len(fresh)} attention tensors", flush=True)
    balancer = RouterLoadBalancer(model, TRAIN["router_bias_update_rate"], TRAIN["balance_loss_alpha"])
    n_params = sum(p.numel() for p in model.parameters())
    print(f"parameters {n_params:,}  device {device}  steps {args.steps}", flush=True)

    start_step, tokens_seen = 0, 0
    if args.resume and checkpoint_path.exists():
        state = torch.load(checkpoint_path, map_location=device, weights_only=False)
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        start_step, tokens_seen = state["step"], state["tokens_seen"]
        for _ in range(start_step):
            next(batches)  # the stream is deterministic: skip what was already trained on
        if start_step > int(args.steps * (1 - TRAIN["decay_fraction"])):
            raise SystemExit(f"checkpoint step {start_step} is past the decay start of a {args.steps}-step run")
        print(f"resumed at step {start_step}", flush=True)

    model.train()
    started = time.time()
    window = {"text": [], "copy": [], "passkey": [], "answer": []}
    for step in range(start_step, min(args.steps, args.stop_after or args.steps)):
        batch = next(batches)
        kinds = batch[2] if len(batch) == 3 else None  # the mixed stream names each row's kind
        input_ids, weights = (t.to(device) for t in batch[:2])
        for group in optimizer.param_groups:
            group["lr"] = learning_rate(step, args.steps)
        loss, token_loss = weighted_loss(model, input_ids, weights)
        optimizer.zero_grad(set_to_none=True)
        (loss + balancer.take_aux_loss()).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), TRAIN["grad_clip"])
        optimizer.step()
        imbalance = balancer.update()
        tokens_seen += int((weights > 0).sum())
        if kinds is not None:
            for kind in ("text", "copy", "passkey"):
                rows = torch.tensor([k == kind for k in kinds], device=device)
                if rows.any():
                    picked = weights[rows] > 0
                    window[kind].append(token_loss[rows][picked].mean().item())
            answer = weights > 1  # passkey answer digits
            if answer.any():
                window["answer"].append(token_loss[answer].mean().item())
        elif (weights > 1).any():  # passkey examples
            window["passkey"].append(token_loss[weights > 0].mean().item())
            window["answer"].append(token_loss[weights > 1].mean().item())
        else:
            window["text"].append(token_loss.mean().item())
        if (step + 1) % 10 == 0:
            elapsed = time.time() - started
            mean = {k: sum(v) / len(v) if v else float("nan") for k, v in window.items()}
            print(f"step {step + 1:5d}  text {mean['text']:.3f}  copy {mean['copy']:.3f}  passkey {mean['passkey']:.3f}  "
                  f"answer {mean['answer']:.3f}  lr {learning_rate(step, args.steps):.2e}  "
                  f"load max/mean {imbalance:.2f}  tokens {tokens_seen:,}  {elapsed:.0f}s", flush=True)
            window = {k: [] for k in window}
        if (step + 1) % TRAIN["checkpoint_every"] == 0 or step + 1 in (args.steps, args.stop_after):
            torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(), "step": step + 1,
                        "tokens_seen": tokens_seen}, checkpoint_path.with_suffix(".tmp"))
            checkpoint_path.with_suffix(".tmp").replace(checkpoint_path)

    if args.stop_after is not None and args.stop_after < args.steps:
        print(f"stopped after step {args.stop_after} of {args.steps}; checkpoint in {run_dir}", flush=True)
        return
    # the shipped recipe.json describes the model, not this session (its time and resume point are in the log)
    record.update(steps_trained=args.steps, tokens_seen=tokens_seen, parameters=n_params)
    print(f"trained steps {start_step}-{args.steps} in {time.time() - started:.0f} s", flush=True)
    export_model(model.cpu(), args.export, record)
    if TRAIN["family"] != "deepseek_v3":  # the FP8 copy is the demo model's alone
        print(f"exported to {args.export}", flush=True)
        return
    fp8_dir = args.export.parent / (args.export.name + "_fp8")
    write_fp8_copy(args.export, fp8_dir)
    print(f"exported to {args.export} and {fp8_dir}", flush=True)


if __name__ == "__main__":
    main()
