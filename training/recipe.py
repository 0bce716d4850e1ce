"""The demo model's recipe: every number that decides what training produces, in one place.

prepare_data.py, train_tokenizer.py, train.py and evaluate.py read these constants; train.py copies them
into the run directory (recipe.json) and into the shipped model directory, so a result can always be
traced back to the recipe that made it. Changing anything here changes the model.
"""

from __future__ import annotations

from pathlib import Path

SEED = 20251129

TRAINING_DIR = Path(__file__).resolve().parent
REPO_ROOT = TRAINING_DIR.parent
DATA_DIR = TRAINING_DIR / "data"  # regenerated, git-ignored
RUNS_DIR = TRAINING_DIR / "runs"  # checkpoints and logs, git-ignored
RESULTS_DIR = TRAINING_DIR / "results"  # committed evaluation results
ASSETS_DIR = REPO_ROOT / "src" / "hybridmoe" / "assets"
DEMO_MODEL_DIR = ASSETS_DIR / "demo_model"
DEMO_MODEL_FP8_DIR = ASSETS_DIR / "demo_model_fp8"
CHAT_TEMPLATE_FILE = TRAINING_DIR / "chat_template.jinja"

# ---- text sources (Debian packages; see DATA_SOURCES.md) ----
FORTUNES_DIR = Path("/usr/share/games/fortunes")
# Left out: ASCII drawings, a non-English file, and collections of ethnic/gender/drug/political jokes
# that a shipped demo should not repeat.
FORTUNE_FILES_EXCLUDED = ("art", "ascii-art", "translate-me", "ethnic", "men-women", "drugs", "politics")
PYTHON_DOC_SOURCES_DIR = Path("/usr/share/doc/python3.11/html/_sources")
HELDOUT_FRACTION = 0.02  # documents whose crc32 falls in this fraction form the held-out split

# ---- tokenizer ----
VOCAB_SIZE = 4096
BOS_TOKEN = "<|begin|>"
EOS_TOKEN = "<|end|>"  # ends a document and a chat turn
PAD_TOKEN = "<|pad|>"
ROLE_TOKENS = ("<|system|>", "<|user|>", "<|assistant|>")
SPECIAL_TOKENS = (BOS_TOKEN, EOS_TOKEN, PAD_TOKEN, *ROLE_TOKENS)

# ---- model: DeepseekV3ForCausalLM (MLA, shared expert, sigmoid group-limited router, 1 dense layer) ----
MODEL_CONFIG = dict(
    vocab_size=VOCAB_SIZE,
    hidden_size=256,
    intermediate_size=512,  # the dense first layer's MLP
    moe_intermediate_size=128,  # each routed expert and the shared expert
    num_hidden_layers=4,
    first_k_dense_replace=1,
    num_attention_heads=4,
    num_key_value_heads=4,
    q_lora_rank=128,
    kv_lora_rank=128,
    qk_nope_head_dim=32,
    qk_rope_head_dim=32,
    v_head_dim=64,
    n_routed_experts=8,
    num_experts_per_tok=2,
    n_shared_experts=1,
    n_group=4,
    topk_group=2,
    norm_topk_prob=True,
    routed_scaling_factor=1.0,
    max_position_embeddings=4096,
    rope_interleave=True,
    tie_word_embeddings=False,
    num_mtp_layers=0,  # no multi-token-prediction module is trained
    initializer_range=0.02,
    rms_norm_eps=1e-6,
)

# ---- the GQA companion: Qwen3MoeForCausalLM at the demo model's size, so that SpectrumKV is measured on both KV
# layouts (MLA's latent and GQA's per-head K/V) on weights that carry meaning. Its embedding, output head, norms,
# dense first layer and routed experts start from the demo model's (warm_start.py); its attention is fresh. ----
GQA_MODEL_CONFIG = dict(
    vocab_size=VOCAB_SIZE,
    hidden_size=256,
    intermediate_size=512,  # the dense first layer's MLP (mlp_only_layers), as the demo model's first layer
    moe_intermediate_size=128,
    num_hidden_layers=4,
    mlp_only_layers=[0],
    num_attention_heads=4,
    num_key_value_heads=2,  # GQA: two query heads share each K/V head, as Qwen3-30B-A3B's 32 share 4
    head_dim=64,
    num_experts=8,
    num_experts_per_tok=2,
    norm_topk_prob=True,
    router_aux_loss_coef=0.0,  # balanced by train.RouterLoadBalancer's loss instead
    max_position_embeddings=4096,
    rope_parameters={"rope_theta": 500000.0, "rope_type": "default"},  # the demo model's final base
    tie_word_embeddings=False,
    initializer_range=0.02,
    rms_norm_eps=1e-6,
)

# ---- training ----
TRAIN = dict(
    family="deepseek_v3",  # the architecture (train.FAMILIES); a variant of another family brings its base config
    stream="phased",  # data_stream.TrainingBatches (text steps, passkey steps, phase 2); "mixed": MixedBatches
    steps=1200,  # about an hour of one shared CPU core (the machine was loaded 3-5x by other work)
    text_rows=4,  # rows per text step
    text_seq_len=512,  # tokens per text row
    passkey_step_fraction=0.35,  # share of steps that train one passkey example instead of text
    passkey_min_tokens=96,
    passkey_max_tokens=2300,
    passkey_answer_weight=20.0,  # loss weight of the answer digits relative to every other token
    # Phase 2 (added at step 600 of the shipped run, when the answer loss was still at chance, ln 10):
    # passkey steps half the time, each a batch of examples of one log-uniform length filling
    # phase2_passkey_batch_tokens (dozens of short ones, one or two long ones), the answer digits carrying
    # half of each example's loss. Phase 1's batches are unchanged, so the run stays one seeded stream.
    phase2_start_step=600,
    phase2_passkey_step_fraction=0.5,
    phase2_passkey_batch_tokens=3072,
    lr=2e-3,
    min_lr_ratio=0.1,
    warmup_steps=100,
    decay_fraction=0.25,  # warm-up / stable / decay schedule: the last quarter decays
    weight_decay=0.1,
    betas=(0.9, 0.95),
    grad_clip=1.0,
    router_bias_update_rate=1e-3,  # DeepSeek-V3's auxiliary-loss-free balancing (gamma)
    balance_loss_alpha=1e-2,  # DeepSeek-V3's complementary balance loss (V3: 1e-4 over far more tokens)
    checkpoint_every=100,
    num_threads=1,
)

# ---- variants: mixed_copy, passkey_focus, passkey_long, passkey_long_text, passkey_long_wide, passkey_long_answers,
# passkey_long_answers_low, passkey_long_answers_carry and passkey_long_answers_end made the shipped model
# (SHIPPED_VARIANT) ----
# `train.py --variant NAME` applies a variant's model and train entries on top of MODEL_CONFIG and TRAIN
# (run directory training/runs/NAME/, export to training/runs/NAME/export/ unless --export is given).
VARIANTS = {
    # Copy rows from step 0, beside text rows and short passkey examples in every batch; a larger content
    # part of the attention logits. The mixed stream: every step is one batch of rows of one width, each row
    # a copy row (BOS, a random pattern repeated to fill the row, loss on the repeats), a text row or a
    # passkey example (answer digits half of its loss). Until mixed_short_steps all rows are
    # mixed_short_width wide; then each step's width is log-uniform in [mixed_short_width,
    # passkey_max_tokens] and rows * width is about mixed_tokens_per_step (at least 2 rows).
    "mixed_copy": dict(
        model=dict(qk_nope_head_dim=64),  # q_b_proj 384 rows, kv_b_proj 512 rows
        train=dict(
            stream="mixed",
            steps=2000,
            mixed_tokens_per_step=2048,
            mixed_short_steps=1200,
            mixed_short_width=128,
            mixed_row_shares_short={"copy": 0.4, "text": 0.4, "passkey": 0.2},
            mixed_row_shares_long={"copy": 0.1, "text": 0.45, "passkey": 0.45},
            mixed_copy_pattern_tokens=(6, 40),  # pattern length range (capped at half the row)
            mixed_copy_vocabulary=1000,  # pattern tokens: the most frequent training tokens ...
            mixed_copy_digit_share=0.2,  # ... or, this often, one of the ten digits
        ),
    ),
}
# A continuation of mixed_copy's step-1,700 checkpoint (weights and router biases, fresh optimiser), its rows and
# model, on passkey-heavy batches of widely varying width, so that the needle's position cannot answer: every
# step's width is log-uniform in [passkey_min_tokens, passkey_max_tokens] (up to the 1K goal's length); half the
# rows are passkey examples. Its own stream seed, so it sees examples the first run did not.
VARIANTS["passkey_focus"] = dict(
    model=VARIANTS["mixed_copy"]["model"],
    train={
        **VARIANTS["mixed_copy"]["train"],
        "init_from": "mixed_copy",  # training/runs/mixed_copy/checkpoint.pt (its step 1,700): model weights only
        "stream_seed": SEED + 1,
        "steps": 3000,  # steps 1,000-1,499 ran under a 4,000-step schedule, whose lr equals this one's there
        "num_threads": 2,  # steps 0-999 ran with one thread
        "lr": 1e-3,
        "warmup_steps": 50,
        "mixed_short_steps": 0,
        "mixed_short_width": 160,
        "passkey_min_tokens": 160,
        "passkey_max_tokens": 1200,
        "mixed_row_shares_long": {"copy": 0.05, "text": 0.4, "passkey": 0.55},
    },
)
# More of passkey_focus (tried, not shipped: MODEL_CARD.md, Training): its final weights (fresh optimiser), the same
# rows, 1,600 more steps at half the rate.
VARIANTS["passkey_focus_more"] = dict(
    model=VARIANTS["passkey_focus"]["model"],
    train={**VARIANTS["passkey_focus"]["train"], "init_from": "passkey_focus", "stream_seed": SEED + 2, "steps": 1600,
           "lr": 5e-4},
)


# Long-context extension of passkey_focus (its final weights, fresh optimiser): layer 1's retrieval heads match the
# needle mostly through the RoPE part of the logits (zeroing their q_rope rows loses the passkey, scaling the content
# rows changes nothing), and over 1K tokens all but the slowest rotary pairs turn far enough to scramble that
# match. So, as in "adjusted base frequency" context extension, the RoPE base goes from 10,000 to 500,000 (pair i of
# 16 turns 50^(i/16) times slower: the slowest 39x, the fastest stay local) and training continues on widths up to 2K.
VARIANTS["passkey_long"] = dict(
    model={**VARIANTS["passkey_focus"]["model"], "rope_parameters": {"rope_theta": 500000.0, "rope_type": "default"}},
    train={**VARIANTS["passkey_focus"]["train"], "init_from": "passkey_focus", "stream_seed": SEED + 3,
           "steps": 3600,  # steps 0-1,499 ran under a 2,000-step schedule, whose lr equals this one's there
           "passkey_min_tokens": 256, "passkey_max_tokens": 2100, "mixed_short_width": 256},
)


# A text-heavy cool-down of passkey_long (its final weights, fresh optimiser): passkey_long's greedy text falls into
# the passkey prompt's wording ("... an important info hidden inside a lot of irrelevant text"), so 400 short steps
# at a low rate on rows that are mostly text.
VARIANTS["passkey_long_text"] = dict(
    model=VARIANTS["passkey_long"]["model"],
    train={**VARIANTS["passkey_long"]["train"], "init_from": "passkey_long", "stream_seed": SEED + 4, "steps": 400,
           "lr": 3e-4, "warmup_steps": 20, "mixed_row_shares_long": {"copy": 0.0, "text": 0.85, "passkey": 0.15}},
)


# Run 5 of the shipped model (MODEL_CARD.md, "The 1K misses are ordering errors"; not shipped on its own): long
# rows only, on top of passkey_long_text (its final weights, fresh optimiser): every row 768-2,100 tokens wide
# (passkey_long's were 256-2,100, so most needles sat a few hundred tokens from their question), half of them
# passkey examples, at passkey_long_text's low rate.
VARIANTS["passkey_long_wide"] = dict(
    model=VARIANTS["passkey_long_text"]["model"],
    train={**VARIANTS["passkey_long"]["train"], "init_from": "passkey_long_text", "stream_seed": SEED + 7,
           "steps": 1800, "lr": 3e-4, "warmup_steps": 50, "mixed_short_width": 768,
           "mixed_row_shares_long": {"text": 0.5, "passkey": 0.5}},
)


# Tried, not shipped: a text-heavy cool-down of passkey_long_wide (its final weights, fresh optimiser), as
# passkey_long_text was of passkey_long: passkey_long_wide's greedy text falls into the passkey prompt's wording.
VARIANTS["passkey_long_wide_text"] = dict(
    model=VARIANTS["passkey_long_wide"]["model"],
    train={**VARIANTS["passkey_long_wide"]["train"], "init_from": "passkey_long_wide", "stream_seed": SEED + 8,
           "steps": 300, "lr": 3e-4, "warmup_steps": 20, "mixed_row_shares_long": {"text": 0.85, "passkey": 0.15}},
)


# Run 6 (MODEL_CARD.md, "The prompt's own tokens were teaching the prose"; the shipped model until run 9):
# answer-only passkey rows on top of passkey_long_wide (its final weights, fresh optimiser). In every passkey-heavy
# phase before it the greedy text fell into the passkey prompt's wording, and every text phase after one gave back
# most of the retrieval won at 1K. Here the passkey rows' prompt tokens (intro and filler) carry no loss, so they
# train retrieval alone, and the text rows beside them restore the prose.
VARIANTS["passkey_long_answers"] = dict(
    model=VARIANTS["passkey_long_wide"]["model"],
    train={**VARIANTS["passkey_long_wide"]["train"], "init_from": "passkey_long_wide", "stream_seed": SEED + 9,
           "steps": 1200, "lr": 3e-4, "warmup_steps": 20, "passkey_prompt_loss": False,
           "mixed_row_shares_long": {"text": 0.5, "passkey": 0.5}},
)


# Tried, not shipped (MODEL_CARD.md, "The prompt's own tokens were teaching the prose"): more of
# passkey_long_answers (its final weights, fresh optimiser), the same rows with a new stream seed, as its retrieval
# at 1K rose until its decay. Stopped at step 500.
VARIANTS["passkey_long_answers_more"] = dict(
    model=VARIANTS["passkey_long_answers"]["model"],
    train={**VARIANTS["passkey_long_answers"]["train"], "init_from": "passkey_long_answers", "stream_seed": SEED + 10,
           "steps": 1000},
)


# Run 7 (MODEL_CARD.md, "The prompt's own tokens were teaching the prose"): more of passkey_long_answers at a third
# of its rate (its final weights, fresh optimiser), so that the fresh optimiser's first steps cost less of what it
# had won.
VARIANTS["passkey_long_answers_low"] = dict(
    model=VARIANTS["passkey_long_answers"]["model"],
    train={**VARIANTS["passkey_long_answers"]["train"], "init_from": "passkey_long_answers", "stream_seed": SEED + 11,
           "steps": 600, "lr": 1e-4},
)


# Run 8 (MODEL_CARD.md, "The optimiser carried over"): more of passkey_long_answers_low, from its final weights and
# its AdamW moments (no fresh-optimiser dip), with 65% of the rows answer-only passkey examples: the answer-only
# loss leaves the prose alone, so retrieval can take a larger share of each step. Steps 0-1,199 ran under an
# 1,800-step schedule, equal to this one's there.
VARIANTS["passkey_long_answers_carry"] = dict(
    model=VARIANTS["passkey_long_answers_low"]["model"],
    train={**VARIANTS["passkey_long_answers_low"]["train"], "init_from": "passkey_long_answers_low",
           "init_optimizer": True, "stream_seed": SEED + 12, "steps": 2800, "lr": 2e-4, "warmup_steps": 20,
           "mixed_row_shares_long": {"text": 0.35, "passkey": 0.65}},
)

# Run 9 (MODEL_CARD.md, "The optimiser carried over"): passkey_long_answers_carry's weights and AdamW moments where
# it stopped (step 2,700: `--stop-after 2700`), 250 steps with the answer's end scored too. In the answer-only rows
# of runs 6-8 the "." after the fifth digit carried no loss, and run 8 retrieves the five digits at 1K almost
# always but often writes the last one twice.
VARIANTS["passkey_long_answers_end"] = dict(
    model=VARIANTS["passkey_long_answers_carry"]["model"],
    train={**VARIANTS["passkey_long_answers_carry"]["train"], "init_from": "passkey_long_answers_carry",
           "init_optimizer": True, "stream_seed": SEED + 13, "steps": 250, "lr": 1e-4, "warmup_steps": 10,
           "passkey_answer_end_loss": True},
)

# The shipped demo model: mixed_copy's first 1,700 steps, passkey_focus's 3,000, passkey_long's 3,600,
# passkey_long_text's 400, passkey_long_wide's 1,800, passkey_long_answers' 1,200, passkey_long_answers_low's 600,
# passkey_long_answers_carry's first 2,700 (of 2,800) and passkey_long_answers_end's 250 (MODEL_CARD.md, Training).
SHIPPED_VARIANT = "passkey_long_answers_end"


# The GQA companion (MODEL_CARD.md, "The GQA companion"): a fresh Qwen3-MoE attention on the demo model's other
# weights, trained on the mixed stream from the demo model's findings: copy rows from step 0, widths up to 2.1K
# from step 300 so that a needle's position cannot answer, the larger RoPE base from the start.
VARIANTS["gqa_companion"] = dict(
    family="qwen3_moe",
    model={},
    # run as `--stop-after 2500` of an 8,000-step schedule: the rate stays at its peak; the second run decays it
    train={**VARIANTS["mixed_copy"]["train"], "warm_start": "demo_model", "stream_seed": SEED + 20, "steps": 8000,
           "num_threads": 2, "lr": 1e-3, "warmup_steps": 50, "mixed_short_steps": 300, "mixed_short_width": 256,
           "passkey_min_tokens": 256, "passkey_max_tokens": 2100,
           "mixed_row_shares_short": {"copy": 0.3, "text": 0.4, "passkey": 0.3},
           "mixed_row_shares_long": {"copy": 0.05, "text": 0.4, "passkey": 0.55}},
)
# Its second run (MODEL_CARD.md, "The GQA companion"): the demo model's last lessons at once. gqa_companion's weights
# and AdamW moments where it stopped, the rate decayed; rows 768-2,100 tokens wide, half text, half passkey examples
# scored on the answer alone (digits, "." and EOS), because the demo model's runs 6 and 9 found that a passkey prompt
# carrying loss teaches the prose its wording and that an unscored end lets the answer run on past its digits.
VARIANTS["gqa_companion_answers"] = dict(
    family="qwen3_moe",
    model={},
    train={**VARIANTS["gqa_companion"]["train"], "warm_start": None, "init_from": "gqa_companion",
           "init_optimizer": True, "stream_seed": SEED + 21, "steps": 1600, "lr": 3e-4, "warmup_steps": 20,
           "mixed_short_steps": 0, "mixed_short_width": 768, "passkey_prompt_loss": False,
           "passkey_answer_end_loss": True, "mixed_row_shares_long": {"text": 0.5, "passkey": 0.5}},
)


def shipped_model_config() -> dict:
    """The config the shipped model was trained with: MODEL_CONFIG with its variant's model entries."""
    return {**MODEL_CONFIG, **VARIANTS[SHIPPED_VARIANT]["model"]}


def apply_variant(name: str) -> None:
    """Update MODEL_CONFIG and TRAIN in place (every module that imported them sees the variant). A variant of
    another family (TRAIN["family"]) replaces MODEL_CONFIG with that family's base config."""
    variant = VARIANTS[name]
    if variant.get("family") == "qwen3_moe":
        MODEL_CONFIG.clear()
        MODEL_CONFIG.update(GQA_MODEL_CONFIG)
    MODEL_CONFIG.update(variant["model"])
    TRAIN.update(variant["train"], family=variant.get("family", TRAIN["family"]))


# Share of text-step tokens drawn from each source (the rest of the steps are passkey examples).
TEXT_MIX = {"fortunes": 0.45, "python_docs": 0.30, "chat": 0.25}
PASSKEY_FILLER_MIX = {"classic": 0.7, "fortunes": 0.3}
NUM_SYNTHETIC_CHATS = 40000

# ---- evaluation ----
EVAL = dict(
    passkey_lengths=(512, 1024, 2048),
    passkey_trials=50,
    passkey_seed=7,
    heldout_max_tokens_per_source=40000,
    sample_max_new_tokens=60,
)
