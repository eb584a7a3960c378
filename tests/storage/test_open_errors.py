"""Clear errors before any capture: bad directories, locked stores, unreachable servers."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from dmi_sglang.adapters.clickhouse import ClickHouseReader, ClickHouseSink
from dmi_sglang.app.composition import open_sink
from dmi_sglang.app.null_sink import NullSink as NullSinkType
from dmi_sglang.domain.store_config import StoreConfig, StoreKind
from dmi_sglang.errors import StoreError

from ._support import RESID, batch_of, commit, embedded, manifest, run_info


def test_a_path_under_a_regular_file_is_refused(tmp_path: Path) -> None:
    # Tests run as root, so chmod cannot make a directory unwritable; a path under a
    # regular file can never be created, for root either.
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    target = blocker / "store"
    with pytest.raises(StoreError, match=rf"cannot create .*{target}: Not a directory"):
        ClickHouseSink(embedded(str(target)))


def test_relative_paths_are_refused() -> None:
    with pytest.raises(StoreError, match="needs an absolute directory, got 'rel/store'"):
        ClickHouseSink(embedded("rel/store"))


def test_a_missing_directory_is_created_by_the_sink_but_not_by_readers(tmp_path: Path) -> None:
    target = tmp_path / "new" / "nested" / "store"
    with pytest.raises(StoreError, match=rf"no capture store at {target}"):
        ClickHouseReader(embedded(str(target))).runs()
    assert not target.exists()
    ClickHouseSink(embedded(str(target))).close()
    assert ClickHouseReader(embedded(str(target))).runs() == []


def _in_child(code: str, timeout: float = 60) -> str:
    script = textwrap.dedent(code)
    done = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout.strip()


def test_a_store_held_by_another_process_is_a_clear_error_then_handed_over(
    open_sink: Callable[..., ClickHouseSink], store: StoreConfig
) -> None:
    sink = open_sink()
    run = run_info("run", [(RESID, 0)])
    sink.start_run(run)
    import torch

    sink.put(batch_of("run", "r", RESID, 0, torch.ones(3, 2), [0, 3]))
    commit(sink, run, [manifest("run", "r", 3, 1)])
    child = f"""
        from dmi_sglang.adapters.clickhouse import ClickHouseReader
        from dmi_sglang.app.handle import CaptureHandle
        from dmi_sglang.domain.store_config import StoreConfig, StoreKind
        from dmi_sglang.errors import StoreError
        cfg = StoreConfig(kind=StoreKind.EMBEDDED, path={store.path!r})
        try:
            print(CaptureHandle("run", "r", lambda: ClickHouseReader(cfg)).available)
        except StoreError as exc:
            print("StoreError:", exc)
    """
    out = _in_child(child)
    assert out.startswith("StoreError:"), out
    assert store.path in out
    assert f"locked by another process (pid {os.getpid()})" in out
    sink.close()  # hand the directory over
    assert _in_child(child) == "True"


def test_one_process_cannot_open_two_embedded_stores_at_once(
    open_sink: Callable[..., ClickHouseSink], tmp_path: Path
) -> None:
    open_sink()
    other = str(tmp_path / "other")
    with pytest.raises(StoreError, match=r"this process already has the embedded store .* open"):
        ClickHouseSink(embedded(other))


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_an_unreachable_server_fails_fast_with_a_clear_error() -> None:
    port = _closed_port()
    config = StoreConfig(kind=StoreKind.SERVER, host="127.0.0.1", port=port)
    started = time.monotonic()
    expected = rf"cannot reach the ClickHouse server at http://127.0.0.1:{port}/default"
    with pytest.raises(StoreError, match=expected) as info:
        ClickHouseSink(config)
    assert time.monotonic() - started < 10
    assert info.value.__cause__ is not None
    with pytest.raises(StoreError, match="cannot reach"):
        ClickHouseReader(config).runs()


def test_store_none_gives_a_counting_sink_and_no_reader() -> None:
    config = StoreConfig(kind=StoreKind.NONE)
    sink = open_sink(config)
    assert isinstance(sink, NullSinkType)
    import torch

    sink.put(batch_of("run", "r", RESID, 0, torch.ones(4, 2), [0, 1, 4]))
    sink.flush()
    sink.finish_run(run_info("run", []), [])
    sink.close()
    assert (sink.records_put, sink.bytes_put) == (2, 32)
    assert [r.run_id for r in sink.runs_finished] == ["run"]
    with pytest.raises(StoreError, match="nothing to read"):
        ClickHouseReader(config)


def test_importing_the_adapter_imports_neither_torch_nor_clickhouse() -> None:
    out = _in_child("""
        import sys
        import dmi_sglang.adapters.clickhouse
        print(sorted(m for m in ("torch", "clickhouse_connect", "chdb") if m in sys.modules))
    """)
    assert out == "[]"
