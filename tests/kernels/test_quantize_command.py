"""`hybridmoe quantize`: BF16/FP32 and FP8 checkpoints -> int4/int8 expert checkpoints the kernels compute with."""

from __future__ import annotations

import json
import os

import pytest
import torch

from hybridmoe.checkpoint.fp8 import write_fp8_checkpoint
from hybridmoe.checkpoint.safetensors_reader import CheckpointReader
from hybridmoe.cli import main
from hybridmoe.commands.quantize import expert_names, expert_output_errors, projection_names, source_weight
from hybridmoe.kernels import formats, reference


@pytest.mark.slow
@pytest.mark.parametrize("model_type", ["deepseek_v3", "mixtral"])
@pytest.mark.parametrize("fmt,group,scope", [("int4", 32, "all"), ("int8", 128, "all"), ("int4", 32, "experts")])
def test_quantize_writes_int_weights_and_keeps_the_rest(tiny_model_dir, tmp_path, capsys, model_type, fmt, group,
                                                        scope):
    src = tiny_model_dir(model_type)
    out = tmp_path / "q"
    extra = ["--experts-only"] if scope == "experts" else []
    assert main(["quantize", "--model", str(src), "--to", fmt, "--group", str(group), "--out", str(out), *extra]) == 0
    report = capsys.readouterr().out
    assert "expert output error vs source" in report
    assert ("projection output error vs source" in report) == (scope == "all")
    config = json.loads((out / "config.json").read_text())
    assert config["expert_quantization"] == {"method": fmt, "group_size": group, "scale_dtype": "bfloat16",
                                             "layout": "hybridmoe-int-v1", "scope": scope}
    assert (out / "tokenizer.json").exists()
    source, written = CheckpointReader(src), CheckpointReader(out)
    experts = expert_names(source.names())
    assert experts and expert_names(written.names()).keys() == experts.keys()
    targets = {name: fmt for triple in experts.values() for name in triple}
    targets.update({name: f or fmt for name, f in projection_names(source.names(), scope == "experts").items()})
    if scope == "all":  # attention, the LM head (int8), MLPs; never routers, norms, embeddings or MLA's kv_b_proj
        assert "lm_head.weight" in targets and targets["lm_head.weight"] == "int8"
        assert any(".self_attn.o_proj" in name for name in targets)
        assert not any(n.endswith(("mlp.gate.weight", "norm.weight", "embed_tokens.weight")) or "kv_b_proj" in n
                       for n in targets)
    for name in source.names():
        if name in targets:
            w, target = source.get(name).float(), targets[name]
            data, scales = written.get(name), written.get(name + "_scale")
            kp = formats.padded_cols(w.shape[1], group)
            assert data.shape == (w.shape[0], kp // 2 if target == "int4" else kp)
            assert scales.shape == (w.shape[0], kp // group) and scales.dtype == torch.bfloat16
            error = (reference.dequantize(target, data, scales, cols=w.shape[1]) - w.double()).abs()
            step = scales.double().repeat_interleave(group, 1)[:, :w.shape[1]]
            assert (error <= step * 0.51 + 1e-9).all()
        else:
            assert torch.equal(written.get(name), source.get(name)), name
    errors = expert_output_errors(source, written, experts, fmt, samples=4, block=(128, 128))
    assert max(errors) < (0.3 if fmt == "int4" else 0.05)


@pytest.mark.slow
def test_quantize_from_fp8_dequantises_exactly_first(tiny_model_dir, tmp_path):
    fp8 = write_fp8_checkpoint(tiny_model_dir("qwen3_moe"), tmp_path / "fp8")
    out = tmp_path / "int8"
    assert main(["quantize", "--model", str(fp8), "--to", "int8", "--group", "32", "--out", str(out)]) == 0
    source, written = CheckpointReader(fp8), CheckpointReader(out)
    experts = expert_names(source.names())
    name = next(iter(experts.values()))[0]
    assert name + "_scale_inv" in source.names() and name + "_scale_inv" not in written.names()
    w = source_weight(source, name, (128, 128))
    from_int = reference.dequantize("int8", written.get(name), written.get(name + "_scale"), cols=w.shape[1])
    assert ((from_int - w.double()).abs().max() / w.abs().max()) < 0.01
    assert json.loads((out / "config.json").read_text())["quantization_config"]["quant_method"] == "fp8"


def test_refusals_are_error_lines_and_the_output_is_replaced_only_on_request(tmp_path, tiny_model_dir, capsys):
    src = tiny_model_dir("deepseek_v3")
    assert main(["quantize", "--model", str(src), "--to", "int4", "--out", str(src)]) == 2
    assert "error: --out" in capsys.readouterr().err
    quantised = tmp_path / "q"
    assert main(["quantize", "--model", str(src), "--to", "int4", "--out", str(quantised), "--samples", "1"]) == 0
    umask = os.umask(0)
    os.umask(umask)
    assert {f.name: f.stat().st_mode & 0o777 for f in quantised.iterdir()} == {
        f.name: 0o666 & ~umask for f in src.iterdir()}  # the source's files, as the umask lets the user write them
    assert quantised.stat().st_mode & 0o777 == 0o777 & ~umask
    assert [p.name for p in tmp_path.iterdir()] == ["q"]  # no partial copy left beside it
    capsys.readouterr()
    assert main(["quantize", "--model", str(quantised), "--to", "int8", "--out", str(tmp_path / "again")]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {quantised}: experts are already quantised") and "Traceback" not in err
    assert not (tmp_path / "again").exists()

    (quantised / "stale.txt").write_text("from an earlier run")
    assert main(["quantize", "--model", str(src), "--to", "int8", "--out", str(quantised), "--samples", "1"]) == 2
    assert f"error: --out {quantised} already exists; pass --overwrite" in capsys.readouterr().err
    assert json.loads((quantised / "config.json").read_text())["expert_quantization"]["method"] == "int4"
    assert main(["quantize", "--model", str(src), "--to", "int8", "--out", str(quantised), "--samples", "1",
                 "--overwrite"]) == 0
    assert json.loads((quantised / "config.json").read_text())["expert_quantization"]["method"] == "int8"
    assert not (quantised / "stale.txt").exists()

    notes = tmp_path / "notes"
    notes.mkdir()
    (notes / "todo.txt").write_text("not a model")
    assert main(["quantize", "--model", str(src), "--to", "int8", "--out", str(notes), "--overwrite"]) == 2
    assert "not a model directory" in capsys.readouterr().err and (notes / "todo.txt").exists()

@pytest.mark.slow
@pytest.mark.parametrize("lm_head", ["int4", "keep"])
def test_the_lm_head_format_is_chosen_and_the_engine_runs_it(tiny_model_dir, tmp_path, capsys, lm_head):
    from hybridmoe import LLM, SamplingParams

    src = tiny_model_dir("qwen3_moe")
    out = tmp_path / "q"
    assert main(["quantize", "--model", str(src), "--to", "int4", "--lm-head", lm_head, "--out", str(out)]) == 0
    report = capsys.readouterr().out
    source, written = CheckpointReader(src), CheckpointReader(out)
    head = source.get("lm_head.weight").float()
    if lm_head == "keep":
        assert torch.equal(written.get("lm_head.weight"), source.get("lm_head.weight"))
        assert "lm_head.weight_scale" not in written.names() and "LM head" not in report.splitlines()[0]
    else:  # two codes a byte, within half a step of the source
        data, scales = written.get("lm_head.weight"), written.get("lm_head.weight_scale")
        assert data.dtype == torch.uint8 and data.shape == (head.shape[0], formats.padded_cols(head.shape[1], 32) // 2)
        error = (reference.dequantize("int4", data, scales, cols=head.shape[1]) - head.double()).abs()
        assert (error <= scales.double().repeat_interleave(32, 1)[:, :head.shape[1]] * 0.51 + 1e-9).all()
        assert "LM head int4" not in report.splitlines()[0]  # the same format as --to: not called out
        assert "the LM head int4" in report
    llm = LLM(str(out), dtype="float32")
    assert llm.engine.runner.model.lm_head.fmt == ("int4" if lm_head == "int4" else "f32")
    result = llm.generate([[5, 17, 33, 8]], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))[0]
    assert len(result.token_ids) == 4 and result.finish_reason == "length"
