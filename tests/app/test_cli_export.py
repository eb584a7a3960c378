"""The CLI's export, show and rm on a real embedded store: what a file names, what the
terminal shows, and what standard output carries."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
from pathlib import Path

import attrs
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load

from dmi_sglang.adapters.clickhouse import ClickHouseReader, ClickHouseSink
from dmi_sglang.app.assemble import narrowed
from dmi_sglang.app.cli import main
from dmi_sglang.app.export import StoreReads
from dmi_sglang.columns import RecordBatch
from dmi_sglang.domain.records import CaptureRecord, RequestManifest, RunInfo, RunStatus
from dmi_sglang.domain.store_config import StoreConfig, StoreKind

RESID = "blocks.hook_resid_pre"
PROMPT, COMPLETION = 10, 12  # token rows [0, 21)


def _record(request: str, layer: int, rows: torch.Tensor, start: int) -> CaptureRecord:
    return CaptureRecord("run", request, RESID, layer, 0, start, start + rows.shape[0],
                         str(rows.dtype), tuple(rows.shape),
                         rows.contiguous().view(torch.uint8).numpy().tobytes(), 1)


def _store(path: Path, request: str = "r") -> str:
    """``--db`` of a committed run ``run`` of ``resid_pre@0:every(8),resid_pre@1`` with
    one complete request of 10 prompt + 12 generated tokens (positions 0, 8 and 16 of
    layer 0, every position of layer 1)."""
    config = StoreConfig(kind=StoreKind.EMBEDDED, path=str(path), flush_timeout_us=20_000)
    run = RunInfo("run", "/m", (("DMX_HOOK_SELECTION", "resid_pre@0:every(8),resid_pre@1"),),
                  ((RESID, 0), (RESID, 1)), "2026-12-01T10:00:00+00:00")
    rows = torch.arange(21 * 2, dtype=torch.float32).reshape(21, 2)
    records = [_record(request, 0, rows[p : p + 1], p) for p in (0, 8, 16)]
    records.append(_record(request, 1, rows, 0))
    sink = ClickHouseSink(config)
    try:
        sink.start_run(run)
        sink.put(RecordBatch.from_records(records))
        sink.finish_run(attrs.evolve(run, status=RunStatus.COMMITTED),
                        [RequestManifest("run", request, PROMPT, COMPLETION, committed=True)])
    finally:
        sink.close()
    return f"chdb://{path}"


def test_export_to_stdout_carries_no_log_line(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsysbinary: pytest.CaptureFixture[bytes]) -> None:
    """A variable of the original DMI integration is logged as ignored: on standard
    error, never inside the bytes ``export --out -`` writes."""
    db = _store(tmp_path / "store")
    capsysbinary.readouterr()
    monkeypatch.setenv("DMX_CH_PARALLELISM", "8")  # DMI's: "setting ignored" is logged
    assert main(["export", "run", "r", "--out", "-", "--db", db]) == 0
    captured = capsysbinary.readouterr()
    assert set(load(captured.out)) == {f"{RESID}.0", f"{RESID}.1"}
    assert b"DMX_CH_PARALLELISM" in captured.err


def test_every_k_positions_end_where_the_request_does(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``every(8)`` over positions [0, 21) keeps 0, 8, 16: the CLI's file and ``show``
    say [0, 21) every 8, as the server's export does, not a range past the request."""
    db = _store(tmp_path / "store")
    config = StoreConfig(kind=StoreKind.EMBEDDED, path=str(tmp_path / "store"))
    server = StoreReads(lambda: ClickHouseReader(config)).listing("run", "r")
    by_name = {t["name"]: t for t in server["tensors"]}  # type: ignore[attr-defined]
    assert by_name[f"{RESID}.0"]["positions"] == [0, 21, 8]
    out = tmp_path / "x.safetensors"
    assert main(["export", "run", "r", "--out", str(out), "--db", db]) == 0
    with safe_open(str(out), "pt") as f:
        positions = json.loads(f.metadata()["positions"])
        assert f.get_tensor(f"{RESID}.0")[:, 0].tolist() == [0.0, 16.0, 32.0]
    assert positions[f"{RESID}.0"] == [0, 21, 8]
    capsys.readouterr()
    assert main(["show", "run", "r", "--db", db]) == 0
    assert "[0, 21) every 8" in capsys.readouterr().out


@pytest.mark.parametrize(("start", "end", "expected"), [
    (None, None, range(0, 21, 8)), (None, 10, range(0, 10, 8)), (9, None, range(16, 21, 8)),
    (1, 8, range(8, 8, 8)), (None, -5, range(0, 0, 8)), (0, 40, range(0, 21, 8))])
def test_a_narrowed_stepped_range_stops_at_its_bounds(
        start: int | None, end: int | None, expected: range) -> None:
    got = narrowed(range(0, 21, 8), start, end)
    assert list(got) == list(expected)
    assert (got.start, got.stop, got.step) == (expected.start, expected.stop, expected.step)


def test_the_exported_file_names_the_request_not_its_escaped_form(tmp_path: Path) -> None:
    """``ls`` prints an id holding a control character escaped and ``export`` takes that
    form back: the file names the request itself."""
    db = _store(tmp_path / "store", request="r\x07")
    out = tmp_path / "x.safetensors"
    assert main(["export", "run", "r\\x07", "--out", str(out), "--db", db]) == 0
    with safe_open(str(out), "pt") as f:
        assert f.metadata()["request_id"] == "r\x07"


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_end_of_input_at_rms_question_keeps_the_run(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    db = _store(tmp_path / "store")
    monkeypatch.setattr("sys.stdin", _Terminal(""))  # a terminal at its end (Ctrl-D)
    assert main(["rm", "run", "--db", db]) == 1
    captured = capsys.readouterr()
    assert "Traceback" not in captured.err
    assert captured.out.strip().endswith("kept")
    assert main(["ls", "run", "--db", db]) == 0  # still there


def test_an_unreachable_server_store_is_one_line_on_stderr() -> None:
    done = subprocess.run(  # a process of its own: without pytest's log capture
        [sys.executable, "-m", "dmi_sglang", "ls", "--db", "http://127.0.0.1:1/captures"],
        capture_output=True, text=True, timeout=120, env={**os.environ}, check=False)
    assert done.returncode == 2
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    assert lines[0].startswith("dmi-sglang ls: cannot reach"), done.stderr


def test_rm_of_a_run_the_store_does_not_hold_asks_nothing(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    db = _store(tmp_path / "store")
    asked: list[str] = []
    monkeypatch.setattr("sys.stdin", _Terminal("y\n"))
    monkeypatch.setattr("builtins.input", lambda prompt="": asked.append(prompt) or "y")
    assert main(["rm", "no-such-run", "--db", db]) == 2
    assert asked == []
    assert "no-such-run" in capsys.readouterr().err
    assert main(["rm", "run", "--db", db]) == 0  # an existing one is asked about
    assert len(asked) == 1


def test_export_force_keeps_the_replaced_files_mode(tmp_path: Path) -> None:
    db = _store(tmp_path / "store")
    out = tmp_path / "private.safetensors"
    out.write_bytes(b"old")
    out.chmod(0o600)
    assert main(["export", "run", "r", "--out", str(out), "--force", "--db", db]) == 0
    assert out.stat().st_mode & 0o777 == 0o600
    assert set(load(out.read_bytes())) == {f"{RESID}.0", f"{RESID}.1"}


SECRET = "S3CRET-pw"


@pytest.mark.parametrize("argv", [
    ["ls", f"--db-url=http://alice:{SECRET}@h:8123/db"],  # the variable's name as a flag
    ["show", "run", "req", "--db-url", f"http://alice:{SECRET}@h/db"],
    ["rm", "run", f"http://alice:{SECRET}@h/db"],  # --db forgotten
])
def test_unknown_arguments_are_named_without_a_password(
        argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    assert main(argv) == 2
    captured = capsys.readouterr()
    assert SECRET not in captured.out + captured.err
    assert "unknown arguments" in captured.err
