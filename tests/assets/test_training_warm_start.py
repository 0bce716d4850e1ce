"""The GQA companion's warm start (training/warm_start.py): the demo model's weights under the companion's names,
and only attention left fresh."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file


@pytest.fixture
def companion(training_modules):
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(0)
    return Qwen3MoeForCausalLM(Qwen3MoeConfig(**training_modules["recipe"].GQA_MODEL_CONFIG)).eval()


def test_warm_start_copies_every_shared_weight_and_leaves_only_attention_fresh(companion, demo_dir, training_modules):
    import warm_start  # training/ is on sys.path through training_modules

    before = {name: tensor.clone() for name, tensor in companion.state_dict().items()}
    fresh = warm_start.warm_start_from_demo(companion, demo_dir)
    assert fresh and all(".self_attn." in name for name in fresh)
    state, demo = companion.state_dict(), load_file(str(demo_dir / "model.safetensors"))
    assert all(torch.equal(state[name], before[name]) for name in fresh)
    for name in ("model.embed_tokens.weight", "lm_head.weight", "model.layers.0.mlp.down_proj.weight",
                 "model.layers.2.mlp.gate.weight", "model.layers.3.post_attention_layernorm.weight"):
        assert torch.equal(state[name], demo[name].float()), name
    gate_up, down = state["model.layers.1.mlp.experts.gate_up_proj"], state["model.layers.1.mlp.experts.down_proj"]
    assert torch.equal(gate_up[5, :128], demo["model.layers.1.mlp.experts.5.gate_proj.weight"].float())  # gate first
    assert torch.equal(gate_up[5, 128:], demo["model.layers.1.mlp.experts.5.up_proj.weight"].float())
    assert torch.equal(down[5], demo["model.layers.1.mlp.experts.5.down_proj.weight"].float())


def test_a_model_of_another_shape_is_refused_by_name(demo_dir, training_modules):
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    import warm_start

    config = {**training_modules["recipe"].GQA_MODEL_CONFIG, "moe_intermediate_size": 64}
    with pytest.raises(ValueError, match="experts.gate_up_proj"):
        warm_start.warm_start_from_demo(Qwen3MoeForCausalLM(Qwen3MoeConfig(**config)), demo_dir)
