"""Start the GQA companion (Qwen3MoeForCausalLM) from the demo model's weights where the two share a shape.

Both models have the same tokenizer, width, dense first layer and routed experts, so the embedding, the output
head, the norms, layer 0's MLP, the routers' weights and the routed experts are copied; what only the demo model
has (MLA attention, the shared experts, the routers' correction biases) is left out, and the companion's
attention (q/k/v/o and the q/k norms) keeps its fresh initialisation. Training then spends its steps on the
attention, which is what the companion is for (its KV layout), instead of relearning the text.
"""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import load_file


def companion_state_from_demo(demo: dict[str, torch.Tensor], num_layers: int, num_experts: int,
                              dense_layers: set[int]) -> dict[str, torch.Tensor]:
    """The demo model's tensors under the companion's names (transformers 5's fused expert layout:
    gate_up_proj [E, 2I, H] with gate rows first, down_proj [E, H, I])."""
    state = {name: demo[name] for name in ("model.embed_tokens.weight", "model.norm.weight", "lm_head.weight")}
    for layer in range(num_layers):
        prefix = f"model.layers.{layer}."
        for norm in ("input_layernorm.weight", "post_attention_layernorm.weight"):
            state[prefix + norm] = demo[prefix + norm]
        if layer in dense_layers:
            for proj in ("gate_proj", "up_proj", "down_proj"):
                state[f"{prefix}mlp.{proj}.weight"] = demo[f"{prefix}mlp.{proj}.weight"]
            continue
        expert = [f"{prefix}mlp.experts.{e}." for e in range(num_experts)]
        state[prefix + "mlp.gate.weight"] = demo[prefix + "mlp.gate.weight"]
        state[prefix + "mlp.experts.gate_up_proj"] = torch.stack(
            [torch.cat([demo[e + "gate_proj.weight"], demo[e + "up_proj.weight"]]) for e in expert])
        state[prefix + "mlp.experts.down_proj"] = torch.stack([demo[e + "down_proj.weight"] for e in expert])
    return state


def warm_start_from_demo(model: torch.nn.Module, demo_dir: Path) -> list[str]:
    """Copy the shared weights into `model` (in its dtype); returns the names left at their initialisation,
    which must all be attention's."""
    config = model.config
    demo = load_file(str(Path(demo_dir) / "model.safetensors"))
    state = companion_state_from_demo(demo, config.num_hidden_layers, config.num_experts, set(config.mlp_only_layers))
    own = model.state_dict()
    for name, tensor in state.items():
        if own[name].shape != tensor.shape:
            raise ValueError(f"{name}: the demo model has {tuple(tensor.shape)}, the companion {tuple(own[name].shape)}")
    missing, unexpected = model.load_state_dict({k: v.to(own[k].dtype) for k, v in state.items()}, strict=False)
    if unexpected or any(".self_attn." not in name for name in missing):
        raise ValueError(f"warm start left {sorted(n for n in missing if '.self_attn.' not in n)} unset and "
                         f"{sorted(unexpected)} unused")
    return sorted(missing)
