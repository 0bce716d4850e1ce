"""Request and RequestStatus: token bookkeeping and token-level stop rules."""

from __future__ import annotations

import pytest

from hybridmoe.runtime.request import Request, RequestStatus
from hybridmoe.runtime.sampling_params import SamplingParams

EOS = 2


def _request(**params) -> Request:
    return Request("r", [5, 6, 7], SamplingParams(**params), eos_token_ids=(EOS, 3), arrival_time=1.0)


def test_status_is_finished():
    finished = {s for s in RequestStatus if s.is_finished}
    assert finished == {
        RequestStatus.FINISHED_STOPPED,
        RequestStatus.FINISHED_LENGTH,
        RequestStatus.FINISHED_ABORTED,
        RequestStatus.FINISHED_ERROR,
    }


def test_token_bookkeeping():
    request = _request(max_tokens=5)
    assert request.status is RequestStatus.WAITING and request.num_computed_tokens == 0
    assert not request.append_output_token(9)
    assert not request.append_output_token(10)
    assert request.all_token_ids == [5, 6, 7, 9, 10]
    assert (request.num_prompt_tokens, request.num_output_tokens, request.num_tokens) == (3, 2, 5)
    request.all_token_ids.append(1)  # a copy: the request is unchanged
    assert request.num_tokens == 5


def test_max_tokens_ends_with_length():
    request = _request(max_tokens=2)
    assert not request.append_output_token(9)
    assert request.append_output_token(10)
    assert request.status is RequestStatus.FINISHED_LENGTH and request.finish_reason == "length"
    with pytest.raises(ValueError, match="already finished"):
        request.append_output_token(11)


@pytest.mark.parametrize("eos", [EOS, 3])
def test_eos_ends_with_stop(eos):
    request = _request()
    assert request.append_output_token(eos)
    assert request.status is RequestStatus.FINISHED_STOPPED and request.finish_reason == "stop"
    assert request.output_token_ids == [eos]


def test_ignore_eos_keeps_going_but_stop_token_ids_still_stop():
    request = _request(ignore_eos=True, stop_token_ids=[42], max_tokens=10)
    assert not request.append_output_token(EOS)
    assert request.append_output_token(42)
    assert request.finish_reason == "stop" and request.output_token_ids == [EOS, 42]


def test_stop_beats_length_on_the_last_token():
    request = _request(max_tokens=1)
    assert request.append_output_token(EOS)
    assert request.finish_reason == "stop"


def test_finish_rejects_unfinished_status_and_defaults_reason():
    request = _request()
    with pytest.raises(ValueError, match="RUNNING is not a finished status"):
        request.finish(RequestStatus.RUNNING)
    request.finish(RequestStatus.FINISHED_ABORTED)
    assert request.finish_reason == "abort" and request.is_finished


def test_requests_compare_by_identity():
    assert _request() != _request()
