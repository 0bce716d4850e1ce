"""Evaluate a shipped model (the demo model and its FP8 copy, or the GQA companion); writes a JSON report and prints
a summary.

Measured, all in float32 compute with transformers' model of the architecture (DeepseekV3ForCausalLM,
Qwen3MoeForCausalLM) as the reference:
  - held-out perplexity per source (fortunes, Python docs, chats), 512-token windows;
  - passkey retrieval accuracy (greedy, full KV cache) at 512, 1K and 2K tokens, classic and fortune filler;
  - greedy samples for text and chat prompts;
  - the FP8 copy's perplexity and passkey accuracy, its weights dequantised exactly per 128x128 block
    (transformers' own CPU FP8 path mis-sizes partial blocks);
  - when hybridmoe's engine imports, that it loads both directories and produces the same greedy tokens.
Run: .venv/bin/python training/evaluate.py [--trials 50]
     .venv/bin/python training/evaluate.py --model src/hybridmoe/assets/gqa_model --out training/results/eval_gqa.json
"""

from __future__ import annotations

import argparse
import json
import random
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, AutoTokenizer

import data_stream
import passkey
import sources
from recipe import DEMO_MODEL_DIR, DEMO_MODEL_FP8_DIR, EVAL, RESULTS_DIR

TEXT_PROMPTS = ["The Python interpreter", "A man was reading", "Love is", "The meaning of life is"]
CHAT_PROMPTS = [[{"role": "user", "content": "Tell me a fortune."}],
                [{"role": "user", "content": "What does math.sqrt do in Python?"}],
                [{"role": "user", "content": "Who are you?"}],
                [{"role": "user", "content": "Count from 3 to 9."}]]
HELDOUT_WINDOW = 512  # predicted tokens per held-out perplexity window


def load_float32(model_dir: Path) -> torch.nn.Module:
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="sdpa")
    return model.eval()


def load_fp8_dequantized(fp8_dir: Path) -> torch.nn.Module:
    """The FP8 copy with every block dequantised exactly (float32), loaded as a plain float32 model."""
    from hybridmoe.checkpoint.fp8 import dequantize_fp8

    config = json.loads((fp8_dir / "config.json").read_text())
    block = tuple(config.pop("quantization_config")["weight_block_size"])
    raw = load_file(str(fp8_dir / "model.safetensors"))
    weights = {}
    for name, tensor in raw.items():
        if name.endswith("_scale_inv"):
            continue
        scale = raw.get(name + "_scale_inv")
        weights[name] = dequantize_fp8(tensor, scale, block) if scale is not None else tensor.float()
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "config.json").write_text(json.dumps(config))
        save_file(weights, str(Path(tmp) / "model.safetensors"), metadata={"format": "pt"})
        return load_float32(Path(tmp))


def transformers_logits(model) -> Callable[[torch.Tensor], torch.Tensor]:
    """A transformers causal LM as heldout_perplexity's logits_of: ids [W] -> float32 logits [W, V]."""
    return lambda ids: model(input_ids=ids[None]).logits[0].float()


@torch.no_grad()
def heldout_perplexity(logits_of: Callable[[torch.Tensor], torch.Tensor], documents: dict[str, list[list[int]]],
                       window: int, max_tokens: int) -> dict:
    """Perplexity per source: its documents' tokens concatenated, the first max_tokens predicted, in consecutive
    windows of `window` predictions each starting from an empty context; logits_of(ids [W]) -> logits [W, V]
    (the next-token logits after each of the W ids; any model: transformers_logits, or an engine's)."""
    results = {}
    for source, docs in sorted(documents.items()):
        stream = [t for doc in docs for t in doc][: max_tokens + 1]
        total_nll, count = 0.0, 0
        for start in range(0, len(stream) - 1, window):
            ids = torch.tensor(stream[start: start + window + 1])  # [W+1]
            if ids.shape[0] < 2:
                break
            logits = logits_of(ids[:-1]).float()  # [W, V]
            nll = torch.nn.functional.cross_entropy(logits, ids[1:], reduction="sum")
            total_nll, count = total_nll + nll.item(), count + ids.shape[0] - 1
        results[source] = {"perplexity": round(float(torch.tensor(total_nll / count).exp()), 3), "tokens": count}
    return results


class ExpertLoad:
    """Counts the experts each MoE layer picks while it is attached (forward hooks on the routers)."""

    def __init__(self, model):
        gates = [layer.mlp.gate for layer in model.model.layers if hasattr(layer.mlp, "gate")]
        self.counts = [torch.zeros(g.num_experts) for g in gates]
        self.handles = [g.register_forward_hook(self._hook(i)) for i, g in enumerate(gates)]

    def _hook(self, index):
        def record(module, _inputs, output):
            self.counts[index] += torch.bincount(output[2].flatten(), minlength=module.num_experts).float()
        return record

    def detach(self) -> dict:
        for handle in self.handles:
            handle.remove()
        shares = [(c / c.sum()).tolist() for c in self.counts]
        return {"share_per_layer": [[round(x, 3) for x in layer] for layer in shares],
                "max_over_mean": [round(max(layer) * len(layer), 2) for layer in shares]}


@torch.no_grad()
def greedy(model, input_ids: list[int], max_new_tokens: int, eos_id: int) -> list[int]:
    out = model.generate(torch.tensor([input_ids]), max_new_tokens=max_new_tokens, do_sample=False,
                         eos_token_id=eos_id, pad_token_id=eos_id)
    return out[0, len(input_ids):].tolist()


def passkey_accuracy(model, tokenizer, lengths, trials: int, seed: int, filler_pool=None) -> dict:
    results = {}
    count_tokens = lambda text: len(tokenizer(text, add_special_tokens=False)["input_ids"])  # noqa: E731
    for length in lengths:
        rng = random.Random(seed * 100_003 + length)
        correct, prompt_tokens = 0, 0
        for _ in range(trials):
            example = passkey.make_passkey_example_near(rng, length, count_tokens, filler_pool)
            ids = tokenizer(example.prompt)["input_ids"]
            generated = tokenizer.decode(greedy(model, ids, 8, tokenizer.eos_token_id), skip_special_tokens=True)
            correct += passkey.parse_answer(generated) == example.key
            prompt_tokens += len(ids)
        results[str(length)] = {"accuracy": correct / trials, "trials": trials,
                                "mean_prompt_tokens": round(prompt_tokens / trials, 1)}
    return results


def samples(model, tokenizer, max_new_tokens: int) -> list[dict]:
    out = []
    for prompt in TEXT_PROMPTS:
        ids = tokenizer(prompt)["input_ids"]
        gen = greedy(model, ids, max_new_tokens, tokenizer.eos_token_id)
        out.append({"prompt": prompt, "ids": ids, "generated_ids": gen,
                    "completion": tokenizer.decode(gen, skip_special_tokens=True)})
    for messages in CHAT_PROMPTS:
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
        gen = greedy(model, list(ids), max_new_tokens, tokenizer.eos_token_id)
        out.append({"chat": messages, "ids": list(ids), "generated_ids": gen,
                    "completion": tokenizer.decode(gen, skip_special_tokens=True)})
    return out


def engine_agreement(model_dir: Path, sample_results: list[dict], max_new_tokens: int) -> dict:
    """hybridmoe's engine (float32) greedy tokens vs transformers' for the same prompt ids."""
    try:
        from hybridmoe import LLM, SamplingParams
        llm = LLM(model_dir, dtype="float32")
    except Exception as error:  # the engine is another team's work in progress: report, do not fail
        return {"available": False, "error": f"{type(error).__name__}: {error}"}
    params = SamplingParams(temperature=0.0, max_tokens=max_new_tokens)
    outputs = llm.generate([s["ids"] for s in sample_results], params)
    matches = [out.token_ids == s["generated_ids"][: len(out.token_ids)] and
               len(out.token_ids) == len(s["generated_ids"]) for out, s in zip(outputs, sample_results)]
    return {"available": True, "same_greedy_tokens": sum(matches), "prompts": len(matches),
            "texts": [out.text for out in outputs]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, default=DEMO_MODEL_DIR)
    parser.add_argument("--fp8", type=Path, default=None, help="its FP8 copy (default: the demo model's, for the demo model)")
    parser.add_argument("--trials", type=int, default=EVAL["passkey_trials"])
    parser.add_argument("--heldout-tokens", type=int, default=EVAL["heldout_max_tokens_per_source"])
    parser.add_argument("--out", type=Path, default=RESULTS_DIR / "eval.json")
    args = parser.parse_args()
    if args.fp8 is None and args.model.resolve() == DEMO_MODEL_DIR.resolve():
        args.fp8 = DEMO_MODEL_FP8_DIR
    torch.set_num_threads(1)
    started = time.time()
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    heldout = data_stream.tokenize_split(data_stream.load_tokenizer(args.model), "heldout")
    fortune_filler = passkey.filler_sentences_from_fortunes(sources.read_fortunes())
    lengths, seed, max_new = EVAL["passkey_lengths"], EVAL["passkey_seed"], EVAL["sample_max_new_tokens"]
    window, max_tokens = HELDOUT_WINDOW, args.heldout_tokens

    model = load_float32(args.model)
    report = {"model": str(args.model.name), "parameters": sum(p.numel() for p in model.parameters())}
    load = ExpertLoad(model)
    report["heldout"] = heldout_perplexity(transformers_logits(model), heldout, window, max_tokens)
    report["expert_load"] = load.detach()
    print("expert load max/mean per MoE layer", report["expert_load"]["max_over_mean"], flush=True)
    print("heldout", report["heldout"], flush=True)
    report["passkey_classic"] = passkey_accuracy(model, tokenizer, lengths, args.trials, seed)
    print("passkey classic", report["passkey_classic"], flush=True)
    report["passkey_fortune_filler"] = passkey_accuracy(model, tokenizer, lengths, args.trials, seed, fortune_filler)
    print("passkey fortunes", report["passkey_fortune_filler"], flush=True)
    report["samples"] = samples(model, tokenizer, max_new)
    for s in report["samples"]:
        print(repr(s.get("prompt") or s["chat"][-1]["content"]), "->", repr(s["completion"]), flush=True)
    report["engine"] = engine_agreement(args.model, report["samples"], max_new)
    print("engine", {k: v for k, v in report["engine"].items() if k != "texts"}, flush=True)

    if args.fp8 is not None:
        fp8 = load_fp8_dequantized(args.fp8)
        report["fp8"] = {"heldout": heldout_perplexity(transformers_logits(fp8), heldout, window, max_tokens),
                         "passkey_classic": passkey_accuracy(fp8, tokenizer, lengths[1:2], args.trials, seed)}
        fp8_samples = samples(fp8, tokenizer, max_new)
        report["fp8"]["same_greedy_tokens_as_bf16"] = sum(
            a["generated_ids"] == b["generated_ids"] for a, b in zip(fp8_samples, report["samples"]))
        report["fp8"]["engine"] = engine_agreement(args.fp8, fp8_samples, max_new)
        report["fp8"]["engine"].pop("texts", None)
        print("fp8", report["fp8"], flush=True)
    for s in report["samples"]:
        del s["ids"], s["generated_ids"]
    report["eval_seconds"] = round(time.time() - started)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {args.out} in {report['eval_seconds']} s")


if __name__ == "__main__":
    main()
