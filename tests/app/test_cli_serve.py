"""``dmi-sglang serve``: its checks, the run it resolves, and the server it becomes.

``os.execv`` is replaced by a recorder: what the test sees is exactly the command line and
environment the real call would hand to ``python -m sglang.launch_server``.
"""

from __future__ import annotations

import contextlib
import os
import sys
from pathlib import Path
from typing import Any

import pytest

from dmi_sglang.app import cli_serve
from dmi_sglang.app.cli import main
from dmi_sglang.domain.settings import Settings


@pytest.fixture
def model(tmp_path: Path) -> Path:
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text("{}")
    return tmp_path / "m"


@pytest.fixture
def clean_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    for key in [k for k in os.environ if k.startswith("DMX_")]:
        monkeypatch.delenv(key)
    monkeypatch.chdir(tmp_path)


def _serve(argv: list[str], *, gpu: str | None = None) -> tuple[int, list[Any]]:
    from dmi_sglang.app.cli import _parser

    execs: list[Any] = []
    args, extra = _parser().parse_known_args(["serve", *argv])
    code = cli_serve.serve(args, extra, gpu_problem=lambda: gpu,
                           execv=lambda path, argv: execs.append((path, list(argv))))
    return code, execs


def test_serve_becomes_sglangs_server_with_the_run_in_its_environment(
        model: Path, clean_env: None, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    """Every argument serve does not know goes to SGLang unchanged; the run (a generated
    id, the absolute embedded store, serve's defaults: requests that ask, every layer's
    residual at the last position) is in the environment the server inherits, and the
    printout names it and how to read it."""
    monkeypatch.setattr(os, "environ", dict(os.environ))
    code, execs = _serve(["--model-path", str(model), "--port", "30001",
                          "--attention-backend", "triton", "--api-key", "k"])
    assert code == 0
    assert execs == [(sys.executable, [sys.executable, "-m", "sglang.launch_server",
                                       "--model-path", str(model), "--port", "30001",
                                       "--attention-backend", "triton", "--api-key", "k"])]
    env = os.environ
    assert env["DMX_SGLANG_ENABLE"] == "1"
    assert env["DMX_HOOK_SELECTION"] == cli_serve.SERVE_HOOKS
    assert float(env["DMX_REQUEST_SAMPLE"]) == 0.0
    run_id = env["DMX_MODEL_ID"]
    assert run_id.startswith("m-")
    store = Settings.from_env().store()
    assert store.path == str(Path.cwd() / "dmi-captures")
    out = capsys.readouterr().out
    assert f"run {run_id} captures resid_pre:last of requests that ask" in out
    assert f"dmi-sglang ls {run_id} --db {store.url}" in out
    assert "POST /dmi/stop" in out


def test_flags_win_over_variables_which_win_over_serves_defaults(
        model: Path, clean_env: None, monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
        capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(os, "environ", dict(os.environ))
    os.environ["DMX_HOOK_SELECTION"] = "hidden-states"
    os.environ["DMX_REQUEST_SAMPLE"] = "0.25"
    _serve(["--model-path", str(model), "--run-id", "mine",
            "--db", f"chdb://{tmp_path}/elsewhere"])
    assert os.environ["DMX_HOOK_SELECTION"] == "hidden-states"
    assert float(os.environ["DMX_REQUEST_SAMPLE"]) == 0.25
    assert os.environ["DMX_MODEL_ID"] == "mine"
    assert os.environ["DMX_DB_URL"] == f"chdb://{tmp_path}/elsewhere"
    assert "0.25 of requests, and those that ask" in capsys.readouterr().out
    assert os.environ["DMX_STORE_MAX_GB"] == "0"  # no cap unless asked
    _serve(["--model-path", str(model), "--hooks", "final_ln:last", "--request-sample", "1",
            "--store-max-gb", "40"])
    assert os.environ["DMX_HOOK_SELECTION"] == "final_ln:last"
    assert float(os.environ["DMX_REQUEST_SAMPLE"]) == 1.0
    assert os.environ["DMX_STORE_MAX_GB"] == "40"


@pytest.mark.parametrize(
    ("args", "words"),
    [(["--model-path", "/nonexistent"], "--model-path /nonexistent does not exist"),
     (["--hooks", "resid_pree"], "--hooks 'resid_pree'"),
     (["--request-sample", "1.5"], "--request-sample '1.5'"),
     (["--db", "bogus://x"], "--db 'bogus://x'"),
     (["--run-id", "a/b"], "--run-id 'a/b'"),
     (["--store-max-gb", "-1"], "--store-max-gb '-1'")],
    ids=["model", "hooks", "sample", "db", "run-id", "store-max-gb"],
)
def test_serve_checks_its_arguments_before_looking_for_a_gpu(
        args: list[str], words: str, model: Path, clean_env: None,
        capsys: pytest.CaptureFixture[str]) -> None:
    base = ["--model-path", str(model)] if "--model-path" not in args else []
    with contextlib.suppress(SystemExit):
        assert main(["serve", *base, *args]) != 0
    err = capsys.readouterr().err
    assert words in err
    assert err.count("\n") == 1
    assert "GPU" not in err


def test_serve_without_a_gpu_says_so_in_one_line_and_starts_nothing(
        model: Path, clean_env: None, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(os, "environ", dict(os.environ))
    code, execs = _serve(["--model-path", str(model)], gpu="needs an NVIDIA GPU with CUDA")
    assert code == cli_serve.EXIT_NO_GPU
    assert execs == []
    assert "DMX_SGLANG_ENABLE" not in os.environ
    err = capsys.readouterr().err
    assert err == "dmi-sglang serve: needs an NVIDIA GPU with CUDA\n"


def test_the_serve_default_keeps_up_by_the_bandwidth_plan() -> None:
    """serve's default selection with every request captured, on Qwen3-0.6B at the
    stock speed measured on the H200 (21,000 tok/s, 256 + 128 token requests): no stage
    of the bandwidth plan (default rates, stored) bounds it below full speed."""
    pytest.importorskip("sglang")
    from dmi_sglang.app.composition import model_rows
    from dmi_sglang.domain.bandwidth import plan_bandwidth
    from dmi_sglang.domain.hooks import parse_selection

    hooks, shape = model_rows({
        "architectures": ["Qwen3ForCausalLM"], "hidden_size": 1024, "num_hidden_layers": 28,
        "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 128,
        "intermediate_size": 3072, "vocab_size": 151936, "torch_dtype": "bfloat16"})
    selection = parse_selection(cli_serve.SERVE_HOOKS).resolve(hooks)
    plan = plan_bandwidth(selection, shape, prompt_tokens=256, completion_tokens=128,
                          tok_s=21_000)
    assert plan.bound == 1.0, plan
    full = plan_bandwidth(parse_selection("hidden-states").resolve(hooks), shape,
                          prompt_tokens=256, completion_tokens=128, tok_s=21_000)
    assert full.bound is not None
    assert full.bound < 1.0  # the check can fail


def test_serve_refuses_a_server_that_would_not_load_the_plugin(
        model: Path, clean_env: None, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    """SGLANG_PLUGINS leaving out ``dmi``, or no ``dmi`` entry point installed: one line
    saying so, and no server (it would serve while capturing nothing)."""
    import importlib.metadata

    monkeypatch.setattr(os, "environ", dict(os.environ))
    for value in ("none", ",", "other"):
        os.environ["SGLANG_PLUGINS"] = value
        assert main(["serve", "--model-path", str(model)]) != 0
        err = capsys.readouterr().err
        assert f"SGLANG_PLUGINS={value!r} leaves out the 'dmi' plugin" in err
        assert err.count("\n") == 1
    os.environ["SGLANG_PLUGINS"] = "other, dmi"
    assert _serve(["--model-path", str(model)])[0] == 0
    del os.environ["SGLANG_PLUGINS"]
    monkeypatch.setattr(importlib.metadata, "entry_points", lambda group: [])
    assert main(["serve", "--model-path", str(model)]) != 0
    assert "entry point 'dmi' is not installed" in capsys.readouterr().err


def test_serve_never_prints_the_stores_password(
        model: Path, clean_env: None, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(os, "environ", dict(os.environ))
    code, _ = _serve(["--model-path", str(model),
                      "--db", "http://reader:s3kr1t-pw@db.example:8123/captures"])
    assert code == 0
    out = capsys.readouterr()
    assert "s3kr1t-pw" not in out.out + out.err
    assert "with the store's user and password in the URL, which are not printed" in out.out
    assert "s3kr1t-pw" in os.environ["DMX_DB_URL"] + os.environ.get("DMX_DB_PASSWORD", "")


def test_serve_names_no_credentials_for_an_embedded_store(
        model: Path, clean_env: None, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(os, "environ", dict(os.environ))
    assert _serve(["--model-path", str(model)])[0] == 0
    assert "password" not in capsys.readouterr().out


@pytest.mark.parametrize(("exported", "value"), [("DMX_NULL_MODE", "1"),
                                                  ("DMX_DB_PORT", "9000")])
def test_db_replaces_the_exported_store_variables_in_the_servers_environment_too(
        exported: str, value: str, model: Path, clean_env: None, tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """Found in review: --db wins over every store variable, and serve printed that
    store, but the variables it replaced stayed in the environment of the server it
    became, whose own reading of the settings then refused to start."""
    monkeypatch.setattr(os, "environ", dict(os.environ))
    os.environ[exported] = value
    store = f"chdb://{tmp_path}/elsewhere"
    code, execs = _serve(["--model-path", str(model), "--db", store])
    assert code == 0
    assert execs
    assert f"into {store}" in capsys.readouterr().out
    # what the server's plugin makes of the environment it inherits
    assert Settings.from_env().resolve(model_path=str(model)).store().url == store


@pytest.mark.parametrize("flag", ["--encoder-only", "--smg-grpc-mode", "--grpc-mode",
                                  "--use-ray", "--use-ray=true"])
def test_a_server_the_capture_does_not_follow_is_refused_in_one_line(
        flag: str, model: Path, clean_env: None, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    """Found in review: SGLang starts another server than its HTTP one for these, so no
    /dmi route, no stop at exit; its schedulers would capture all the same."""
    from dmi_sglang.app.cli import main

    monkeypatch.setattr(os, "environ", dict(os.environ))
    execs: list[Any] = []
    monkeypatch.setattr(os, "execv", lambda path, argv: execs.append(argv))
    assert main(["serve", "--model-path", str(model), flag]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1
    assert flag.partition("=")[0] in err
    assert execs == []
    assert "DMX_SGLANG_ENABLE" not in os.environ


@pytest.mark.sglang
@pytest.mark.parametrize("extra", [["--encoder-onl"], ["--use-ra"], ["--grpc-mod"],
                                   ["--smg-grpc"], ["--config", "CONFIG"]],
                         ids=["encoder-prefix", "ray-prefix", "grpc-prefix", "smg-prefix",
                              "config-file"])
def test_every_spelling_sglang_takes_for_another_server_is_refused(
        extra: list[str], model: Path, tmp_path: Path, clean_env: None,
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """SGLang's parser takes any unambiguous prefix of a flag, and ``--config`` expands a
    YAML file into flags: the refusal above matched whole flags only."""
    from dmi_sglang.app.cli import main

    config = tmp_path / "sglang.yaml"
    config.write_text("encoder-only: true\n")
    extra = [str(config) if a == "CONFIG" else a for a in extra]
    monkeypatch.setattr(os, "environ", dict(os.environ))
    execs: list[Any] = []
    monkeypatch.setattr(os, "execv", lambda path, argv: execs.append(argv))
    assert main(["serve", "--model-path", str(model), *extra]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1
    assert "starts another server" in err
    assert execs == []


def test_serve_refuses_an_exported_sglang_enable_0(
        model: Path, clean_env: None, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    from dmi_sglang.app.cli import main

    monkeypatch.setattr(os, "environ", dict(os.environ))
    os.environ["DMX_SGLANG_ENABLE"] = "0"
    execs: list[Any] = []
    monkeypatch.setattr(os, "execv", lambda path, argv: execs.append(argv))
    assert main(["serve", "--model-path", str(model)]) == 2
    assert "DMX_SGLANG_ENABLE=0" in capsys.readouterr().err
    assert execs == []
