"""What pyproject.toml declares: extras that never move SGLang 0.5.19's pins, and one line
when a command's optional dependency is missing."""

from __future__ import annotations

import builtins
import configparser
import re
import shlex
import tomllib
from pathlib import Path
from typing import Any

import pytest
from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parents[2]
SGLANG_0519_PINS = {"torch": "2.13.0", "transformers": "5.12.1"}
"""Releases the SGLang 0.5.19 GPU environment holds (see the GPU kit)."""


def _extras() -> dict[str, list[str]]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    extras: dict[str, list[str]] = project["optional-dependencies"]
    return extras


def test_no_extra_moves_what_sglang_0519_pins() -> None:
    checked = 0
    for name, requirements in _extras().items():
        for text in requirements:
            req = Requirement(text)
            pinned = SGLANG_0519_PINS.get(req.name)
            if pinned is not None:
                assert req.specifier.contains(pinned), f"[{name}] {text} excludes {pinned}"
                checked += 1
    assert checked >= 3  # read's and demo's torch, demo's transformers


def _lock_pins() -> dict[str, str]:
    """``scripts/gpu-wheels.txt``: the releases of the GPU install known to work."""
    pins = {}
    for raw in (ROOT / "scripts" / "gpu-wheels.txt").read_text().splitlines():
        line = raw.split("#", 1)[0].strip()
        if line:
            req = Requirement(line)
            pins[req.name] = str(next(iter(req.specifier)).version)
    return pins


def test_every_requirement_admits_the_gpu_lock() -> None:
    """The core dependencies and every extra admit the release the GPU install pins, so
    installing the project (or an extra) there never moves one."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    pins = _lock_pins()
    checked = []
    for where, requirements in [("core", project["dependencies"]), *_extras().items()]:
        for text in requirements:
            req = Requirement(text)
            if req.name in pins:
                assert req.specifier.contains(pins[req.name]), (
                    f"[{where}] {text} excludes {pins[req.name]} of scripts/gpu-wheels.txt")
                checked.append(req.name)
    assert {"torch", "sglang", "clickhouse-connect", "chdb-core"} <= set(checked)


_DISTRIBUTIONS = {"attrs": "attrs", "numpy": "numpy", "pyarrow": "pyarrow",
                  "structlog": "structlog", "clickhouse_connect": "clickhouse-connect",
                  "chdb": "chdb-core", "lz4": "lz4", "safetensors": "safetensors"}
"""Module -> distribution of what the core of the package may import at module level."""
_GPU_SIDE = ("adapters/sglang_v0519/", "adapters/transport/")
"""Modules that run inside SGLang's processes (the [sglang] extra brings torch, and with
its GPU builds Triton: a module importing Triton is itself imported only where a kernel
runs)."""


def test_module_level_imports_are_core_dependencies() -> None:
    import ast
    import sys

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    core = {Requirement(r).name for r in project["dependencies"]}
    package = ROOT / "src" / "dmi_sglang"
    undeclared = []
    for path in sorted(package.rglob("*.py")):
        where = path.relative_to(package).as_posix()
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            else:
                continue
            for top in {n.split(".")[0] for n in names}:
                if top in sys.stdlib_module_names or top in ("dmi_sglang", "__future__"):
                    continue
                if where.startswith(_GPU_SIDE) and top in ("torch", "sglang", "triton"):
                    continue
                if _DISTRIBUTIONS.get(top) not in core:
                    undeclared.append(f"{where}: {top}")
    assert not undeclared, ("imported at module level but not a core dependency "
                            "(pyproject.toml) or not in _DISTRIBUTIONS: "
                            + ", ".join(undeclared))


def test_the_reading_and_demo_extras_declare_what_they_import() -> None:
    extras = _extras()
    assert {Requirement(r).name for r in extras["read"]} >= {"torch", "numpy"}
    assert {Requirement(r).name for r in extras["demo"]} >= {"torch", "transformers",
                                                             "tokenizers"}


def test_a_missing_optional_dependency_is_one_line(monkeypatch: pytest.MonkeyPatch,
                                                   tmp_path: Path,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    from dmi_sglang.app import cli

    real_import = builtins.__import__

    def no_transformers(name: str, *args: Any, **kwargs: Any) -> Any:
        if name.split(".", maxsplit=1)[0] == "transformers":
            raise ModuleNotFoundError(f"No module named {name!r}", name="transformers")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_transformers)
    assert cli.main(["demo-model", str(tmp_path / "m")]) != 0
    err = capsys.readouterr().err.strip()
    assert err == ("dmi-sglang demo-model: needs the transformers package: "
                   "pip install 'dmi-sglang[demo]'")


def _readme_test_command() -> list[list[str]]:
    """The README's test command, split at ``&&`` into argument lists."""
    text = (ROOT / "README.md").read_text()
    block = text.split("<!-- test-command -->")[1].split("<!-- /test-command -->")[0]
    lines = [ln for ln in block.splitlines() if ln.strip() and not ln.startswith("```")]
    assert len(lines) == 1, lines
    return [shlex.split(part) for part in lines[0].split("&&")]


def test_tox_py_runs_the_readme_test_command_and_ci_runs_every_other_env() -> None:
    """CI runs the README test command for ``tox -e py`` and ``tox -e`` for the rest."""
    tox = configparser.ConfigParser(interpolation=None)
    tox.read(ROOT / "tox.ini")

    def argv(line: str) -> list[str]:
        words = shlex.split(line.replace("{tox_root}/", ""))
        return [w for w in words if w != "{posargs}"]

    py_env = tox["testenv:py"]
    pre = py_env.get("commands_pre", tox["testenv"].get("commands_pre", ""))
    commands = [argv(ln) for ln in (pre + "\n" + py_env["commands"]).splitlines() if ln.strip()]
    assert commands == _readme_test_command()

    envs = {e.strip() for e in re.split(r"[,\s]+", tox["tox"]["env_list"]) if e.strip()}
    assert "py" in envs
    ci = (ROOT / ".ci" / "run").read_text()
    ran = {e for m in re.findall(r"^\S*tox -e (\S+)", ci, re.M) for e in m.split(",")}
    assert envs - {"py"} <= ran, f"CI does not run tox -e {sorted(envs - {'py'} - ran)}"
