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

import attrs

__all__ = ["CAPTURE_PARAM", "RequestSample"]

CAPTURE_PARAM = "dmi_capture"
"""The key of ``custom_params`` through which a request asks to be captured or not."""

_SCALE = float(1 << 64)


@attrs.frozen
class RequestSample:
    """The share of requests captured (``rate``, from 0 to 1)."""

    rate: float = attrs.field(default=1.0)

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
