"""The dmi-sglang command with hostile or careless arguments: one-line errors, nothing
replaced that should not be, no tracebacks.

Each test's docstring is one row of docs/reliability.md.
"""

from __future__ import annotations

import io
import os
import stat
from pathlib import Path

import pytest
from safetensors.torch import load

from dmi_sglang.adapters.clickhouse import ClickHouseSink
from dmi_sglang.app import cli

from ._faults import embedded, run_info, store_with_run


@pytest.fixture
def db(tmp_path: Path) -> list[str]:
    """A store holding one complete request ``r`` of run ``run``; the --db arguments."""
    config = store_with_run(tmp_path / "store")
    return ["--db", f"chdb://{config.path}"]


def _export(db: list[str], out: str, *extra: str) -> int:
    return cli.main(["export", "run", "r", "--out", out, *extra, *db])


def _one_line_error(capsys: pytest.CaptureFixture[str], words: str) -> None:
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    assert words in err, err
    assert "Traceback" not in err


def test_bad_input_export_onto_a_symlink(db: list[str], tmp_path: Path,
                                         capsys: pytest.CaptureFixture[str]) -> None:
    """export --out naming a symlink -> refused in one line; the link and its target are
    untouched."""
    target = tmp_path / "precious"
    target.write_text("keep me")
    link = tmp_path / "link.safetensors"
    link.symlink_to(target)
    assert _export(db, str(link), "--force") != 0
    _one_line_error(capsys, "is a symlink")
    assert link.is_symlink()
    assert target.read_text() == "keep me"


def test_bad_input_export_onto_a_fifo_or_a_device(db: list[str], tmp_path: Path,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    """export --out naming a FIFO or /dev/null -> refused in one line, without blocking;
    the device node stays a device."""
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    assert _export(db, str(fifo), "--force") != 0
    _one_line_error(capsys, "not a regular file")
    assert _export(db, "/dev/null", "--force") != 0
    _one_line_error(capsys, "not a regular file")
    assert stat.S_ISCHR(os.stat("/dev/null").st_mode)


def test_bad_input_export_onto_an_existing_file(db: list[str], tmp_path: Path,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    """export --out naming an existing file -> refused unless --force; with --force it is
    replaced atomically (no temporary file left)."""
    out = tmp_path / "x.safetensors"
    out.write_bytes(b"old")
    assert _export(db, str(out)) != 0
    _one_line_error(capsys, "pass --force to replace it")
    assert out.read_bytes() == b"old"
    assert _export(db, str(out), "--force") == 0
    assert load(out.read_bytes())["blocks.hook_resid_pre.0"].shape == (2, 2)
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".x.")] == []


@pytest.mark.parametrize("where", ["directory", "empty", "read-only"])
def test_bad_input_export_onto_unusable_targets(db: list[str], tmp_path: Path, where: str,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    """export --out naming a directory, an empty path, or a path in a read-only
    directory -> one line saying why, no traceback."""
    if where == "directory":
        out, words = str(tmp_path), "is a directory"
    elif where == "empty":
        out, words = "", "--out is empty"
    else:
        locked = tmp_path / "locked"
        locked.mkdir()
        locked.chmod(0o500)
        out, words = str(locked / "x.safetensors"), "dmi-sglang export"
        if os.geteuid() == 0:  # root writes anywhere: make the parent a file instead
            locked.chmod(0o700)
            (locked / "file").write_text("")
            out, words = str(locked / "file" / "x.safetensors"), "Not a directory"
    assert _export(db, out) != 0
    _one_line_error(capsys, words)


def test_bad_input_export_to_standard_output(db: list[str],
                                             capsysbinary: pytest.CaptureFixture[bytes]
                                             ) -> None:
    """export --out - -> the safetensors bytes go to standard output."""
    assert _export(db, "-") == 0
    data = capsysbinary.readouterr().out
    assert load(data)["blocks.hook_resid_pre.0"].shape == (2, 2)


def test_bad_input_control_characters_in_ids(tmp_path: Path,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    """Run and request ids holding terminal control characters -> ls prints them escaped,
    never raw."""
    run_id = "evil\x1b[2Jrun"
    config = store_with_run(tmp_path / "s", run_id, "req\x07")
    db = ["--db", f"chdb://{config.path}"]
    capsys.readouterr()  # the setup's own log lines
    assert cli.main(["ls", *db]) == 0
    assert cli.main(["ls", run_id, *db]) == 0
    out = capsys.readouterr().out
    assert "\x1b" not in out
    assert "\x07" not in out
    assert "evil\\x1b[2Jrun" in out
    assert "req\\x07" in out


def test_fault_the_reader_of_ls_goes_away(db: list[str], monkeypatch: pytest.MonkeyPatch,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    """`dmi-sglang ls | head -1`: the pipe closes under the command -> it exits 0 without a
    broken-pipe message."""

    class ClosedPipe(io.StringIO):
        def write(self, text: str) -> int:
            raise BrokenPipeError(32, "Broken pipe")

        def fileno(self) -> int:
            return self._fd

    pipe = ClosedPipe()
    read_end, write_end = os.pipe()
    pipe._fd = os.dup(write_end)  # type: ignore[attr-defined]
    monkeypatch.setattr("sys.stdout", pipe)
    try:
        assert cli.main(["ls", *db]) == 0
    finally:
        for fd in (read_end, write_end):
            os.close(fd)
    assert capsys.readouterr().err == ""


@pytest.mark.parametrize("content", ["files", "empty"])
def test_bad_input_db_on_a_directory_that_is_not_a_store(tmp_path: Path, content: str,
                                                         capsys: pytest.CaptureFixture[str]
                                                         ) -> None:
    """--db chdb:///some/dir that holds no store (other files, or nothing) -> refused in
    one line; the directory is left exactly as it was (no tmp/ or store files)."""
    target = tmp_path / "home"
    target.mkdir()
    if content == "files":
        (target / "notes.txt").write_text("mine")
    before = sorted(os.listdir(target))
    assert cli.main(["ls", "--db", f"chdb://{target}"]) != 0
    _one_line_error(capsys, "is not a capture store")
    assert sorted(os.listdir(target)) == before


def test_bad_input_rm_of_a_run_that_is_still_running(tmp_path: Path,
                                                     capsys: pytest.CaptureFixture[str]
                                                     ) -> None:
    """`dmi-sglang rm RUN` while the run is being captured -> refused in one line naming
    its owner, unless --force."""
    config = embedded(tmp_path / "s")
    sink = ClickHouseSink(config)
    sink.start_run(run_info("live"))
    try:
        db = ["--db", f"chdb://{config.path}"]
        capsys.readouterr()
        assert cli.main(["rm", "live", "--yes", *db]) != 0
        _one_line_error(capsys, "is running (owner ")
        assert cli.main(["rm", "live", "--force", "--yes", *db]) == 0
    finally:
        sink.close()


@pytest.fixture
def qwen3(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A Qwen3-0.6B model directory (its config.json alone), no DMX_* in the environment."""
    import json

    from tests.app.test_cli_plan import QWEN3_06B

    for key in [k for k in os.environ if k.startswith("DMX_")]:
        monkeypatch.delenv(key)
    monkeypatch.chdir(tmp_path)
    model = tmp_path / "m"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(QWEN3_06B))
    return model


@pytest.mark.parametrize("url", ["http://alice:s3cret-pw@db.example:8123/bad-name",
                                 "http://alice:s3cret-pw@db.example:8123/db?x=1",
                                 "alice:s3cret-pw@db.example:8123"])
def test_bad_input_serve_with_a_bad_db_url_holding_a_password(
        qwen3: Path, url: str, capsys: pytest.CaptureFixture[str]) -> None:
    """serve --db with a bad URL that holds a password -> refused in one line that never
    shows the password (found in review: serve echoed the raw flag)."""
    assert cli.main(["serve", "--model-path", str(qwen3), "--db", url]) == 2
    err = capsys.readouterr().err
    assert "s3cret-pw" not in err, err
    assert "alice:***@" in err, err


@pytest.mark.parametrize(("command", "hooks", "words"), [
    ("capture", "resid_pre@40", "outside the model's layers 0-27"),
    ("capture", "final_logits:topk(200000)", "topk(200000) needs 1 <= K"),
    ("serve", "resid_pre@40", "outside the model's layers 0-27"),
    ("plan", "", "empty hook selection"),
])
def test_bad_input_a_selection_the_model_cannot_have(
        qwen3: Path, command: str, hooks: str, words: str,
        capsys: pytest.CaptureFixture[str]) -> None:
    """capture / serve / plan --hooks that the model's config.json rules out (a layer it
    lacks, topk beyond its vocabulary) or an empty --hooks -> refused in one line before
    a GPU is looked for (found in review: capture and serve checked the syntax only, and
    plan took an empty --hooks for the default)."""
    flag = "--model-path" if command == "serve" else "--model"
    assert cli.main([command, flag, str(qwen3), "--hooks", hooks]) == 2
    _one_line_error(capsys, words)

