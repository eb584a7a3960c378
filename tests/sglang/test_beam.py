"""Beam search while capturing: SGLang 0.5.19 lets any request ask for it
(``sampling_params.beam_width > 1``, at the default page size 1), and then adds the beam's
member rows to every decode batch without request ids (``append_beam_tail``). No layout
can say whose rows those are, so the capture refuses such a request (HTTP 400 through
SGLang's own beam validation) instead of letting it end the whole capture."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

pytestmark = pytest.mark.sglang

BEAM_TARGET = "sglang.srt.beam_search.coordinator.BeamCoordinator.validate_and_init"


def _decode_batch_with_a_beam() -> Any:
    """The decode ForwardBatch SGLang builds for a plain request and a beam leader of
    width 3 (two member rows), the tail appended by SGLang's own code."""
    import torch
    from sglang.srt.beam_search.batch_tail import append_beam_tail
    from sglang.srt.managers.schedule_batch import Req, ScheduleBatch
    from sglang.srt.model_executor.forward_batch_info import ForwardBatch, ForwardMode
    from sglang.srt.sampling.sampling_params import SamplingParams

    plain = Req("plain", "", [1, 2, 3], SamplingParams(max_new_tokens=4))
    leader = Req("beam", "", [1, 2, 3, 4], SamplingParams(max_new_tokens=4))
    leader.beam_group = SimpleNamespace(
        member_rows=torch.tensor([7, 8]), member_rows_cpu=torch.tensor([7, 8]),
        num_member_rows=2, retired=False)
    batch = ScheduleBatch(reqs=[plain, leader])
    batch.req_pool_indices = batch.req_pool_indices_cpu = torch.tensor([0, 1])
    batch.seq_lens = torch.tensor([10, 20])
    batch.seq_lens_cpu = torch.tensor([10, 20])
    batch.orig_seq_lens = torch.tensor([10, 20])
    batch.device = "cpu"
    append_beam_tail(batch)  # as prepare_for_decode does at every decode step
    return ForwardBatch(
        forward_mode=ForwardMode.DECODE, batch_size=len(batch.seq_lens),
        input_ids=torch.zeros(len(batch.seq_lens), dtype=torch.int64),
        req_pool_indices=batch.req_pool_indices, seq_lens=batch.seq_lens,
        seq_lens_cpu=batch.seq_lens_cpu, out_cache_loc=torch.arange(len(batch.seq_lens)),
        seq_lens_sum=int(batch.seq_lens_cpu.sum()), rids=[r.rid for r in batch.reqs])


def test_a_beams_rows_carry_no_request_id_so_no_layout_maps_them() -> None:
    from dmi_sglang.adapters.sglang_v0519.batch import layout_from_forward_batch
    from dmi_sglang.errors import CommitError

    fb = _decode_batch_with_a_beam()
    assert (len(fb.rids), len(fb.seq_lens_cpu)) == (2, 4)
    with pytest.raises(CommitError, match="differ in length"):
        layout_from_forward_batch(fb)


def test_a_beam_request_is_refused_while_capturing_and_admitted_otherwise(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from dmi_sglang.adapters.sglang_v0519 import runtime_hooks

    hooks = {target: (kind, fn) for target, kind, fn in runtime_hooks.HOOKS}
    kind, around = hooks[BEAM_TARGET]
    assert kind == "AROUND"
    seen: list[Any] = []

    def validate(coordinator: Any, req: Any, recv_req: Any) -> str | None:
        seen.append(req)
        return None

    monkeypatch.setattr(runtime_hooks, "_MONITOR", SimpleNamespace(active=True))
    monkeypatch.setattr(runtime_hooks, "_FAILED", None)
    assert around(validate, object(), "req", object()) == runtime_hooks.BEAM_REFUSED
    assert seen == []  # SGLang aborts it with this error, HTTP 400
    monkeypatch.setattr(runtime_hooks, "_FAILED", "the store failed")  # capture ended
    assert around(validate, object(), "req", object()) is None
    monkeypatch.setattr(runtime_hooks, "_MONITOR", None)  # never monitored
    assert around(validate, object(), "req2", object()) is None
    assert seen == ["req", "req2"]
