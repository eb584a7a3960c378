"""Replay a newcomer's first hour on a CPU machine: every item, not only the first failure.

    .venv/bin/python scripts/newcomer_check.py          # exit 0 when every item passes

Each item of issue #18 that can be tried without a GPU runs as a user would try it: the
installed ``dmi-sglang`` command or ``python -c``, in a fresh scratch directory, with a
clean ``DMX_*`` environment, with the development environment's install (``.venv``) except
where an item is about installing: item 2 also makes a fresh virtual environment and runs
``pip install .`` there (core dependencies only, from the package index or pip's cache).
The table names each item and what went wrong. CI runs it after the test suite.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
Check = Callable[[Path], str | None]
"""A check gets a scratch directory and answers None (passed) or what went wrong."""


def run(args: list[str], cwd: Path, env: dict[str, str] | None = None,
        stdin: str = "") -> subprocess.CompletedProcess[str]:
    """``args`` with this interpreter's scripts first on PATH and no inherited ``DMX_*``."""
    base = {k: v for k, v in os.environ.items() if not k.startswith(("DMX_", "DMI_V0519_"))}
    base["PATH"] = f"{BIN}{os.pathsep}{base.get('PATH', '')}"
    return subprocess.run(args, cwd=cwd, env=base | (env or {}), input=stdin, text=True,
                          capture_output=True, timeout=600, check=False)


def expect(proc: subprocess.CompletedProcess[str], code: int, *texts: str) -> str | None:
    """None when ``proc`` exited with ``code`` and printed every text (stdout or stderr)."""
    out = proc.stdout + proc.stderr
    if proc.returncode != code:
        return f"exit {proc.returncode}, expected {code}: {out.strip()[-300:]}"
    missing = [t for t in texts if t not in out]
    return f"missing {missing!r} in: {out.strip()[-300:]}" if missing else None


def _without(problem: str | None, text: str,
             proc: subprocess.CompletedProcess[str]) -> str | None:
    """``problem``, else a problem when ``proc`` printed ``text``."""
    if problem is None and text in proc.stdout + proc.stderr:
        return f"{text!r} was printed"
    return problem


def py(code: str) -> list[str]:
    """``python -c code`` with this interpreter."""
    return [sys.executable, "-c", code]


def one_line_error(proc: subprocess.CompletedProcess[str], code: int, *texts: str) -> str | None:
    """Like :func:`expect`, and the error is one line, no traceback."""
    problem = expect(proc, code, *texts)
    if problem is None and "Traceback" in proc.stderr:
        return "a traceback instead of one line"
    return problem


def _read_side(d: Path) -> str | None:
    made = run(["dmi-sglang", "reference-capture", "--max-new-tokens", "4"], d)
    if problem := expect(made, 0, "cpu-reference"):
        return f"reference-capture: {problem}"
    listed = run(["dmi-sglang", "ls"], d)
    if problem := expect(listed, 0, "committed", "cpu-reference"):
        return f"ls: {problem}"
    run_id = next(line.split()[0] for line in listed.stdout.splitlines()
                  if "cpu-reference" in line)
    if problem := expect(run(["dmi-sglang", "show", run_id, "req-0"], d), 0, "token_ids"):
        return f"show: {problem}"
    exported = run(["dmi-sglang", "export", run_id, "req-0", "--out", "x.safetensors"], d)
    if problem := expect(exported, 0, "wrote"):
        return f"export: {problem}"
    handle = run(py(
        "from dmi_sglang import open_store; "
        f"h = open_store().handle({run_id!r}, 'req-0'); "
        "print('complete' if not h.missing else h.missing, len(h.hidden_states))"), d)
    if problem := expect(handle, 0, "complete"):
        return f"the handle: {problem}"
    dmi_names = run(py(  # issue item 9: the original readback's field names
        "from dmi_sglang import open_store; "
        f"h = open_store().handle({run_id!r}, 'req-0'); "
        f"per_layer = {_DMI_PER_LAYER!r}; whole = {_DMI_WHOLE!r}; "
        "assert all(isinstance(getattr(h, n), tuple) and getattr(h, n) for n in per_layer); "
        "assert all(getattr(h, n).dim() == 2 for n in whole); print('dmi names ok')"), d)
    return expect(dmi_names, 0, "dmi names ok")


_DMI_PER_LAYER = ("attention_output", "attention_values", "middle_residual", "mlp_input",
                  "mlp_output", "mlp_activation", "q", "k", "v", "ln1", "ln2")
_DMI_WHOLE = ("embeddings", "final_hidden", "final_residual")


def _model_dir(d: Path) -> str:
    (d / "m").mkdir(exist_ok=True)
    (d / "m" / "config.json").write_text("{}")
    return str(d / "m")


def _capture_checks_before_the_gpu(d: Path) -> str | None:
    """Flags and the environment's settings are refused before the GPU is looked for."""
    cases = [([], {"DMX_DB_URL": "bogus://x"}, "DMX_DB_URL='bogus://x'"),
             ([], {"DMX_FOO": "1"}, "unknown setting DMX_FOO"),
             (["--prompts", "missing.txt"], {}, "--prompts missing.txt"),
             (["--db", "bogus://x"], {}, "--db 'bogus://x' is not a store URL")]
    for flags, env, words in cases:
        proc = run(["dmi-sglang", "capture", "--model", _model_dir(d), *flags], d, env)
        if problem := one_line_error(proc, 2, words):
            return f"{flags or env}: {problem}"
        if "needs an NVIDIA GPU" in proc.stderr:
            return f"{flags or env}: looked for the GPU first"
    return None


def _engine_without_cuda(d: Path) -> str | None:
    code = ("import torch; torch.cuda.is_available = lambda: False\n"
            "from dmi_sglang import DMIEngine\n"
            "DMIEngine(model_path='m')\n")
    proc = run(py(code), d)
    problem = expect(proc, 1, "DMIEngine needs an NVIDIA GPU with CUDA")
    if problem is None and "dmi_stop_monitoring" in proc.stderr:
        return "the misleading shutdown warning was printed"
    return problem


def _stands_alone(_scratch: Path) -> str | None:
    tracked = subprocess.run(["git", "-C", str(REPO), "ls-files"], capture_output=True,
                             text=True, check=False).stdout.split()
    hits = [p for p in tracked if p != "scripts/newcomer_check.py" and (REPO / p).is_file()
            and "../shared" in (REPO / p).read_text(errors="replace")]
    return f"../shared is named in {hits}" if hits else None


def _plain_install(d: Path) -> str | None:
    """Item 2: ``pip install .`` into a fresh virtual environment (core dependencies only,
    no torch): ``ls`` reads a store, and ``show`` and ``demo-model`` say in one line which
    extra they need."""
    made = run(["dmi-sglang", "reference-capture", "--max-new-tokens", "2"], d)
    if problem := expect(made, 0, "cpu-reference"):
        return f"reference-capture: {problem}"
    venv = d / "venv"
    if problem := expect(run([sys.executable, "-m", "venv", str(venv)], d), 0):
        return f"venv: {problem}"
    plain = venv / "bin"
    installed = run([str(plain / "python"), "-m", "pip", "install", "--quiet",
                     "--disable-pip-version-check", str(REPO)], d)
    if problem := expect(installed, 0):
        return f"pip install .: {problem}"
    if run([str(plain / "python"), "-c", "import torch"], d).returncode == 0:
        return "pip install . brought torch (a core dependency should not)"
    listed = run([str(plain / "dmi-sglang"), "ls"], d)
    if problem := expect(listed, 0, "cpu-reference"):
        return f"ls without torch: {problem}"
    run_id = next(line.split()[0] for line in listed.stdout.splitlines()
                  if "cpu-reference" in line)
    for args, extra in (([str(plain / "dmi-sglang"), "show", run_id, "req-0"], "read"),
                        ([str(plain / "dmi-sglang"), "demo-model", "m"], "demo")):
        if problem := one_line_error(run(args, d), 2, f"pip install 'dmi-sglang[{extra}]'"):
            return f"{args[1]} without torch: {problem}"
    return None


_LEGACY_SMOKE = {"DMI_V0519_PYTHON": sys.executable, "DMI_V0519_MODEL": "/models/m",
                 "DMI_V0519_MEM_FRACTION": "0.3", "DMI_V0519_CELLS": "graph"}


def _legacy_smoke_refused(_scratch: Path) -> str | None:
    """The harness, the GPU tests and scripts/gpu-run.sh each refuse the four variables,
    naming each one's replacement."""
    names = [f"{k}: " for k in _LEGACY_SMOKE]
    for args, code in (([sys.executable, "-m", "harness", "qualify", "--list"], 2),
                       ([sys.executable, "-m", "pytest", "tests/gpu", "-m", "gpu",
                         "--collect-only", "-q", "-p", "no:cacheprovider"], 4),
                       (["bash", "scripts/gpu-run.sh", "true"], 2)):
        problem = expect(run(args, REPO, _LEGACY_SMOKE), code, *names)
        if problem is not None:
            return f"{' '.join(args[-3:])}: {problem}"
    return None


CHECKS: dict[str, Check] = {
    "1 the plugin imports no Engine; the design card's import works": lambda d: expect(run(py(
        "import sys; import dmi_sglang.app, dmi_sglang.app.plugin; "
        "print('eager' if 'sglang.srt.entrypoints.engine' in sys.modules else 'lazy'); "
        "from dmi_sglang.app import DMIEngine; print(DMIEngine.__name__)"), d),
        0, "lazy", "DMIEngine"),
    "4 the CLI follows DMX_DB_URL": lambda d: expect(run(
        ["dmi-sglang", "ls"], d, {"DMX_DB_URL": f"chdb://{d}/elsewhere"}), 2,
        f"{d}/elsewhere"),
    "4 an unknown DMX_ variable is refused": lambda d: one_line_error(run(
        ["dmi-sglang", "ls"], d, {"DMX_HOOKS": "x"}), 2, "unknown setting DMX_HOOKS"),
    "4 DMI's DMX_CH_PARALLELISM is ignored with one line": lambda d: expect(run(
        ["dmi-sglang", "ls"], d, {"DMX_CH_PARALLELISM": "10"}), 2,
        "setting ignored", "DMX_CH_PARALLELISM"),
    "4 DMX_NULL_MODE beside a store is refused": lambda d: one_line_error(run(
        ["dmi-sglang", "ls"], d, {"DMX_NULL_MODE": "1", "DMX_DB_URL": f"chdb://{d}/s"}), 2,
        "DMX_NULL_MODE=1", "contradicts"),
    "4 DMX_DB_PORT=9000 gets the HTTP-port hint": lambda d: one_line_error(run(
        ["dmi-sglang", "ls"], d, {"DMX_DB_PORT": "9000"}), 2, "8123"),
    "5 reference-capture, then ls, show, export and the handle": _read_side,
    "7 --version and python -m dmi_sglang": lambda d: expect(run(
        [sys.executable, "-m", "dmi_sglang", "--version"], d), 0, "dmi-sglang "),
    "7 capture checks its arguments before looking for a GPU": lambda d: one_line_error(run(
        ["dmi-sglang", "capture", "--model", str(d / "nope"), "--prompt", "w1"], d), 2,
        "nope"),
    "7 demo-model --layers 0 is refused": lambda d: one_line_error(run(
        ["dmi-sglang", "demo-model", str(d / "m"), "--layers", "0"], d), 2,
        "not a positive integer"),
    "7 rm asks, or needs --yes": lambda d: one_line_error(run(
        ["dmi-sglang", "rm", "some-run"], d), 2, "--yes"),
    "7 ls without a store says how to make one": lambda d: expect(run(
        ["dmi-sglang", "ls"], d), 2, "no capture store", "reference-capture"),
    "7 DMIEngine without CUDA is one clear error": _engine_without_cuda,
    "7 capture checks flags and DMX_* settings before looking for a GPU":
        _capture_checks_before_the_gpu,
    "7 a bad --db is named as --db": lambda d: _without(one_line_error(run(
        ["dmi-sglang", "ls", "--db", "bogus://x"], d), 2, "--db 'bogus://x'"),
        "DMX_DB_URL", run(["dmi-sglang", "ls", "--db", "bogus://x"], d)),
    "7 capture --help shows real defaults": lambda d: _without(expect(run(
        ["dmi-sglang", "capture", "--help"], d), 0, "'The capital of France is'",
        "Every other --option is passed to SGLang"), "(default: None)",
        run(["dmi-sglang", "capture", "--help"], d)),
    "7 demo-model --layers -1 is refused": lambda d: expect(run(
        ["dmi-sglang", "demo-model", "m", "--layers", "-1"], d), 2,
        "'-1' is not a positive integer"),
    "2 pip install . into a fresh venv: ls works, show and demo-model name their extra":
        _plain_install,
    "2 a missing optional package is one line naming the extra": lambda d: one_line_error(
        run(py("import sys; sys.modules['transformers'] = None\n"
               "from dmi_sglang.app.cli import main; sys.exit(main(['demo-model', 'm']))"),
            d), 2, "pip install 'dmi-sglang[demo]'"),
    "8 nothing in the repository reads ../shared": _stands_alone,
    "8 the original DMI_V0519_* smoke variables are refused": _legacy_smoke_refused,
}


def main() -> int:
    """Run every check; a table; exit 1 when any failed."""
    failed = 0
    for name, check in CHECKS.items():
        with tempfile.TemporaryDirectory(prefix="dmi-newcomer-") as scratch:
            try:
                problem = check(Path(scratch))
            except Exception as exc:  # a check that crashes is a failed item, reported
                problem = f"the check crashed: {exc!r}"
        failed += problem is not None
        print(f"{'ok  ' if problem is None else 'FAIL'}  {name}"
              + ("" if problem is None else f"\n      {problem}"), flush=True)
    print(f"{len(CHECKS) - failed} of {len(CHECKS)} newcomer items pass")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
