"""A continuation run's start (training/train.py initialise_from): weights alone, or weights and AdamW moments."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture
def train_module(training_modules):
    import train  # training/ is on sys.path through training_modules

    return train


def _step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, seed: int) -> None:
    x = torch.randn(8, 6, generator=torch.Generator().manual_seed(seed))  # [B, in]
    loss = model(x).pow(2).mean()
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    optimizer.step()


def _model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Tanh(), torch.nn.Linear(5, 3))


@pytest.mark.parametrize("with_optimizer", [True, False])
def test_continuation_takes_the_source_runs_state(train_module, tmp_path, with_optimizer):
    source_model = _model(seed=0)
    source_optimizer = train_module.build_optimizer(source_model)
    for seed in range(3):
        _step(source_model, source_optimizer, seed)
    checkpoint = tmp_path / "checkpoint.pt"
    torch.save({"model": source_model.state_dict(), "optimizer": source_optimizer.state_dict(), "step": 3},
               checkpoint)

    model = _model(seed=1)  # other initial weights, which the source's must replace
    optimizer = train_module.build_optimizer(model)
    train_module.initialise_from(checkpoint, model, optimizer if with_optimizer else None)
    for mine, theirs in zip(model.parameters(), source_model.parameters()):
        assert torch.equal(mine, theirs)
    assert bool(optimizer.state) == with_optimizer

    # The next step: with the moments carried, exactly the step the source run would have taken; with a fresh
    # optimiser, a different one (Adam's first step moves every weight by about the rate).
    _step(source_model, source_optimizer, seed=3)
    _step(model, optimizer, seed=3)
    same = all(torch.allclose(a, b, rtol=0, atol=1e-7) for a, b in zip(model.parameters(), source_model.parameters()))
    assert same == with_optimizer
