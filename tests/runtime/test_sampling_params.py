"""SamplingParams: defaults, normalisation of stop, validation messages, is_greedy."""

from __future__ import annotations

import pytest

from hybridmoe.runtime.sampling_params import SamplingParams


def test_defaults():
    params = SamplingParams()
    assert (params.temperature, params.top_k, params.top_p, params.min_p) == (1.0, 0, 1.0, 0.0)
    assert (params.repetition_penalty, params.seed, params.max_tokens, params.ignore_eos) == (1.0, None, 16, False)
    assert params.stop == [] and params.stop_token_ids == [] and params.skip_special_tokens
    assert not params.is_greedy


def test_stop_accepts_a_single_string_and_sequences():
    assert SamplingParams(stop="###").stop == ["###"]
    assert SamplingParams(stop=("a", "b")).stop == ["a", "b"]
    assert SamplingParams(stop=None, stop_token_ids=None).stop == []
    assert SamplingParams(stop_token_ids=(3, 4)).stop_token_ids == [3, 4]


def test_is_greedy():
    assert SamplingParams(temperature=0).is_greedy
    assert SamplingParams(temperature=0.0, top_k=5, seed=3).is_greedy
    assert not SamplingParams(temperature=0.01).is_greedy


@pytest.mark.parametrize(
    "field, value",
    [
        ("temperature", -0.1),
        ("temperature", float("nan")),
        ("temperature", float("inf")),
        ("top_p", 0.0),
        ("top_p", 1.5),
        ("top_k", -2),
        ("top_k", 2.5),
        ("min_p", -0.1),
        ("min_p", 1.1),
        ("repetition_penalty", 0.0),
        ("repetition_penalty", -1.0),
        ("max_tokens", 0),
        ("max_tokens", True),
        ("seed", 1.5),
        ("ignore_eos", 1),
        ("stop", [""]),
        ("stop", ["ok", 3]),
        ("stop_token_ids", [-1]),
        ("stop_token_ids", ["7"]),
        ("temperature", "hot"),
        ("logit_bias", {5: 100.5}),
        ("logit_bias", {5: -101}),
        ("logit_bias", {-1: 1.0}),
        ("logit_bias", {"5": 1.0}),
        ("logit_bias", {5: float("nan")}),
    ],
)
def test_invalid_values_name_the_field_and_value(field, value):
    with pytest.raises(ValueError) as error:
        SamplingParams(**{field: value})
    message = str(error.value)
    assert f"SamplingParams.{field}" in message
    assert repr(value) in message


def test_valid_edges_are_accepted():
    SamplingParams(temperature=0.0, top_p=1.0, top_k=-1, min_p=1.0, repetition_penalty=0.01, max_tokens=1, seed=0)


def test_logit_bias():
    assert SamplingParams().logit_bias is None
    assert SamplingParams(logit_bias={}).logit_bias is None
    assert SamplingParams(logit_bias={3: -100, 7: 100.0}).logit_bias == {3: -100, 7: 100.0}
    with pytest.raises(ValueError, match="logit_bias must be a dict"):
        SamplingParams(logit_bias=[(3, 1.0)])
