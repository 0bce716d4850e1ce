"""Loading real-world checkpoint layouts and failing clearly on broken ones."""

from __future__ import annotations

import json
import shutil
import warnings

import pytest
import torch
from safetensors.torch import load_file, save_file

from hybridmoe.checkpoint.safetensors_reader import CheckpointError, CheckpointReader
from hybridmoe.config import load_config
from hybridmoe.layers.moe.torch_backend import TorchExpertBackend
from hybridmoe.models.decoder import build_decoder
from hybridmoe.models.loader import load_model
from hybridmoe.models.weight_loader import WeightLoader
from hybridmoe.runtime.model_runner import ModelRunner, SequenceChunk


def _copy(src, dst):
    shutil.copytree(src, dst)
    return dst


def _logits(model_dir):
    runner = ModelRunner(load_model(model_dir, "float32"), num_blocks=4, block_size=8)
    return runner.forward([SequenceChunk([5, 9, 17, 33, 2], 0, [0])], all_logits=True)


def test_multi_token_prediction_layer_is_skipped(tiny_model_dir, tmp_path):
    src = tiny_model_dir("deepseek_v3")
    dst = _copy(src, tmp_path / "with_mtp")
    tensors = load_file(str(dst / "model.safetensors"))
    num_layers = json.loads((dst / "config.json").read_text())["num_hidden_layers"]
    for name in [k for k in tensors if k.startswith("model.layers.1.")]:  # an MTP layer has a decoder layer's names
        tensors[name.replace("model.layers.1.", f"model.layers.{num_layers}.")] = tensors[name].clone()
    tensors[f"model.layers.{num_layers}.eh_proj.weight"] = torch.randn(64, 128)
    tensors[f"model.layers.{num_layers}.enorm.weight"] = torch.ones(64)
    save_file(tensors, str(dst / "model.safetensors"))
    raw = json.loads((dst / "config.json").read_text())
    raw["num_nextn_predict_layers"] = 1
    (dst / "config.json").write_text(json.dumps(raw))
    assert torch.equal(_logits(dst), _logits(src))


def test_missing_tensor_names_it(tiny_model_dir, tmp_path):
    dst = _copy(tiny_model_dir("qwen3_moe"), tmp_path / "missing")
    tensors = load_file(str(dst / "model.safetensors"))
    del tensors["model.layers.1.mlp.experts.3.up_proj.weight"]
    save_file(tensors, str(dst / "model.safetensors"))
    with pytest.raises(CheckpointError, match="missing tensor 'model.layers.1.mlp.experts.3.up_proj.weight'"):
        load_model(dst, "float32")


def test_wrong_shape_names_tensor_and_file(tiny_model_dir, tmp_path):
    dst = _copy(tiny_model_dir("mixtral"), tmp_path / "shape")
    tensors = load_file(str(dst / "model.safetensors"))
    tensors["model.layers.0.self_attn.q_proj.weight"] = torch.randn(32, 64)
    save_file(tensors, str(dst / "model.safetensors"))
    with pytest.raises(CheckpointError, match=r"model\.safetensors: tensor 'model.layers.0.self_attn.q_proj.weight' "
                                              r"has shape \[32, 64\], expected \[64, 64\]"):
        load_model(dst, "float32")


def test_truncated_checkpoint_is_reported_before_loading(tiny_model_dir, tmp_path):
    dst = _copy(tiny_model_dir("deepseek_v3"), tmp_path / "truncated")
    path = dst / "model.safetensors"
    path.write_bytes(path.read_bytes()[:-1000])
    with pytest.raises(CheckpointError, match=r"model\.safetensors: truncated: tensor"):
        load_model(dst, "float32")


def _loaded_bf16(tiny_model_dir, dtype: torch.dtype):
    """A bf16 checkpoint built at compute dtype `dtype`, and the address range of its mapped file."""
    model_dir = tiny_model_dir("qwen3_moe", dtype=torch.bfloat16)
    reader = CheckpointReader(model_dir)
    config = load_config(model_dir)
    model = build_decoder(config, WeightLoader(reader, config, dtype), TorchExpertBackend)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        mapped = torch.frombuffer(next(iter(reader._maps.values())), dtype=torch.uint8)
    return model, range(mapped.data_ptr(), mapped.data_ptr() + mapped.numel())


def test_bfloat16_weights_are_views_of_the_mapped_file(tiny_model_dir):
    model, mapped = _loaded_bf16(tiny_model_dir, torch.bfloat16)
    experts = model.layers[1].mlp.experts.w
    for tensor in (experts.gate[0], experts.down[-1], model.layers[0].attention.w.q_proj.weight, model.embed):
        assert tensor.data_ptr() in mapped  # no copy was made


def test_bfloat16_projections_stay_views_under_float32(tiny_model_dir):
    # converted, they would double the bytes a decode step reads; the embedding (not a projection) is converted
    model, mapped = _loaded_bf16(tiny_model_dir, torch.float32)
    attention = model.layers[0].attention.w
    for projection in (attention.q_proj, attention.o_proj, model.lm_head):
        assert projection.fmt == "bf16" and projection.data.data_ptr() in mapped
    assert model.embed.dtype == torch.float32
