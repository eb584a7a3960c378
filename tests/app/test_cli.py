"""The dmi-sglang command: parsing, read-only commands on a real embedded store."""

from __future__ import annotations

import contextlib
import shlex
from pathlib import Path

import pytest

from dmi_sglang.app.cli import main
from dmi_sglang.columns import RecordBatch
from dmi_sglang.domain.hooks import hook_by_name
from dmi_sglang.domain.records import CaptureRecord, RequestManifest, RunInfo, RunStatus
from dmi_sglang.domain.store_config import StoreConfig, StoreKind

torch = pytest.importorskip("torch")

RUN = "demo-20261129T000000-abcdef"
HIDDEN = 8


def _populate(path: Path) -> dict[str, torch.Tensor]:
    from dmi_sglang.app.composition import open_sink

    store = StoreConfig(kind=StoreKind.EMBEDDED, path=str(path))
    captures = (("blocks.hook_resid_pre", 0), ("blocks.hook_resid_pre", 1),
                ("token_ids", -1), ("final_logits", -1))
    run = RunInfo(RUN, "/m/demo", (("DMX_HOOK_SELECTION", "resid_pre,token_ids"),),
                  captures, "2026-11-29T00:00:00+00:00")
    gen = torch.Generator().manual_seed(0)
    truth = {
        "blocks.hook_resid_pre.0": torch.randn(6, HIDDEN, generator=gen).bfloat16(),
        "blocks.hook_resid_pre.1": torch.randn(6, HIDDEN, generator=gen).bfloat16(),
        "token_ids": torch.arange(6, dtype=torch.int64),
        "final_logits": torch.randn(3, 5, generator=gen),
    }
    records = []
    for act, layer in captures:
        key = act if layer < 0 else f"{act}.{layer}"
        t = truth[key]
        start = 3 if act == "final_logits" else 0
        records.append(CaptureRecord(RUN, "req-0", act, layer, 0, start, start + t.shape[0],
                                     str(t.dtype), tuple(t.shape),
                                     t.contiguous().view(torch.uint8).numpy().tobytes(), 1))
    sink = open_sink(store)
    try:
        sink.start_run(run)
        sink.put(RecordBatch.from_records(records))
        manifest = RequestManifest(RUN, "req-0", prompt_tokens=4, completion_tokens=3,
                                   committed=True)
        done = RunInfo(RUN, run.model_path, run.settings, captures, run.started_at,
                       "2026-11-29T00:01:00+00:00", RunStatus.COMMITTED)
        sink.finish_run(done, [manifest])
    finally:
        sink.close()
    assert hook_by_name("final_logits").act_name == "final_logits"
    return truth


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, dict[str, torch.Tensor]]:
    path = tmp_path_factory.mktemp("cli") / "captures"
    return f"chdb://{path}", _populate(path)


def test_ls_lists_runs_and_requests(store: tuple[str, dict[str, torch.Tensor]],
                                    capsys: pytest.CaptureFixture[str]) -> None:
    url, _ = store
    assert main(["ls", "--db", url]) == 0
    out = capsys.readouterr().out
    assert RUN in out
    assert "committed" in out
    assert main(["ls", RUN, "--db", url]) == 0
    assert "req-0" in capsys.readouterr().out


def test_show_prints_shapes_and_norms(store: tuple[str, dict[str, torch.Tensor]],
                                      capsys: pytest.CaptureFixture[str]) -> None:
    url, truth = store
    assert main(["show", RUN, "req-0", "--db", url]) == 0
    out = capsys.readouterr().out
    assert "blocks.hook_resid_pre.1" in out
    assert "6x8" in out
    norm = float(truth["blocks.hook_resid_pre.0"].float().norm())
    assert f"{norm:.4f}" in out


def test_export_writes_safetensors(store: tuple[str, dict[str, torch.Tensor]],
                                   tmp_path: Path) -> None:
    from safetensors.torch import load_file

    url, truth = store
    out = tmp_path / "x.safetensors"
    assert main(["export", RUN, "req-0", "--out", str(out), "--db", url]) == 0
    loaded = load_file(str(out))
    assert set(loaded) == set(truth)
    for name, tensor in truth.items():
        assert torch.equal(loaded[name], tensor), name


def test_errors_are_one_line_and_non_zero(store: tuple[str, dict[str, torch.Tensor]],
                                          tmp_path: Path,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    url, _ = store
    assert main(["show", "no-such-run", "req-0", "--db", url]) != 0
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0
    assert "no run 'no-such-run'" in err
    assert main(["show", RUN, "req-none", "--db", url]) != 0
    err = capsys.readouterr().err.strip()
    assert f"run {RUN!r} holds nothing of a request 'req-none'" in err
    assert f"`dmi-sglang ls {RUN} --db {url}`" in err
    assert "not complete" not in err
    assert main(["ls", "--db", "chdb://relative"]) != 0
    assert "absolute path" in capsys.readouterr().err
    assert main(["ls", "--db", f"chdb://{tmp_path}/missing"]) != 0
    assert capsys.readouterr().err.strip()


def test_rm_deletes_a_run(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "captures"
    _populate(path)
    url = f"chdb://{path}"
    assert main(["rm", RUN, "--db", url]) != 0  # no terminal to ask on: --yes needed
    assert "pass --yes" in capsys.readouterr().err
    assert main(["rm", RUN, "--db", url, "--yes"]) == 0
    capsys.readouterr()
    assert main(["ls", "--db", url]) == 0
    assert RUN not in capsys.readouterr().out


def test_capture_without_gpu_says_so_in_one_line(tmp_path: Path,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    code = main(["capture", "--model", str(_model_dir(tmp_path)), "--prompt", "hi"])
    assert code != 0
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0
    assert "GPU" in err


def test_demo_model_writes_a_checkpoint(tmp_path: Path,
                                        capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["demo-model", str(tmp_path / "m"), "--layers", "2"]) == 0
    assert (tmp_path / "m" / "config.json").exists()
    assert "dmi-sglang capture --model" in capsys.readouterr().out
    spaced = tmp_path / "my models" / "m"  # the hint runs as printed, spaces and all
    assert main(["demo-model", str(spaced), "--layers", "1"]) == 0
    hint = capsys.readouterr().out.splitlines()[-1].removeprefix("try: ")
    assert shlex.split(hint)[:4] == ["dmi-sglang", "capture", "--model", str(spaced)]


def test_unknown_options_only_for_capture(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["ls", "--bogus"]) != 0
    assert "unknown arguments --bogus" in capsys.readouterr().err


def test_hook_totals(store: tuple[str, dict[str, torch.Tensor]]) -> None:
    from dmi_sglang import open_store

    url, truth = store
    totals = {t.act_name: (t.layers, t.records, t.rows, t.bytes)
              for t in open_store(url).hook_totals(RUN)}
    assert totals["blocks.hook_resid_pre"] == (2, 2, 12, 2 * 6 * HIDDEN * 2)
    assert totals["final_logits"] == (1, 1, 3, truth["final_logits"].numel() * 4)


def _model_dir(base: Path) -> Path:
    where = base / "model"
    where.mkdir(exist_ok=True)
    (where / "config.json").write_text("{}")
    return where


@pytest.fixture
def no_gpu_lookup(monkeypatch: pytest.MonkeyPatch) -> None:
    """Fails a test that reaches the GPU check (arguments must be refused before it)."""
    from dmi_sglang.app import cli_commands

    def looked() -> str:
        raise AssertionError("the GPU was looked for before the arguments were checked")

    monkeypatch.setattr(cli_commands, "gpu_problem", looked)


@pytest.mark.parametrize(
    ("args", "words"),
    [(["--model", "/nonexistent", "--prompt", "x"], "--model /nonexistent does not exist"),
     (["--prompts", "/nonexistent/prompts.txt"],
     "--prompts /nonexistent/prompts.txt: No such file"),
     (["--prompt", " "], "--prompt ' ' is empty"),
     (["--hooks", "resid_pree"], "--hooks 'resid_pree' is invalid; accepted: hook names"),
     (["--run-id", "a/b"], "--run-id 'a/b' is invalid; accepted: 1-200 letters"),
     (["--db", "bogus://x"], "--db 'bogus://x' is not a store URL; accepted: chdb:///"),
     (["--db", "http://h/bad-db"], "bad database name 'bad-db'"),
     (["--db", "http://u:s3cret@h:99999/x"], "--db 'http://u:***@h:99999/x'"),
     (["--max-new-tokens", "0"], "is not a positive integer")],
    ids=["model", "prompts", "empty-prompt", "hooks", "run-id", "db", "db-name",
         "db-password", "max-new-tokens"],
)
def test_capture_checks_its_arguments_before_looking_for_a_gpu(
        args: list[str], words: str, tmp_path: Path, no_gpu_lookup: None,
        capsys: pytest.CaptureFixture[str]) -> None:
    base = ["--model", str(_model_dir(tmp_path))] if "--model" not in args else []
    with contextlib.suppress(SystemExit):  # argparse's own refusals exit 2
        assert main(["capture", *base, *args]) != 0
    err = capsys.readouterr().err
    assert words in err
    assert "s3cret" not in err
    assert "DMX_" not in err  # the flag was wrong: the flag is named


@pytest.mark.parametrize(
    ("variable", "value", "words"),
    [("DMX_DB_URL", "bogus://x", "DMX_DB_URL='bogus://x'"),
     ("DMX_FOO", "1", "unknown setting DMX_FOO"),
     ("DMX_DB_PORT", "9000", "speaks ClickHouse's HTTP protocol, by default on 8123")],
    ids=["db-url", "unknown", "native-port"],
)
def test_capture_checks_the_environment_before_looking_for_a_gpu(
        variable: str, value: str, words: str, monkeypatch: pytest.MonkeyPatch,
        tmp_path: Path, no_gpu_lookup: None, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv(variable, value)
    assert main(["capture", "--model", str(_model_dir(tmp_path))]) != 0
    err = capsys.readouterr().err
    assert words in err


def test_capture_help_shows_real_defaults(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["capture", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "(default: None)" not in out
    assert "(default: 'The capital of France is')" in out
    assert "Every other --option is passed to SGLang" in out


def test_version_module_entry_and_polish(tmp_path: Path,
                                         capsys: pytest.CaptureFixture[str]) -> None:
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-m", "dmi_sglang", "--version"], check=True,
                         capture_output=True, text=True, timeout=60).stdout
    assert out.startswith("dmi-sglang ")
    with pytest.raises(SystemExit):
        main(["demo-model", str(tmp_path / "m"), "--layers", "0"])
    assert "is not a positive integer" in capsys.readouterr().err
    assert main(["ls", "--db", f"chdb://{tmp_path / 'none-yet'}"]) != 0
    err = capsys.readouterr().err
    assert "capture into it with `dmi-sglang capture" in err
    assert f"`dmi-sglang reference-capture --db chdb://{tmp_path / 'none-yet'}`" in err
    assert not (tmp_path / "none-yet").exists()
    assert main(["ls", "--db", "bogus://x"]) != 0
    err = capsys.readouterr().err
    assert "--db 'bogus://x' is not a store URL" in err
    assert "DMX_DB_URL" not in err  # the flag was wrong, not the variable


def test_read_back_hints_never_print_the_stores_password() -> None:
    from dmi_sglang.app.cli_commands import read_back_hints
    from dmi_sglang.domain.settings import Settings

    settings = Settings.from_kwargs(
        {"dmx_db_url": "http://reader:s3kr1t-pw@db.example:8123/captures"}, env={})
    store = settings.resolve(model_path="/m/demo").store()
    hints = read_back_hints(store, RUN, "req-0")
    assert store.password == "s3kr1t-pw"  # the store keeps it; the hints must not show it
    assert not any("s3kr1t-pw" in hint for hint in hints)
    assert hints[1] == f"dmi-sglang show {RUN} req-0 --db http://db.example:8123/captures"


def test_read_back_hints_of_the_default_store_name_no_db(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from dmi_sglang.app.cli_commands import read_back_hints
    from dmi_sglang.domain.settings import Settings

    monkeypatch.chdir(tmp_path)
    store = Settings.from_kwargs({}, env={}).resolve(model_path="/m/demo").store()
    assert read_back_hints(store, RUN, "req-0")[0] == "dmi-sglang ls"


@pytest.mark.parametrize("name", ["o'brien \"runs\" $HOME", "plain", "runs-\U0001f600",
                                  "bad-\udcff-bytes", 'only "double"'])
def test_the_read_back_hints_survive_any_store_path_and_ids(tmp_path: Path, name: str) -> None:
    """Each hint runs as printed: split as a shell splits it, the command gets the ids
    as they are, and the program's literals are the store URL and the ids."""
    import ast
    import shlex

    from dmi_sglang.app.cli_commands import read_back_hints

    store = StoreConfig(kind=StoreKind.EMBEDDED, path=str(tmp_path / name))
    run, request = f"run {name}", "req-'0'"
    ls, show, export, program = (shlex.split(h) for h in read_back_hints(store, run, request))
    assert ls[:2] == ["dmi-sglang", "ls"]
    assert show[:4] == ["dmi-sglang", "show", run, request]
    assert export[:4] == ["dmi-sglang", "export", run, request]
    assert program[:2] == ["python", "-c"]
    calls = {node.func.attr: [ast.literal_eval(a) for a in node.args]
             for node in ast.walk(ast.parse(program[2]))
             if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
             and node.func.attr in ("open_store", "handle")}
    assert calls == {"open_store": [store.url], "handle": [run, request]}
