"""CLI inputs that were accepted and should be refused, and reports that left out what
they should say (review): each refusal is one line naming the flag and its value,
before any GPU is looked for."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import Any

import pytest

from dmi_sglang.app import cli_commands, cli_serve
from dmi_sglang.app.cli import main

torch = pytest.importorskip("torch")


@pytest.fixture
def clean_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    for key in [k for k in os.environ if k.startswith("DMX_")]:
        monkeypatch.delenv(key)
    monkeypatch.chdir(tmp_path)


@pytest.fixture
def no_gpu_lookup(monkeypatch: pytest.MonkeyPatch) -> None:
    def looked() -> str:
        raise AssertionError("the GPU was looked for before the arguments were checked")

    monkeypatch.setattr(cli_commands, "gpu_problem", looked)


def _model(base: Path) -> Path:
    (base / "m").mkdir(exist_ok=True)
    (base / "m" / "config.json").write_text("{}")
    return base / "m"


def test_demo_model_refuses_to_overwrite_an_existing_checkpoint(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    mine = tmp_path / "my-checkpoint"
    mine.mkdir()
    (mine / "config.json").write_text('{"mine": 1}')
    assert main(["demo-model", str(mine), "--layers", "1"]) == 2
    err = capsys.readouterr().err
    assert f"{mine} already holds a checkpoint" in err
    assert err.count("\n") == 1
    assert (mine / "config.json").read_text() == '{"mine": 1}'


@pytest.mark.parametrize(("where", "says"), [
    ("a-file", "File exists"), ("a-file/sub", "Not a directory")])
def test_demo_model_names_a_path_it_cannot_write_in_one_line(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], where: str, says: str) -> None:
    (tmp_path / "a-file").write_text("mine")
    assert main(["demo-model", str(tmp_path / where), "--layers", "1"]) == 2
    err = capsys.readouterr().err
    assert err == (f"dmi-sglang demo-model: {tmp_path / where}: {says}; give a new or empty "
                   "directory\n")
    assert (tmp_path / "a-file").read_text() == "mine"


@pytest.mark.parametrize("command", ["capture", "serve"])
@pytest.mark.usefixtures("clean_env", "no_gpu_lookup")
def test_an_empty_run_id_is_refused_not_replaced_by_a_generated_one(
        command: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    flag = "--model" if command == "capture" else "--model-path"
    assert main([command, flag, str(_model(tmp_path)), "--run-id", ""]) == 2
    err = capsys.readouterr().err
    assert "--run-id '' is empty" in err
    assert "GPU" not in err


@pytest.mark.usefixtures("clean_env")
def test_reference_capture_refuses_an_empty_run_id(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["reference-capture", "--run-id", " ", "--max-new-tokens", "1",
                 "--prompt", "w1", "--db", f"chdb://{tmp_path}/captures"]) == 2
    assert "--run-id ' ' is empty" in capsys.readouterr().err
    assert not (tmp_path / "captures").exists()


@pytest.mark.usefixtures("clean_env")
def test_serve_refuses_an_empty_db_instead_of_capturing_into_the_default_store(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    """``--db ''`` dropped DMX_DB_URL and served into ./dmi-captures."""
    from dmi_sglang.app.cli import _parser

    monkeypatch.setenv("DMX_DB_URL", f"chdb://{tmp_path}/wanted")
    execs: list[Any] = []
    args, extra = _parser().parse_known_args(
        ["serve", "--model-path", str(_model(tmp_path)), "--db", ""])
    with contextlib.suppress(Exception):
        cli_serve.serve(args, extra, gpu_problem=lambda: None,
                        execv=lambda path, argv: execs.append(argv))
    assert execs == []
    assert main(["serve", "--model-path", str(_model(tmp_path)), "--db", ""]) == 2
    assert "--db ''" in capsys.readouterr().err


@pytest.mark.usefixtures("clean_env", "no_gpu_lookup")
def test_an_empty_model_is_named_as_empty(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["capture", "--model", "", "--prompt", "x"]) == 2
    assert "--model '' is empty" in capsys.readouterr().err


def _partial_store(path: Path) -> str:
    """An interrupted run of resid_pre at layers 0 and 1 that stored layer 0 only."""
    from dmi_sglang.app.composition import open_sink
    from dmi_sglang.columns import RecordBatch
    from dmi_sglang.domain.records import CaptureRecord, RunInfo
    from dmi_sglang.domain.store_config import StoreConfig, StoreKind

    caps = (("blocks.hook_resid_pre", 0), ("blocks.hook_resid_pre", 1))
    run = RunInfo("part-1", "/m/demo", (("DMX_HOOK_SELECTION", "resid_pre"),), caps,
                  "2026-11-29T00:00:00+00:00")
    t = torch.randn(4, 8).bfloat16()
    rec = CaptureRecord("part-1", "req-0", "blocks.hook_resid_pre", 0, 0, 0, 4, str(t.dtype),
                        tuple(t.shape), t.view(torch.uint8).numpy().tobytes(), 1)
    sink = open_sink(StoreConfig(kind=StoreKind.EMBEDDED, path=str(path)))
    sink.start_run(run)
    sink.put(RecordBatch.from_records([rec]))
    sink.close()  # never finished
    return f"chdb://{path}"


def test_a_partial_export_and_show_say_what_they_left_out(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    url = _partial_store(tmp_path / "captures")
    out = tmp_path / "x.safetensors"
    assert main(["export", "part-1", "req-0", "--partial", "--out", str(out),
                 "--db", url]) == 0
    said = capsys.readouterr().out
    assert "partial, the stored positions only" in said
    assert "nothing stored of 1 capture(s): blocks.hook_resid_pre.1" in said
    assert main(["show", "part-1", "req-0", "--partial", "--db", url]) == 0
    assert "nothing stored of 1 capture(s): blocks.hook_resid_pre.1" in capsys.readouterr().out


def test_a_partial_export_to_stdout_says_on_stderr_what_it_left_out(
        tmp_path: Path, capsysbinary: pytest.CaptureFixture[bytes]) -> None:
    from safetensors.torch import load

    url = _partial_store(tmp_path / "captures")
    capsysbinary.readouterr()  # the store's own log while it was made
    assert main(["export", "part-1", "req-0", "--partial", "--out", "-", "--db", url]) == 0
    out, err = capsysbinary.readouterr()
    assert list(load(out)) == ["blocks.hook_resid_pre.0@0-4"]  # stdout: the file alone
    assert err.decode() == ("exported 1 tensors to stdout: partial, the stored positions "
                            "only; nothing stored of 1 capture(s): blocks.hook_resid_pre.1\n")


def test_partial_reads_of_a_complete_request_say_it_is_complete(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from tests.app.test_cli import RUN, _populate

    _populate(tmp_path / "captures")
    url = f"chdb://{tmp_path}/captures"
    assert main(["show", RUN, "req-0", "--partial", "--db", url]) == 0
    said = capsys.readouterr().out
    assert "(--partial: the request is complete)" in said
    assert "partial: stored positions only" not in said
    out = tmp_path / "x.safetensors"
    assert main(["export", RUN, "req-0", "--partial", "--out", str(out), "--db", url]) == 0
    assert capsys.readouterr().out.rstrip().endswith(
        "the request is complete: every position is in it (named as --partial names them, "
        "NAME@START-STOP)")


def test_an_unwritable_out_is_named_not_the_temporary_file(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from tests.app.test_cli import RUN, _populate

    _populate(tmp_path / "captures")
    out = "/proc/x.safetensors"  # no file can be made there, even as root
    assert main(["export", RUN, "req-0", "--out", out,
                 "--db", f"chdb://{tmp_path}/captures"]) == 2
    err = capsys.readouterr().err
    assert f"--out {out}: " in err
    assert ".x.safetensors." not in err


def test_an_out_ending_in_a_slash_is_refused_not_written_as_a_file(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``--out DIR/new/`` wrote a file named ``new`` (and made its parents)."""
    from tests.app.test_cli import RUN, _populate

    _populate(tmp_path / "captures")
    out = f"{tmp_path}/new/"
    assert main(["export", RUN, "req-0", "--out", out,
                 "--db", f"chdb://{tmp_path}/captures"]) == 2
    assert f"--out {out} names a directory" in capsys.readouterr().err
    assert not (tmp_path / "new").exists()
