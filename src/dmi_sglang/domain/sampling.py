"""Which requests a run captures: a deterministic sample, and the caller's own choice.

``DMX_REQUEST_SAMPLE`` (a fraction from 0 to 1) captures a request when a hash of its id
falls below the fraction: the same ids are sampled on every run, so a rerun with
caller-supplied request ids captures the same requests (SGLang's own ids are random
uuids). A request can override the sample: SGLang passes its sampling parameters'
``custom_params`` to the scheduler untouched, and ``custom_params["dmi_capture"]``
``true`` captures it, ``false`` leaves it out (the HTTP APIs accept the same field).
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from typing import Any

import attrs

__all__ = ["CAPTURE_PARAM", "RequestSample", "with_capture_param"]

CAPTURE_PARAM = "dmi_capture"
"""The key of ``custom_params`` through which a request asks to be captured or not."""

_SCALE = float(1 << 64)


def _unsigned_zero(value: float) -> float:
    """``value``, with -0 read as 0 (as it is printed)."""
    return value + 0.0


@attrs.frozen
class RequestSample:
    """The share of requests captured (``rate``, from 0 to 1)."""

    rate: float = attrs.field(default=1.0, converter=_unsigned_zero)

    @rate.validator
    def _check(self, _attribute: object, value: float) -> None:
        if not 0.0 <= value <= 1.0:
            msg = f"request sample rate {value!r} is outside 0 to 1"
            raise ValueError(msg)

    def keeps(self, request_id: str) -> bool:
        """True when the sample holds ``request_id`` (a pure function of the id)."""
        if self.rate >= 1.0:
            return True
        if self.rate <= 0.0:
            return False
        digest = hashlib.sha256(request_id.encode("utf-8", "surrogatepass")).digest()
        return int.from_bytes(digest[:8], "big") / _SCALE < self.rate

    def decide(self, request_id: str, asked: object = None) -> bool:
        """Whether to capture a request: what it asked for (``True`` / ``False`` as its
        ``custom_params["dmi_capture"]``), else the sample's answer. Any other value
        counts as not asked."""
        if asked is True or asked is False:
            return asked
        return self.keeps(request_id)


def with_capture_param(sampling_params: object, capture: object) -> Any:
    """SGLang ``sampling_params`` (None, a dict, or a list of dicts for a batch) with
    ``custom_params["dmi_capture"]`` set to ``capture`` (True / False, or one per prompt
    as a list), as new dicts (the caller's are not changed).

    Raises:
        ValueError: ``capture`` is not a bool or a list of bools, or a list whose length
            differs from a list of sampling parameters.
    """
    accepted = "True, False, or a list of them (one per prompt)"
    if isinstance(capture, bool):
        wanted: bool | list[bool] = capture
    elif (isinstance(capture, Sequence) and not isinstance(capture, str)
          and all(isinstance(c, bool) for c in capture)):
        wanted = list(capture)
    else:
        msg = f"dmi_capture={capture!r} is invalid; accepted: {accepted}"
        raise ValueError(msg)

    def one(params: object, value: bool) -> dict[str, Any]:
        if params is not None and not isinstance(params, Mapping):
            msg = f"sampling_params {params!r} is not a dict: cannot add dmi_capture"
            raise ValueError(msg)
        out = dict(params or {})
        custom = out.get("custom_params")
        out["custom_params"] = {**(custom if isinstance(custom, Mapping) else {}),
                                CAPTURE_PARAM: value}
        return out

    if isinstance(wanted, bool):
        if isinstance(sampling_params, list):
            return [one(p, wanted) for p in sampling_params]
        return one(sampling_params, wanted)
    if isinstance(sampling_params, list):
        if len(sampling_params) != len(wanted):
            msg = (f"dmi_capture has {len(wanted)} values for {len(sampling_params)} "
                   "sampling_params")
            raise ValueError(msg)
        return [one(p, w) for p, w in zip(sampling_params, wanted, strict=True)]
    return [one(sampling_params, w) for w in wanted]
