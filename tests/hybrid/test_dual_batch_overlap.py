"""Dual-batch overlap in decode (models/dual_batch.py): a decode step's sequences as two micro-batches, one's attention
while the CPU computes the other's routed experts. The greedy tokens equal the plain forward's (float32, tiny
DeepSeek-V3 with FP8 experts, Qwen3-MoE, Mixtral; batches of several sequences of different lengths, on the plain CPU
engine and placed on the stand-in with experts on both sides); the schedule interleaves as documented; the metadata
split keeps each sequence's slots and block table; when it is on (auto, on, off; the plan's tiers, a plan file's)."""

from __future__ import annotations

import json
from dataclasses import dataclass, fields

import pytest
import torch

from hybridmoe import LLM, SamplingParams
from hybridmoe.checkpoint.fp8 import write_fp8_checkpoint
from hybridmoe.cli import build_parser, main
from hybridmoe.commands._generation import engine_config
from hybridmoe.kernels import isa
from hybridmoe.layers.moe.block import MoEBlock
from hybridmoe.layers.moe.hybrid_backend import HybridExpertBackend
from hybridmoe.layers.paged_attention import AttentionMetadata
from hybridmoe.models.dual_batch import DualBatch, choose, plan_tiers, split_metadata
from hybridmoe.models.placement import held_bytes

KV_GB = 0.0005
STATIC = ("attention", "router", "shared", "dense", "lm_head")


@pytest.fixture(autouse=True)
def exact_cpu_kernels():
    """The CPU kernels in float32 arithmetic (bf16 dot products would round activations, and a micro-batch's rows
    must then match the whole step's bit for bit to keep a random tiny model's greedy tokens)."""
    exact = next(name for name in ("avx512", "avx2", "scalar") if name in isa.available_isas())
    with isa.use_isa(exact):
        yield


@pytest.fixture(scope="module")
def model_dirs(tiny_model_dir, tmp_path_factory):
    fp8 = write_fp8_checkpoint(tiny_model_dir("deepseek_v3", n_routed_experts=16),
                               tmp_path_factory.mktemp("fp8") / "deepseek_v3")
    return {"deepseek_v3": fp8, "qwen3_moe": tiny_model_dir("qwen3_moe", num_experts=16),
            "mixtral": tiny_model_dir("mixtral")}


def _prompts() -> list[list[int]]:
    gen = torch.Generator().manual_seed(5)
    return [torch.randint(6, 300, (n,), generator=gen).tolist() for n in (5, 23, 11, 40, 2)]


def _params() -> list[SamplingParams]:
    """Different output lengths, so that decode batches of 5, 4, 3 and 2 sequences (odd splits too) all run."""
    return [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in (9, 6, 8, 4, 7)]


def _tokens(llm: LLM) -> list[list[int]]:
    return [r.token_ids for r in llm.generate(_prompts(), _params())]


@pytest.mark.parametrize("model_type", ["deepseek_v3", "qwen3_moe", "mixtral"])
def test_overlap_gives_the_plain_forwards_greedy_tokens(model_dirs, model_type):
    path = model_dirs[model_type]
    plain_llm = LLM(path, dtype="float32", overlap="off")
    plain = _tokens(plain_llm)
    assert plain_llm.engine.model.dual_batch is None
    llm = LLM(path, dtype="float32", overlap="on")
    assert _tokens(llm) == plain
    assert llm.engine.model.dual_batch.steps >= 6  # the decode steps of 2 to 5 sequences ran split


def _partial_budget(path, device: str = "auto", generous: str = "256MB") -> int:
    """A vram budget holding what a generous plan places before its hot experts, and 3.5 experts more: routers on
    the accelerator, 3 hot experts there and the rest on the CPU kernels."""
    plain = LLM(path, dtype="float32")
    full = LLM(path, dtype="float32", kv_cache_gb=KV_GB, vram=generous, device=device)
    plan = full.engine.placement.plan
    before = sum(i.nbytes for i in plan.items if i.resident and i.kind != "expert")
    expert = next(i.nbytes / int(i.name.split("(")[1].split()[0]) for i in plan.items
                  if i.kind == "expert" and i.resident)
    excess = max(0.0, held_bytes(plain.engine.model) - sum(i.nbytes for i in plan.items if i.kind in STATIC))
    return int(before + excess + 3.5 * expert)


@pytest.mark.parametrize("model_type", ["deepseek_v3", "qwen3_moe", "mixtral"])
def test_placed_overlap_gives_the_plain_engines_tokens(model_dirs, model_type):
    """Hybrid decode on the stand-in (hot experts on the accelerator, the others on the CPU kernels) split in two."""
    path = model_dirs[model_type]
    plain = _tokens(LLM(path, dtype="float32"))
    llm = LLM(path, dtype="float32", kv_cache_gb=KV_GB, vram=_partial_budget(path), overlap="on")
    backends = [layer.mlp.experts for layer in llm.engine.model.layers if isinstance(layer.mlp, MoEBlock)]
    assert backends and all(isinstance(b, HybridExpertBackend) for b in backends) and any(b.hot for b in backends)
    assert _tokens(llm) == plain
    stats = llm.engine.run_stats
    assert llm.engine.model.dual_batch.steps >= 6
    assert stats.phases["decode"].cpu_expert_assignments > 0 and stats.phases["decode"].hot_expert_assignments > 0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (benchmarks/gpu_check.sh runs it)")
@pytest.mark.parametrize("model_type", ["deepseek_v3", "qwen3_moe", "mixtral"])
def test_cuda_overlap_gives_the_plain_engines_tokens(model_dirs, model_type):
    """On a GPU: attention, routers and 3 hot experts on CUDA, the other experts on the CPU kernels; decode steps
    split in two give the tokens of the same engine with the steps whole, and the plain CPU engine's."""
    path = model_dirs[model_type]
    plain = _tokens(LLM(path, dtype="float32"))
    budget = _partial_budget(path, "cuda", "3GB")  # the plan keeps 1 GB for the CUDA runtime
    tokens = {}
    for overlap in ("off", "on"):
        llm = LLM(path, dtype="float32", kv_cache_gb=KV_GB, vram=budget, device="cuda", overlap=overlap)
        assert llm.engine.accel.is_cuda
        tokens[overlap] = _tokens(llm)
        assert llm.engine.run_stats.phases["decode"].cpu_expert_assignments > 0
    assert llm.engine.model.dual_batch.steps >= 6
    assert tokens["on"] == tokens["off"] == plain


class _Recorder:
    """Wraps an attention layer or an ExpertBackend and logs its calls as (what, layer, tokens)."""

    def __init__(self, part, layer: int, log: list):
        self.part, self.layer, self.log = part, layer, log

    def forward(self, x, *args):
        self.log.append(("attention", self.layer, x.shape[0]))
        return self.part.forward(x, *args)

    def submit(self, hidden, ids, weights):
        self.log.append(("submit", self.layer, hidden.shape[0]))
        return self.part.submit(hidden, ids, weights)

    def wait(self, handle):
        self.log.append(("wait", self.layer, None))
        return self.part.wait(handle)

    def run(self, hidden, ids, weights):
        self.log.append(("run", self.layer, hidden.shape[0]))
        return self.part.run(hidden, ids, weights)

    def __getattr__(self, name):
        return getattr(self.part, name)


def test_each_micro_batchs_attention_runs_while_the_other_ones_experts_are_submitted(model_dirs):
    llm = LLM(model_dirs["qwen3_moe"], dtype="float32", overlap="on")
    log: list = []
    model = llm.engine.model
    assert all(isinstance(layer.mlp, MoEBlock) for layer in model.layers)
    for i, layer in enumerate(model.layers):
        layer.attention = _Recorder(layer.attention, i, log)
        layer.mlp.experts = _Recorder(layer.mlp.experts, i, log)
    prompts = _prompts()[:3]
    llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True))
    prefill = 2 * len(model.layers)  # the prompts' step, whole: attention, then the experts' blocking run (no
    # shared experts to overlap) per layer
    assert log[:2] == [("attention", 0, sum(map(len, prompts))), ("run", 0, sum(map(len, prompts)))]
    decode = log[prefill:]
    assert model.dual_batch.steps == 1 and len(decode) == 6 * len(model.layers)
    expected = []
    for i in range(len(model.layers)):
        # micro-batch 0 (1 sequence) and 1 (2 sequences): finish the previous layer, attend, submit
        expected += ([("wait", i - 1, None)] if i else []) + [("attention", i, 1), ("submit", i, 1)]
        expected += ([("wait", i - 1, None)] if i else []) + [("attention", i, 2), ("submit", i, 2)]
    expected += [("wait", len(model.layers) - 1, None)] * 2
    assert decode == expected


def _metadata() -> AttentionMetadata:
    drop = torch.zeros(12, dtype=torch.bool)
    drop[3] = True
    return AttentionMetadata(slot_mapping=torch.tensor([40, 17, 70, 71]),
                             block_tables=torch.tensor([[2, 0, 0], [1, 0, 0], [4, 3, 0]]), query_lens=[1, 1, 2],
                             seq_lens=[9, 2, 18], block_size=16, dropped=[None, drop, None])


def test_split_metadata_keeps_each_sequences_slots_block_table_and_lengths():
    meta = _metadata()
    first, second, tokens = split_metadata(meta, 2)
    assert tokens == 2
    assert first.slot_mapping.tolist() == [40, 17] and second.slot_mapping.tolist() == [70, 71]
    assert first.block_tables.tolist() == [[2, 0, 0], [1, 0, 0]] and second.block_tables.tolist() == [[4, 3, 0]]
    assert (first.query_lens, first.seq_lens, second.query_lens, second.seq_lens) == ([1, 1], [9, 2], [2], [18])
    assert first.dropped[0] is None and first.dropped[1] is meta.dropped[1] and second.dropped == [None]
    assert first.decode_seqs == 1 and second.decode_seqs == 0  # the kernel's batch, recomputed per part
    assert first.block_size == second.block_size == 16
    with pytest.raises(ValueError, match="split at sequence 3 of 3"):
        split_metadata(meta, 3)


def test_split_metadata_refuses_a_field_it_does_not_know():
    """A field added to AttentionMetadata must be given a way to split, not be shared silently."""
    @dataclass
    class Wider(AttentionMetadata):
        window_starts: list | None = None

    meta = _metadata()
    wider = Wider(**{f.name: getattr(meta, f.name) for f in fields(meta)}, window_starts=[0, 0, 2])
    with pytest.raises(TypeError, match="AttentionMetadata.window_starts"):
        split_metadata(wider, 1)


def test_steps_it_does_not_split(model_dirs):
    llm = LLM(model_dirs["mixtral"], dtype="float32", overlap="on")
    model = llm.engine.model
    meta = _metadata()
    assert not model.dual_batch.applies(model, meta)  # a prefill chunk in the step
    decode = AttentionMetadata(meta.slot_mapping[:3], meta.block_tables, [1, 1, 1], [9, 2, 17], 16)
    assert model.dual_batch.applies(model, decode)
    one = AttentionMetadata(meta.slot_mapping[:1], meta.block_tables[:1], [1], [9], 16)
    assert not model.dual_batch.applies(model, one)  # a single sequence
    remove = model.add_attention_observer(lambda *args: None)  # observers index the whole step's sequences
    assert not model.dual_batch.applies(model, decode)
    remove()
    assert model.dual_batch.applies(model, decode)


def test_auto_follows_the_plan_and_is_off_on_the_plain_cpu_engine():
    assert choose("auto", False, ((2, True),))[0] is None  # no accelerator to overlap with
    assert choose("off", True, ((2, True),))[0] is None
    on, note = choose("on", False, ())
    assert on.tiers is None and on.wanted(2) and not on.wanted(1) and "on" in note
    none, note = choose("auto", True, ((1, False), (8, False)))
    assert none is None and "predicts no gain" in note
    auto, note = choose("auto", True, ((2, True), (3, True), (4, True), (5, False), (64, False)))
    assert "batches of 2-4 sequences" in note
    assert [auto.wanted(s) for s in (1, 2, 4, 5, 30, 64, 200)] == [False, True, True, False, False, False, False]
    with pytest.raises(ValueError, match="overlap must be auto, on or off"):
        choose("yes", True, ())


def test_predicted_tiers_are_the_estimates_comparison(model_dirs):
    llm = LLM(model_dirs["qwen3_moe"], dtype="float32", kv_cache_gb=KV_GB, vram="256MB", max_num_seqs=70)
    placement = llm.engine.placement
    tiers = plan_tiers(placement, None, 70)
    assert [b for b, _ in tiers] == list(range(2, 65)) + [70]
    from hybridmoe.placement import estimate
    for batch, dual in tiers[::20]:
        plain = estimate.decode(placement.builder, batch, placement.plan.context, False, "cpu").step_s
        split = estimate.decode(placement.builder, batch, placement.plan.context, True, "cpu").step_s
        assert dual == (split < plain)
    assert (llm.engine.model.dual_batch is None) == (not any(d for _, d in tiers))


def test_a_plan_files_tiers_turn_it_on_under_auto(model_dirs, tmp_path, capsys):
    """A plan file whose tier predicts a gain at 4 sequences (edited: the tiny model's plan predicts none) splits the
    steps of 2 to 4 sequences and not those of 5; the tokens stay the plain engine's."""
    path = model_dirs["qwen3_moe"]
    plan_file = tmp_path / "plan.json"
    assert main(["plan", "--model", str(path), "--vram", "2GB", "--hardware", "rtx4090,desktop-2ch", "--context",
                 "64", "--dense", "fp32", "--tiers", "1,4,8", "--json", str(plan_file)]) == 0
    capsys.readouterr()
    data = json.loads(plan_file.read_text())
    for tier in data["tiers"]:
        tier["dual_batch"] = tier["batch"] == 4
    plan_file.write_text(json.dumps(data))
    plain = _tokens(LLM(path, dtype="float32"))
    llm = LLM(path, dtype="float32", kv_cache_gb=KV_GB, plan=str(plan_file), max_num_seqs=8)
    assert llm.engine.model.dual_batch.tiers == ((1, False), (4, True), (8, False))
    assert _tokens(llm) == plain
    # decode steps of 5 sequences (the first 3 steps: none) follow tier 8, of 4, 3 and 2 tier 4
    assert 0 < llm.engine.model.dual_batch.steps < 8
    assert plan_tiers(None, tmp_path / "missing.json") == ()


def test_cli_overlap_flags():
    parser = build_parser()
    base = ["generate", "--prompt", "x"]
    assert engine_config(parser.parse_args(base)).overlap == "auto"
    assert engine_config(parser.parse_args(base + ["--no-overlap"])).overlap == "off"
    assert engine_config(parser.parse_args(base + ["--overlap", "on"])).overlap == "on"
    assert engine_config(parser.parse_args(["serve", "--no-overlap"])).overlap == "off"
    with pytest.raises(SystemExit):
        parser.parse_args(base + ["--overlap", "on", "--no-overlap"])
    with pytest.raises(ValueError, match="overlap must be auto, on or off"):
        LLM("demo", overlap="sometimes")
