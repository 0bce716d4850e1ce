"""benchmarks/vs_llamacpp.py's pure pieces (the script itself builds llama.cpp and is not run by CI): arguments,
the alternation schedule, bytes per decoded token from tensor sizes, the synthetic tokenizer's vocabulary, the
summary rows."""

from __future__ import annotations

import ctypes
import importlib.util
import json
import mmap
import os
import struct
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "vs_llamacpp.py"


@pytest.fixture(scope="module")
def vs():
    spec = importlib.util.spec_from_file_location("vs_llamacpp", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules["vs_llamacpp"] = module
    spec.loader.exec_module(module)
    yield module
    sys.modules.pop("vs_llamacpp", None)


def test_defaults_are_the_issues_case(vs, tmp_path):
    a = vs.parse_args(["--cache", str(tmp_path)])
    assert (a.layers, a.threads, a.prompt_tokens, a.formats) == (4, 2, 512, ["bf16", "int8", "int4", "int4-head4"])
    assert a.cache == tmp_path and a.llama_venv.name == "llamacpp-venv" and a.kernel_timing


def test_formats_are_checked(vs):
    assert vs.parse_formats(" int4, bf16,int4") == ["int4", "bf16"]
    with pytest.raises(SystemExit, match="q4_0"):
        vs.parse_formats("int4,q4_0")
    with pytest.raises(SystemExit):
        vs.parse_formats(",")
    with pytest.raises(SystemExit):
        vs.parse_args(["--threads", "0"])


def test_each_gguf_names_its_format(vs, tmp_path):
    assert [vs._gguf_format(tmp_path / f"bench-qwen3-30b-a3b-4l-{f}.gguf") for f in vs.PAIRS.values()] == list(
        vs.PAIRS.values())
    assert set(vs.QUANTIZE) == set(vs.PAIRS) - {"bf16"}


def test_schedule_alternates_and_flips(vs):
    runs = vs.schedule(["bf16", "int4"], 3)
    assert runs[:6] == [("bf16", 0, "ours"), ("bf16", 0, "llama.cpp"), ("int4", 0, "llama.cpp"),
                        ("int4", 0, "ours"), ("bf16", 1, "ours"), ("bf16", 1, "llama.cpp")]
    assert len(runs) == 12
    for fmt in ("bf16", "int4"):  # every round runs both engines once per format; the first engine alternates
        for rnd in range(3):
            assert sorted(e for f, r, e in runs if (f, r) == (fmt, rnd)) == ["llama.cpp", "ours"]
    engines = [e for _, _, e in runs]
    assert all(engines[i] != engines[i + 1] for i in range(0, len(engines) - 1, 2))  # within each pair
    assert all(engines[i] == engines[i + 1] for i in range(1, len(engines) - 1, 2))  # ABBA across pairs
    assert vs.schedule(["int8"], 4) == [("int8", r, e) for r, pair in enumerate(
        [vs.ENGINES, vs.ENGINES[::-1]] * 2) for e in pair]


def test_prompt_ids_are_fixed_regular_tokens(vs):
    ids = vs.prompt_ids(512)
    assert ids == vs.prompt_ids(512) and len(ids) == 512
    assert all(0 <= i < vs.REGULAR_TOKENS for i in ids)


@pytest.mark.parametrize("name, part", [
    ("model.layers.3.self_attn.q_proj.weight", "attention"),
    ("model.layers.3.self_attn.o_proj.weight_scale", "attention"),
    ("model.layers.3.self_attn.q_norm.weight", "norm"),
    ("model.layers.0.input_layernorm.weight", "norm"),
    ("model.layers.0.mlp.gate.weight", "router"),
    ("model.layers.0.mlp.experts.17.down_proj.weight_scale", "experts"),
    ("lm_head.weight", "lm_head"), ("lm_head.weight_scale", "lm_head"),
    ("model.embed_tokens.weight", "embedding"), ("model.norm.weight", "norm"),
    ("blk.2.attn_q.weight", "attention"), ("blk.2.attn_output.weight", "attention"),
    ("blk.2.attn_k_norm.weight", "norm"), ("blk.2.attn_norm.weight", "norm"), ("blk.2.ffn_norm.weight", "norm"),
    ("blk.2.ffn_gate_inp.weight", "router"), ("blk.2.ffn_down_exps.weight", "experts"),
    ("output.weight", "lm_head"), ("token_embd.weight", "embedding"), ("output_norm.weight", "norm"),
])
def test_tensor_parts(vs, name, part):
    assert vs.classify(name)[0] == part


def test_bytes_per_token_reads_k_of_e_experts_and_one_embedding_row(vs):
    sizes = {"blk.0.attn_q.weight": 1000, "blk.0.ffn_gate_exps.weight": 12800, "blk.0.ffn_up_exps.weight": 12800,
             "blk.0.ffn_down_exps.weight": 12800, "blk.0.ffn_gate_inp.weight": 64, "blk.0.attn_norm.weight": 8,
             "output.weight": 5000, "token_embd.weight": 100 * 50}
    b = vs.bytes_per_token(sizes, num_experts=128, top_k=8, vocab=100, kv_bytes=16)
    assert b["experts"] == 3 * 12800 * 8 / 128
    assert b["embedding"] == 50 and b["kv_cache"] == 16
    assert b["total"] == 1000 + 2400 + 64 + 8 + 5000 + 50 + 16


def test_qwen_shaped_bf16_bytes_per_token(vs):
    """The real dimensions, 4 layers, bf16: attention 37.7 MB + experts 75.5 MB a layer, LM head 622 MB."""
    H, I, E, q, kv, V = 2048, 768, 128, 4096, 512, 151936
    sizes = {"lm_head.weight": V * H * 2, "model.embed_tokens.weight": V * H * 2}
    for layer in range(4):
        p = f"model.layers.{layer}."
        sizes.update({p + "self_attn.q_proj.weight": q * H * 2, p + "self_attn.k_proj.weight": kv * H * 2,
                      p + "self_attn.v_proj.weight": kv * H * 2, p + "self_attn.o_proj.weight": H * q * 2,
                      p + "mlp.gate.weight": E * H * 2})
        for e in range(E):
            for proj in ("gate_proj", "up_proj", "down_proj"):
                sizes[p + f"mlp.experts.{e}.{proj}.weight"] = I * H * 2
    kv_bytes = vs.kv_bytes_per_token(4, 4, 128, 544)
    b = vs.bytes_per_token(sizes, E, 8, V, kv_bytes)
    assert b["attention"] == 4 * (2 * q + 2 * kv) * H * 2
    assert b["experts"] == 4 * 8 * 3 * I * H * 2
    assert kv_bytes == 2 * 4 * 4 * 128 * 2 * 544
    assert b["total"] / 1e9 == pytest.approx(1.085, abs=0.005)


def test_bandwidth_fraction(vs):
    assert vs.bandwidth_fraction(1e9, 20.0, 40.0) == pytest.approx(0.5)


def resident_pages(path: Path) -> tuple[int, int]:
    """(pages of the file in the page cache, pages of the file), by mincore over a fresh private mapping (never
    written, so its pages are the page cache's)."""
    libc = ctypes.CDLL(None, use_errno=True)
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY) as mapped:
        pages = (len(mapped) + mmap.PAGESIZE - 1) // mmap.PAGESIZE
        vec = (ctypes.c_ubyte * pages)()
        first = ctypes.c_char.from_buffer(mapped)
        rc = libc.mincore(ctypes.c_void_p(ctypes.addressof(first)), ctypes.c_size_t(len(mapped)), vec)
        del first  # the mapping closes only without exported buffers
        assert rc == 0, os.strerror(ctypes.get_errno())
        return sum(v & 1 for v in vec), pages


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="mincore and posix_fadvise are Linux's")
def test_warm_files_leaves_every_page_cached_and_the_bytes_as_they_were(vs, tmp_path):
    data = os.urandom(3 << 20)
    full, empty = tmp_path / "w.safetensors", tmp_path / "empty.safetensors"
    full.write_bytes(data)
    empty.write_bytes(b"")
    with open(full, "rb") as f:  # written back, so that the warm-up's drop may drop them
        os.fsync(f.fileno())
    seconds = vs.warm_files([full, empty])
    assert seconds >= 0
    cached, pages = resident_pages(full)
    assert cached == pages == len(data) // mmap.PAGESIZE
    assert full.read_bytes() == data


def test_safetensors_sizes_read_only_the_headers(vs, tmp_path):
    header = {"a": {"dtype": "BF16", "shape": [2, 3], "data_offsets": [0, 12]},
              "b": {"dtype": "I8", "shape": [5], "data_offsets": [12, 17]}, "__metadata__": {"format": "pt"}}
    raw = json.dumps(header).encode()
    (tmp_path / "x.safetensors").write_bytes(struct.pack("<Q", len(raw)) + raw + bytes(17))
    assert vs.safetensors_sizes(tmp_path) == {"a": 12, "b": 5}


def test_synthetic_bpe_is_a_consistent_byte_level_vocabulary(vs):
    vocab, merges, specials = vs.synthetic_bpe(vocab_size=400, regular=390)
    assert len(vocab) == 390 and len(specials) == 10 and specials[0] == "<|endoftext|>"
    assert sorted(vocab.values()) == list(range(390))
    assert len(merges) == 390 - 256
    for a, b in merges:  # every merge joins two tokens into a third, all in the vocabulary
        assert a in vocab and b in vocab and a + b in vocab
    vocab, merges, _ = vs.synthetic_bpe(vocab_size=70000, regular=69000)  # past every byte pair
    assert len(vocab) == 69000 and len(set(vocab.values())) == 69000
    assert all(len(a + b) == 3 for a, b in merges[65536:])


def test_parse_result_takes_the_last_result_line(vs):
    out = "loading\nRESULT {\"a\": 1}\nnoise\nRESULT {\"a\": 2}\ntrailing\n"
    assert vs.parse_result(out) == {"a": 2}
    with pytest.raises(RuntimeError, match="no RESULT"):
        vs.parse_result("crashed\n")


def test_summary_rows_and_table(vs):
    runs = []
    for rnd, (ours_d, llama_d) in enumerate([(10.0, 20.0), (12.0, 18.0), (11.0, 19.0)]):
        runs.append({"format": "int4", "engine": "ours", "model_format": "int4 g32 all", "prefill_tok_s": 100.0 + rnd,
                     "decode_tok_s": ours_d, "decode_host": {"others_cpus": 0.1 * rnd}})
        runs.append({"format": "int4", "engine": "llama.cpp", "model_format": "q4_0", "prefill_tok_s": 50.0,
                     "decode_tok_s": llama_d, "decode_host": {"others_cpus": 0.5}})
    rows = vs.summarize(runs, {"int4": [30.0, 40.0, 50.0]}, {("int4", "ours"): 2e9, ("int4", "llama.cpp"): 1e9},
                        {"int4": 0.6})
    ours, llama = rows
    assert (ours["engine"], ours["decode_tok_s"], ours["decode_best"]) == ("ours", 11.0, 12.0)
    assert (llama["decode_tok_s"], llama["decode_best"]) == (19.0, 20.0)
    assert ours["decode_ratio"] == pytest.approx(11 / 19) and ours["decode_ratio_best"] == pytest.approx(12 / 20)
    assert ours["prefill_ratio"] == pytest.approx(101 / 50) and ours["prefill_ratio_best"] == pytest.approx(102 / 50)
    assert llama["decode_ratio"] == ours["decode_ratio"]  # the pair's ratio on both rows
    assert ours["bandwidth_fraction"] == pytest.approx(2e9 * 11 / 40e9)
    assert ours["bandwidth_fraction_best"] == pytest.approx(2e9 * 12 / 50e9)
    assert ours["others_cpus_decode"] == pytest.approx(0.1) and llama["others_cpus_decode"] == 0.5
    assert ours["decode_kernel_fraction"] == 0.6 and "decode_kernel_fraction" not in llama
    table = vs.format_table(rows)
    assert table.count("\n") == 3 and "llama.cpp (q4_0)" in table and "| 0.58 (0.60) |" in table
    assert "| 11.00 (12.00) |" in table and table.splitlines()[3].endswith("| - |")


def test_agreeing_prefix(vs):
    assert vs.agreeing_prefix([1, 2, 3, 4], [1, 2, 9, 4]) == 2
    assert vs.agreeing_prefix([1, 2], [1, 2, 3]) == 2
    assert vs.agreeing_prefix([], [1]) == 0


def test_run_kills_a_command_past_its_time(vs):
    assert vs.run([sys.executable, "-c", "print('hi')"], 30).strip() == "hi"
    with pytest.raises(RuntimeError, match="timed out after"):
        vs.run([sys.executable, "-c", "import time; time.sleep(30)"], 0.5)
    with pytest.raises(RuntimeError, match="exit status 3"):
        vs.run([sys.executable, "-c", "raise SystemExit(3)"], 30)
