"""Import hygiene of the transport package, and the MemorySink test double."""

from __future__ import annotations

import subprocess
import sys

import pytest

from dmi_sglang.columns import RecordBatch
from dmi_sglang.domain.records import CaptureRecord
from dmi_sglang.errors import StoreError
from dmi_sglang.testing import MemorySink


def test_importing_the_transport_does_not_import_sglang():
    code = (
        "import sys, dmi_sglang.adapters.transport as t, dmi_sglang.testing; "
        "assert 'sglang' not in sys.modules, 'sglang imported'; "
        "assert 'dmi_sglang.adapters.transport' in sys.modules; print('ok')"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"


def test_importing_the_testing_module_does_not_import_torch():
    code = "import sys, dmi_sglang.testing; assert 'torch' not in sys.modules; print('ok')"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)
    assert out.returncode == 0, out.stderr


def _record(i: int) -> CaptureRecord:
    return CaptureRecord("run", "req", "blocks.hook_resid_pre", 0, 0, i, i + 1,
                         "torch.bfloat16", (1, 2), b"abcd", seq=i)


def _batch(*starts: int) -> RecordBatch:
    return RecordBatch.from_records([_record(i) for i in starts])


def test_memory_sink_keeps_records_and_counts():
    sink = MemorySink()
    sink.put(_batch(0, 1))
    sink.flush()
    sink.close()
    assert [r.start_token_idx for r in sink.records] == [0, 1]
    assert (sink.rows, sink.payload_bytes, sink.puts, sink.flushes, sink.closed) == (
        2, 8, 1, 1, True,
    )


def test_memory_sink_without_records_only_counts():
    sink = MemorySink(keep_records=False)
    sink.put(_batch(0))
    assert sink.records == []
    assert sink.rows == 1


def test_memory_sink_failures_are_sticky():
    sink = MemorySink(fail_on_put=2)
    sink.put(_batch(0))
    with pytest.raises(StoreError, match="put #2"):
        sink.put(_batch(1))
    for call in (sink.flush, sink.close, lambda: sink.put(_batch(2))):
        with pytest.raises(StoreError, match="put #2"):
            call()
    assert len(sink.records) == 1
