"""A stand-in for ``sglang.Engine`` that the harness's engine child can build on CPU.

Output ids are a pure function of the prompt, so stock and "monitored" engines agree;
``FAKE_DIVERGE=1`` changes the first output id of every monitored request,
``FAKE_DROP_ROWS=N`` under-reports the captured rows by N (rows incomplete),
``FAKE_RUN_FAULT=raise|exit|hang`` makes ``generate`` raise, exit the process or hang,
``FAKE_SHUTDOWN_S=S`` makes ``shutdown`` take S seconds. With
``DMX_SGLANG_ENABLE=1`` the stop RPC logs the ``dmi.stopped`` statistics a complete
capture of every request served (of the sampled ones under ``DMX_REQUEST_SAMPLE``) would
have, in SGLang's console log format; with an
embedded store (``DMX_DB_URL=chdb://...``) it also writes that capture through the real
sink, complete and committed.
"""

from __future__ import annotations

import gc
import gzip
import json
import os
import time
from pathlib import Path
from typing import Any

from harness.models import MODELS
from harness.workloads import expected_capture


class FakeEngine:
    """``generate``, ``freeze_gc``, ``get_server_info``, ``collective_rpc`` and
    ``shutdown``."""

    def __init__(self, model_path: str, **kwargs: Any) -> None:
        name = json.loads((Path(model_path) / "config.json").read_text())["hidden_size"]
        self.model = next(m for m in MODELS.values() if m.hidden == name)
        self.kwargs = kwargs
        self.served: list[tuple[int, int, bool]] = []
        self.requests: list[tuple[str, int, int]] = []
        if os.environ.get("FAKE_FAIL_START"):
            raise RuntimeError("fake engine refused to start")
        if "DMX_HOOK_SELECTION" in os.environ:  # the plugin reads its settings at start
            from dmi_sglang.domain.settings import Settings

            Settings.from_env()

    def freeze_gc(self) -> None:
        """Like SGLang's: this process's garbage collector leaves what exists now out
        (the fake has no scheduler or detokenizer process to tell)."""
        gc.freeze()

    def get_server_info(self) -> dict[str, Any]:
        return {"max_total_num_tokens": self.kwargs.get("max_total_tokens")}

    def generate(self, input_ids: list[list[int]], sampling_params: list[dict[str, Any]],
                 rid: list[str], return_hidden_states: bool = False) -> list[dict[str, Any]]:
        time.sleep(0.002)
        print(f"fake generate {rid[0]} gc frozen={gc.get_freeze_count() > 0}", flush=True)
        fault = os.environ.get("FAKE_RUN_FAULT", "")
        if fault == "raise":
            raise RuntimeError("boom in generate")
        if fault == "exit":
            os._exit(7)
        if fault == "hang":
            time.sleep(3600)
        outs = []
        for ids, params, r in zip(input_ids, sampling_params, rid, strict=True):
            n = params["max_new_tokens"]
            out = [(sum(ids) * 31 + i) % 1000 for i in range(n)]
            if os.environ.get("FAKE_DIVERGE") and os.environ["DMX_SGLANG_ENABLE"] == "1":
                out[0] += 1
            if self._captures(r):
                self.served.append((len(ids), n, False))
                self.requests.append((r, len(ids), n))
            meta: dict[str, Any] = {"id": r, "prompt_tokens": len(ids), "completion_tokens": n}
            if return_hidden_states:
                meta["hidden_states"] = [[0.5] * 8 for _ in range(n)]
            outs.append({"output_ids": out, "meta_info": meta})
        return outs

    @staticmethod
    def _captures(rid: str) -> bool:
        """Whether the monitored engine would capture request ``rid``
        (``DMX_REQUEST_SAMPLE``, by the domain's rule)."""
        from dmi_sglang.domain.sampling import RequestSample

        return RequestSample(float(os.environ.get("DMX_REQUEST_SAMPLE", "1"))).keeps(rid)

    def start_profile(self, *, output_dir: str, num_steps: int, activities: list[str],
                      with_stack: bool, record_shapes: bool) -> None:
        """Like SGLang's: the next ``num_steps`` forwards, written as a trace after them.
        Each step: the scheduler thread's forward (1 ms, a 0.8 ms kernel in it) inside
        dmi_sglang's ``around_forward`` (1.2 ms, an ``aten::copy_`` of 30 us in it after
        the forward); the drain thread's 0.5 ms append."""
        assert activities == ["CPU", "GPU"]
        assert with_stack
        assert not record_shapes
        events: list[dict[str, Any]] = [
            {"ph": "M", "name": "thread_name", "tid": 1, "args": {"name": "MainThread"}},
            {"ph": "M", "name": "thread_name", "tid": 2, "args": {"name": "dmi-capture-drain"}}]
        hooks = "/x/dmi_sglang/adapters/sglang_v0519/runtime_hooks.py(104): around_forward"
        for i in range(num_steps):
            t = 10_000.0 + i * 3000
            events += [
                {"ph": "X", "cat": "python_function", "name": hooks, "tid": 1, "ts": t - 100,
                 "dur": 1200},
                {"ph": "X", "cat": "python_function", "tid": 1, "ts": t, "dur": 1000,
                 "name": "/x/sglang/srt/model_executor/model_runner.py(9): forward"},
                {"ph": "X", "cat": "cpu_op", "name": "aten::copy_", "tid": 1, "ts": t + 1050,
                 "dur": 30},
                {"ph": "X", "cat": "kernel", "name": "gemm", "tid": 7, "ts": t + 100,
                 "dur": 800},
                {"ph": "X", "cat": "python_function", "tid": 2, "ts": t + 1500, "dur": 500,
                 "name": "/x/dmi_sglang/adapters/transport/_window.py(9): append"}]
        path = Path(output_dir) / "fake-TP-0.trace.json.gz"
        path.parent.mkdir(parents=True, exist_ok=True)
        with gzip.open(path, "wt") as f:
            json.dump({"traceEvents": events}, f)

    def collective_rpc(self, method: str) -> None:
        assert method == "dmi_stop_monitoring"
        got = expected_capture(os.environ["DMX_HOOK_SELECTION"], self.model, self.served)
        rows = got.rows - int(os.environ.get("FAKE_DROP_ROWS", "0"))
        print(f"2026-12-01 00:00:00 [info     ] dmi.stopped    bytes={got.bytes} "
              f"rows={rows} forced_eager=0 run_id='x'", flush=True)
        url = os.environ.get("DMX_DB_URL", "none")
        if url.startswith("chdb://"):
            stored = self._store(url.removeprefix("chdb://"))
            print(f"2026-12-01 00:00:00 [info     ] store.closed   bytes_stored={stored}",
                  flush=True)

    def _store(self, path: str) -> int:
        """A complete capture of every request served, through the real sink: one record
        per (request, hook, layer) over the domain's coverage, manifests committed."""
        import attrs

        from dmi_sglang.adapters.clickhouse import ClickHouseSink
        from dmi_sglang.adapters.sglang_v0519.facts import QWEN3_HOOKS
        from dmi_sglang.columns import RecordBatch
        from dmi_sglang.domain.hooks import ModelHooks, parse_selection
        from dmi_sglang.domain.records import (
            CaptureRecord,
            RequestManifest,
            RunInfo,
            RunStatus,
            expected_coverage,
        )
        from dmi_sglang.domain.shapes import ModelShape
        from dmi_sglang.domain.store_config import StoreConfig, StoreKind

        m = self.model
        hooks = ModelHooks("Qwen3ForCausalLM", QWEN3_HOOKS, m.layers)
        selection = parse_selection(os.environ["DMX_HOOK_SELECTION"]).resolve(hooks)
        captures = selection.captures()
        shape = ModelShape(m.layers, m.hidden, m.heads, m.kv_heads, m.head_dim,
                           m.intermediate, m.vocab)
        run_id = os.environ["DMX_MODEL_ID"]
        run = RunInfo(run_id, "/fake", (), tuple((h.act_name, layer) for h, layer in captures),
                      "2026-12-01T00:00:00+00:00")
        sink = ClickHouseSink(StoreConfig(kind=StoreKind.EMBEDDED, path=path))
        sink.start_run(run)
        manifests, stored = [], 0
        for rid, prompt, completion in self.requests:
            for hook, layer in captures:
                cover = expected_coverage(hook, prompt_tokens=prompt,
                                          completion_tokens=completion,
                                          overlap_extra_forward=False)
                row = shape.capture_row(selection, hook, layer)
                payload = bytes(cover.rows * row.nbytes)
                stored += len(payload)
                sink.put(RecordBatch.from_records([CaptureRecord(
                    model_id=run_id, request_id=rid, act_name=hook.act_name, layer_no=layer,
                    shard_rank=0, start_token_idx=cover.start, end_token_idx=cover.end,
                    dtype=str(row.dtype.value), shape=(cover.rows, *row.dims),
                    payload=payload, seq=1)]))
            manifests.append(RequestManifest(run_id, rid, prompt, completion, committed=True))
        sink.finish_run(attrs.evolve(run, status=RunStatus.COMMITTED), manifests)
        sink.close()
        return stored

    def shutdown(self) -> None:
        time.sleep(float(os.environ.get("FAKE_SHUTDOWN_S", "0")))
