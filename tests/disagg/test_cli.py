"""`hybridmoe serve`'s PD flags are checked before anything starts."""

from __future__ import annotations

import pytest

from hybridmoe.cli import main


@pytest.mark.parametrize("argv, message", [
    (["serve", "--kv-budget", "0.5"], "--kv-budget sets the KV handoff of --pd"),
    (["serve", "--pd", "--kv-budget", "0.1"], "kv budget must be in"),
])
def test_kv_budget_is_refused_without_pd_or_out_of_range(argv, message, capsys):
    assert main(argv) == 2
    assert message in capsys.readouterr().err
