"""Request selection: a deterministic sample by request id, and the caller's own ask."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from dmi_sglang.domain.sampling import CAPTURE_PARAM, RequestSample, with_capture_param


@given(st.text(max_size=40), st.floats(min_value=0.0, max_value=1.0))
def test_the_sample_is_a_function_of_the_request_id(rid: str, rate: float) -> None:
    assert RequestSample(rate).keeps(rid) == RequestSample(rate).keeps(rid)
    assert RequestSample(1.0).keeps(rid)
    assert not RequestSample(0.0).keeps(rid)


def test_the_sample_keeps_about_its_rate_and_grows_with_it() -> None:
    ids = [f"req-{i}" for i in range(20_000)]
    tenth = {r for r in ids if RequestSample(0.1).keeps(r)}
    # binomial(20000, 0.1): mean 2000, sd 42; five sd either way
    assert 1_790 <= len(tenth) <= 2_210
    half = {r for r in ids if RequestSample(0.5).keeps(r)}
    assert tenth <= half  # a larger rate keeps every request a smaller one keeps


def test_a_request_that_asks_overrides_the_sample() -> None:
    none, every = RequestSample(0.0), RequestSample(1.0)
    assert none.decide("a", True)
    assert not every.decide("a", False)
    assert every.decide("a", "no")  # not a bool: not an ask
    assert not none.decide("a", None)


@pytest.mark.parametrize("rate", [-0.1, 1.5, float("nan")])
def test_a_rate_outside_zero_to_one_is_refused(rate: float) -> None:
    with pytest.raises(ValueError, match="outside 0 to 1"):
        RequestSample(rate)


def test_the_ask_travels_in_custom_params_of_every_shape_of_sampling_params() -> None:
    mine = {"temperature": 0.0, "custom_params": {"other": 1}}
    one = with_capture_param(mine, False)
    assert one == {"temperature": 0.0, "custom_params": {"other": 1, CAPTURE_PARAM: False}}
    assert mine == {"temperature": 0.0, "custom_params": {"other": 1}}  # not changed
    assert with_capture_param(None, True) == {"custom_params": {CAPTURE_PARAM: True}}
    assert with_capture_param([{}, None], True) == [{"custom_params": {CAPTURE_PARAM: True}}] * 2
    assert with_capture_param({}, [True, False]) == [
        {"custom_params": {CAPTURE_PARAM: True}}, {"custom_params": {CAPTURE_PARAM: False}}]
    with pytest.raises(ValueError, match="dmi_capture='yes' is invalid; accepted: True, False"):
        with_capture_param(None, "yes")
    with pytest.raises(ValueError, match="2 values for 3 sampling_params"):
        with_capture_param([{}, {}, {}], [True, False])
