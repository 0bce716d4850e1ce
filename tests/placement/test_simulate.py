"""`simulate`: the record schema and the strategies' ordering on the paper's hardware."""

from __future__ import annotations

import pytest

from hybridmoe.placement.what_if import Simulation

FIELDS = ["model", "hardware", "gpus", "strategy", "weight_format", "prompt_tokens", "ttft_s", "prefill_tok_s",
          "decode_tok_s"]


@pytest.mark.slow
def test_strategies_records_and_longest_prompt():
    sim = Simulation("deepseek-v3", "rtx5090,epyc-genoa-2s", gpus=2)
    records = sim.run(formats=("fp8",), prompts=(32768,))
    assert [r.strategy for r in records if not r.longest_within_30s] == ["cpu-only", "hybrid", "slp", "slp-2gpu"]
    by = {(r.strategy, r.longest_within_30s): r for r in records}
    assert list(by[("slp", False)].to_json())[:9] == FIELDS
    ttft = {s: by[(s, False)].ttft_s for s in ("cpu-only", "hybrid", "slp", "slp-2gpu")}
    assert ttft["slp-2gpu"] < ttft["slp"] < ttft["hybrid"] < ttft["cpu-only"]
    for s in ("slp", "slp-2gpu"):
        longest = by[(s, True)]
        assert longest.ttft_s <= 30.0 and longest.prompt_tokens % 256 == 0
        assert sim.ttft_s(s, "fp8", longest.prompt_tokens + 256) > 30.0
    assert by[("hybrid", False)].decode_tok_s > by[("cpu-only", False)].decode_tok_s


def test_cpu_only_hardware_and_bad_arguments():
    sim = Simulation("qwen3-30b-a3b", "desktop-2ch")
    assert sim.strategies() == ["cpu-only"]
    records = sim.run(formats=("int4",), prompts=(1024,), longest=False)
    assert len(records) == 1 and records[0].gpus == 0 and records[0].ttft_s > 0
    with pytest.raises(ValueError, match="no GPU part"):
        Simulation("qwen3-30b-a3b", "desktop-2ch", gpus=2)
