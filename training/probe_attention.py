"""Probe whether the demo model can copy from its context, and what drives its attention.

Passkey retrieval needs an induction circuit: a previous-token head, then a head whose query (the current
token) matches keys carrying the previous token, attending to the token after the earlier occurrence. This
script measures, for the shipped model or a training checkpoint:
  - copy loss: cross-entropy on the first and on the second copy of a random sequence of the 1,000 most
    frequent held-out tokens, repeated (equal losses = no copying);
  - per layer and head, the mean attention on the previous token and on the induction target (the token
    after the earlier occurrence of the current one), on those repeated sequences;
  - per layer and head, the spread (std over causal query-key pairs) of the two parts of MLA's attention
    logits on held-out text: the content part (q_nope . k_nope, read through the 128-wide kv latent) and the
    position part (q_rope . k_rope, the 32-wide RoPE key shared by all heads). A content part far smaller than
    the position part means attention follows position, not content, and cannot find a match far back.
  - on passkey examples (teacher-forced answer " ddddd"): the accuracy of each answer digit, each head's
    attention on the needle digit it should copy, and the accuracy when one layer's query loses its RoPE part
    or its content part (q_b_proj rows zeroed): which part of which layer does the retrieval.
Run: .venv/bin/python training/probe_attention.py [--checkpoint training/runs/demo/checkpoint.pt [--variant NAME]]
(without --checkpoint it probes src/hybridmoe/assets/demo_model).
"""

from __future__ import annotations

import argparse
import random
from collections import Counter
from pathlib import Path

import torch
import torch.nn.functional as F
from transformers import DeepseekV3ForCausalLM
from transformers.models.deepseek_v3.modeling_deepseek_v3 import (apply_rotary_pos_emb,
                                                                 apply_rotary_pos_emb_interleave)

import data_stream
import passkey
from recipe import DEMO_MODEL_DIR, SPECIAL_TOKENS


def load(checkpoint: Path | None) -> DeepseekV3ForCausalLM:
    if checkpoint is None:
        model = DeepseekV3ForCausalLM.from_pretrained(DEMO_MODEL_DIR, dtype=torch.float32, attn_implementation="eager")
    else:
        from train import build_model
        model = build_model(data_stream.load_tokenizer())
        model.load_state_dict(torch.load(checkpoint, map_location="cpu", weights_only=False)["model"])
        model.config._attn_implementation = "eager"
    return model.eval()


def repeated_rows(vocabulary: list[int], rows: int, pattern: int, copies: int, seed: int) -> torch.Tensor:
    rng = random.Random(seed)
    return torch.tensor([[0] + [rng.choice(vocabulary) for _ in range(pattern)] * copies for _ in range(rows)])


@torch.no_grad()
def copy_probe(model, ids: torch.Tensor, pattern: int) -> dict:
    out = model(input_ids=ids[:, :-1], output_attentions=True)
    logits = out.logits.flatten(0, 1).float()  # [B * T, V]
    loss = F.cross_entropy(logits, ids[:, 1:].flatten(), reduction="none").view(ids.shape[0], -1)  # [B, T]
    queries = torch.arange(pattern + 1, ids.shape[1] - 1)  # positions in the second copy and later
    heads = []
    for layer, att in enumerate(out.attentions):  # [B, H, T, T]
        previous = att[:, :, queries, queries - 1].mean(dim=(0, 2))
        induction = att[:, :, queries, queries - pattern + 1].mean(dim=(0, 2))
        heads.append({"layer": layer, "previous_token": [round(x, 3) for x in previous.tolist()],
                      "induction_target": [round(x, 3) for x in induction.tolist()]})
    return {"first_copy_loss": round(loss[:, :pattern].mean().item(), 3),
            "later_copies_loss": round(loss[:, pattern:].mean().item(), 3), "heads": heads}


@torch.no_grad()
def logit_parts(model, ids: torch.Tensor) -> list[dict]:
    """Std over causal (query, key) pairs of the content and position parts of each head's attention logits."""
    captured = {}

    def grab(_module, args, kwargs):
        captured["hidden"] = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]
        captured["rope"] = kwargs["position_embeddings"]

    rows = []
    for index, layer in enumerate(model.model.layers):
        attn = layer.self_attn
        handle = attn.register_forward_pre_hook(grab, with_kwargs=True)
        model(input_ids=ids)
        handle.remove()
        hidden, (cos, sin) = captured["hidden"], captured["rope"]
        b, t, _ = hidden.shape
        nope, rope, heads = attn.qk_nope_head_dim, attn.qk_rope_head_dim, attn.num_heads
        q = attn.q_b_proj(attn.q_a_layernorm(attn.q_a_proj(hidden))).view(b, t, heads, nope + rope).transpose(1, 2)
        q_nope, q_rope = q.split([nope, rope], dim=-1)
        kv_latent, k_rope = attn.kv_a_proj_with_mqa(hidden).split([attn.kv_lora_rank, rope], dim=-1)
        k_rope = k_rope.view(b, 1, t, rope)
        rotate = apply_rotary_pos_emb_interleave if model.config.rope_interleave else apply_rotary_pos_emb
        q_rope, k_rope = rotate(q_rope, k_rope, cos, sin)
        kv = attn.kv_b_proj(attn.kv_a_layernorm(kv_latent)).view(b, t, heads, -1).transpose(1, 2)
        k_nope = kv[..., :nope]
        causal = torch.tril(torch.ones(t, t, dtype=torch.bool))
        content = (q_nope @ k_nope.transpose(-1, -2) * attn.scaling)[:, :, causal]  # [B, H, pairs]
        position = (q_rope @ k_rope.transpose(-1, -2) * attn.scaling)[:, :, causal]
        rows.append({"layer": index, "content_std": [round(x, 3) for x in content.std(dim=(0, 2)).tolist()],
                     "position_std": [round(x, 3) for x in position.std(dim=(0, 2)).tolist()]})
    return rows


def passkey_rows(tokenizer, length: int, count: int, seed: int) -> list[tuple[list[int], list[int]]]:
    """(prompt ids, answer ids) of `count` classic-filler passkey examples of about `length` tokens."""
    rng = random.Random(seed)
    count_tokens = lambda text: len(tokenizer.encode(text).ids)  # noqa: E731
    rows = []
    for _ in range(count):
        example = passkey.make_passkey_example_near(rng, length, count_tokens)
        rows.append((tokenizer.encode(example.prompt).ids,
                     tokenizer.encode(example.answer.rstrip("."), add_special_tokens=False).ids))
    return rows


def answer_hits(logits: torch.Tensor, prompt_tokens: int, answer: list[int]) -> list[bool]:
    """Whether each answer digit is the greedy prediction (teacher forcing): position prompt_tokens + k predicts
    answer[k + 1] (answer[0] is the space before the digits). logits: [T, V] over prompt + answer."""
    predicted = logits.argmax(-1)  # [T]
    return [bool(predicted[prompt_tokens + k] == answer[k + 1]) for k in range(len(answer) - 1)]


@torch.no_grad()
def passkey_probe(model, rows: list[tuple[list[int], list[int]]]) -> dict:
    """Teacher-forced digit accuracy and, per layer and head, the attention of each answer position on the
    needle digit it must produce (summed over the needle's two occurrences). The answer is " " + 5 digits."""
    digits = len(rows[0][1]) - 1
    correct = torch.zeros(digits)
    on_source = torch.zeros(len(model.model.layers), model.config.num_attention_heads)
    for prompt, answer in rows:
        n = len(prompt)
        starts = [j for j in range(n - len(answer)) if prompt[j:j + len(answer)] == answer]  # needle occurrences
        out = model(input_ids=torch.tensor([prompt + answer]), output_attentions=True)
        correct += torch.tensor(answer_hits(out.logits[0], n, answer), dtype=torch.float32)
        for k in range(digits):  # position n + k predicts answer digit k
            sources = [start + 1 + k for start in starts]
            for layer, att in enumerate(out.attentions):  # [1, H, T, T]
                on_source[layer] += att[0, :, n + k, sources].sum(-1)
    return {"digit_accuracy": [round(x, 2) for x in (correct / len(rows)).tolist()],
            "attention_on_source": [[round(x, 2) for x in row] for row in (on_source / (len(rows) * digits)).tolist()]}


@torch.no_grad()
def digit_accuracy(model, rows) -> float:
    hits = sum(sum(answer_hits(model(input_ids=torch.tensor([prompt + answer])).logits[0], len(prompt), answer))
               for prompt, answer in rows)
    return round(hits / (len(rows) * (len(rows[0][1]) - 1)), 2)


@torch.no_grad()
def query_part_ablation(model, rows) -> list[dict]:
    """Digit accuracy with one layer's queries cut to their content part (RoPE rows of q_b_proj zeroed) or to
    their RoPE part (content rows zeroed); the weights are restored afterwards."""
    result = []
    for index, layer in enumerate(model.model.layers):
        attn = layer.self_attn
        weight = attn.q_b_proj.weight  # [heads * (nope + rope), q_lora_rank]
        per_head = weight.view(attn.num_heads, attn.qk_nope_head_dim + attn.qk_rope_head_dim, -1)
        saved = weight.clone()
        accuracy = {}
        for part, rows_of_part in (("without_rope", slice(attn.qk_nope_head_dim, None)),
                                   ("without_content", slice(0, attn.qk_nope_head_dim))):
            per_head[:, rows_of_part] = 0
            accuracy[part] = digit_accuracy(model, rows)
            weight.copy_(saved)
        result.append({"layer": index, **accuracy})
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--checkpoint", type=Path, default=None)
    parser.add_argument("--variant", default=None, help="the recipe variant the checkpoint was trained with")
    parser.add_argument("--passkey-lengths", type=int, nargs="*", default=[512, 1024],
                        help="passkey probe lengths in tokens (none: skip the passkey probe)")
    parser.add_argument("--passkey-examples", type=int, default=16)
    args = parser.parse_args()
    if args.variant:
        import recipe
        recipe.apply_variant(args.variant)
    torch.set_num_threads(1)
    torch.manual_seed(0)
    tokenizer = data_stream.load_tokenizer()
    heldout = data_stream.tokenize_split(tokenizer, "heldout")
    special = {tokenizer.token_to_id(t) for t in SPECIAL_TOKENS}
    counts = Counter(t for docs in heldout.values() for doc in docs for t in doc if t not in special)
    vocabulary = [t for t, _ in counts.most_common(1000)]
    model = load(args.checkpoint)
    probe = copy_probe(model, repeated_rows(vocabulary, 8, 20, 3, seed=1), pattern=20)
    print(f"copy loss: first copy {probe['first_copy_loss']}, later copies {probe['later_copies_loss']}")
    for row in probe["heads"]:
        print(f"layer {row['layer']}: attention on previous token {row['previous_token']}, "
              f"on induction target {row['induction_target']}")
    text = [t for doc in heldout["fortunes"] for t in doc][:256]
    for row in logit_parts(model, torch.tensor([text])):
        print(f"layer {row['layer']}: logit std, content part {row['content_std']}, "
              f"position part {row['position_std']}")
    for length in args.passkey_lengths:
        rows = passkey_rows(tokenizer, length, args.passkey_examples, seed=123)
        probe = passkey_probe(model, rows)
        print(f"passkey {length} tokens: teacher-forced accuracy of answer digits 1-5 {probe['digit_accuracy']}")
        for layer, heads in enumerate(probe["attention_on_source"]):
            print(f"  layer {layer}: attention on the needle digit to copy, per head {heads}")
        for row in query_part_ablation(model, rows):
            print(f"  layer {row['layer']} queries without their RoPE part: digit accuracy {row['without_rope']}; "
                  f"without their content part: {row['without_content']}")


if __name__ == "__main__":
    main()
