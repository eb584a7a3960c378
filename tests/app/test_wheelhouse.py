"""scripts/wheelhouse.sh and its lock, scripts/gpu-wheels.txt, without a network: the pins
SGLang 0.5.19 needs, the pip flags of ``build`` and ``install`` (through a stand-in
interpreter that records its arguments), every error path, and one real ``install`` into a
``--target`` directory from a wheel made here."""

from __future__ import annotations

import base64
import hashlib
import importlib.util
import itertools
import json
import os
import re
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path
from typing import Any

import pytest
from packaging.requirements import Requirement

from dmi_sglang.adapters.sglang_v0519.version import SGLANG_VERSION, TORCH_PREFIX

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "wheelhouse.sh"
LOCK = ROOT / "scripts" / "gpu-wheels.txt"


def _pins() -> dict[str, str]:
    """The lock as {canonical name: version}; every line ``name==version``, once."""
    pins: dict[str, str] = {}
    for line in LOCK.read_text().splitlines():
        text = line.split("#", 1)[0].strip()
        if not text:
            continue
        assert re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]*==[0-9][0-9A-Za-z.]*", text), line
        name, version = text.split("==")
        key = re.sub(r"[-_.]+", "-", name).lower()
        assert key not in pins, f"{name} is pinned twice"
        pins[key] = version
    return pins


def _wheelhouse(*args: str, env: dict[str, str] | None = None,
                cwd: Path = ROOT) -> subprocess.CompletedProcess[str]:
    base = {k: v for k, v in os.environ.items() if k not in {"PYTHON", "PYTHONPATH"}}
    return subprocess.run(["bash", str(SCRIPT), *args], cwd=cwd, env=base | (env or {}),
                          capture_output=True, text=True, timeout=300, check=False)


def _one_line_error(proc: subprocess.CompletedProcess[str], *texts: str) -> None:
    assert proc.returncode == 1, proc.stdout + proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("wheelhouse: ")
    for text in texts:
        assert text in lines[0]


def _wheel(directory: Path, name: str, version: str, tag: str = "py3-none-any") -> Path:
    """A minimal valid wheel: one module ``name`` and its dist-info."""
    path = directory / f"{name}-{version}-{tag}.whl"
    info = f"{name}-{version}.dist-info"
    files = {
        f"{name}.py": "VALUE = 1\n",
        f"{info}/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n",
        f"{info}/WHEEL": ("Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\n"
                          f"Tag: {tag}\n"),
    }
    record = [f"{n},sha256={_b64(hashlib.sha256(t.encode()).digest())},{len(t)}"
              for n, t in files.items()]
    with zipfile.ZipFile(path, "w") as zf:
        for n, t in files.items():
            zf.writestr(n, t)
        zf.writestr(f"{info}/RECORD", "\n".join([*record, f"{info}/RECORD,,"]) + "\n")
    return path


def _b64(digest: bytes) -> str:
    return base64.urlsafe_b64encode(digest).rstrip(b"=").decode()


# -- the lock -----------------------------------------------------------------------------


def test_the_lock_pins_sglang_0519_and_the_torch_it_is_built_against() -> None:
    pins = _pins()
    assert pins["sglang"] == SGLANG_VERSION == "0.5.19"
    assert pins["torch"] == "2.13.0"
    assert pins["torch"].startswith(TORCH_PREFIX)  # what the adapter accepts on a GPU
    # torchvision and NCCL of that torch, and the kernels SGLang 0.5.19 imports
    assert {"torchvision", "nvidia-nccl-cu13", "sglang-kernel", "flashinfer-python"} <= set(pins)


def test_the_lock_agrees_with_pyproject() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    pins = _pins()
    exact = 0
    for text in project["dependencies"] + project["optional-dependencies"]["sglang"]:
        req = Requirement(text)
        spec = str(req.specifier)
        if spec.startswith("=="):  # every exact pin of the project is the lock's release
            assert pins[req.name] == spec[2:], text
            exact += 1
    assert exact >= 3  # clickhouse-connect, chdb-core, sglang
    for extra in ("read", "demo"):  # installing an extra beside the lock never moves torch
        for text in project["optional-dependencies"][extra]:
            req = Requirement(text)
            if req.name in pins:
                assert req.specifier.contains(pins[req.name]), f"[{extra}] {text}"


# -- arguments and errors -----------------------------------------------------------------


@pytest.mark.parametrize(("args", "why"), [
    ((), "no subcommand"),
    (("fetch",), "unknown subcommand fetch"),
    (("build",), "build takes one argument"),
    (("build", "a", "b"), "build takes one argument"),
    (("build", "--dir"), "build takes one argument"),
    (("install",), "install needs the wheelhouse DIR"),
    (("install", "a", "b"), "install takes one DIR"),
    (("install", "a", "--target"), "--target needs a PATH"),
    (("install", "a", "--user"), "unknown option --user"),
])
def test_bad_arguments_name_the_problem_then_the_usage(args: tuple[str, ...],
                                                       why: str) -> None:
    proc = _wheelhouse(*args)
    assert proc.returncode == 2
    first, *rest = proc.stderr.splitlines()
    assert first == f"wheelhouse: {why}" or first.startswith(f"wheelhouse: {why}")
    assert rest[0].startswith("usage: bash scripts/wheelhouse.sh build DIR")
    assert proc.stdout == ""


def test_help_is_the_usage_on_stdout() -> None:
    proc = _wheelhouse("--help")
    assert proc.returncode == 0
    assert "install DIR [--target PATH]" in proc.stdout
    assert "docs/gpu.md" in proc.stdout


def test_install_from_a_missing_directory(tmp_path: Path) -> None:
    _one_line_error(_wheelhouse("install", str(tmp_path / "nowhere")), "no such directory",
                    "wheelhouse.sh build DIR")


def test_install_from_a_directory_without_wheels(tmp_path: Path) -> None:
    (tmp_path / "README").write_text("not a wheel")
    _one_line_error(_wheelhouse("install", str(tmp_path)), "holds no wheels")


def test_install_refuses_a_changed_copy(tmp_path: Path) -> None:
    wheel = _wheel(tmp_path, "probe", "1.0")
    (tmp_path / "SHA256SUMS").write_text(f"{'0' * 64}  {wheel.name}\n")
    proc = _wheelhouse("install", str(tmp_path), env={"PYTHON": sys.executable})
    _one_line_error(proc, "changed since the build", wheel.name)


def test_install_refuses_wheels_for_another_python(tmp_path: Path) -> None:
    _wheel(tmp_path, "probe", "1.0", "cp39-cp39-manylinux1_x86_64")
    proc = _wheelhouse("install", str(tmp_path), env={"PYTHON": sys.executable})
    _one_line_error(proc, "are for cp39", f"Python {sys.version_info[0]}.{sys.version_info[1]}")


def test_a_missing_interpreter_is_one_line(tmp_path: Path) -> None:
    _wheel(tmp_path, "probe", "1.0")
    proc = _wheelhouse("install", str(tmp_path), env={"PYTHON": str(tmp_path / "python9")})
    _one_line_error(proc, "python9: not found")


# -- the pip commands, through a stand-in interpreter -------------------------------------


def _recording_python(tmp_path: Path) -> tuple[dict[str, str], Path]:
    """An interpreter stand-in that logs every call (argv, PYTHONPATH) and succeeds."""
    log = tmp_path / "calls.jsonl"
    fake = tmp_path / "python-stand-in"
    fake.write_text(
        f"#!{sys.executable}\n"
        "import json, os, sys\n"
        f"with open({str(log)!r}, 'a') as f:\n"
        "    f.write(json.dumps({'argv': sys.argv[1:],"
        " 'pythonpath': os.environ.get('PYTHONPATH', '')}) + '\\n')\n")
    fake.chmod(0o755)
    return {"PYTHON": str(fake)}, log


def _calls(log: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in log.read_text().splitlines()]


def test_build_downloads_the_lock_for_cpython_312_manylinux_and_builds_the_project(
        tmp_path: Path) -> None:
    env, log = _recording_python(tmp_path)
    proc = _wheelhouse("build", "house", env=env, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    house = str(tmp_path / "house")
    assert (tmp_path / "house").is_dir()
    pip = [c["argv"] for c in _calls(log) if c["argv"][:2] == ["-m", "pip"]]
    download = next(a for a in pip if a[2] == "download")
    assert not {"--quiet", "-q"} & set(download)  # progress, not quiet
    for flag in ("--no-deps", "--only-binary=:all:"):
        assert flag in download
    pairs = list(itertools.pairwise(download))
    assert ("--python-version", "3.12") in pairs
    assert ("--implementation", "cp") in pairs
    assert ("-d", house) in pairs
    assert ("-r", str(LOCK)) in pairs
    platforms = [b for a, b in pairs if a == "--platform"]
    assert platforms[0] == "manylinux_2_39_x86_64"
    assert platforms[-1] == "manylinux1_x86_64"
    for tag in ("manylinux_2_28_x86_64", "manylinux_2_18_x86_64", "manylinux_2_17_x86_64",
                "manylinux2014_x86_64", "manylinux_2_5_x86_64"):
        assert tag in platforms
    wheel = next(a for a in pip if a[2] == "wheel")
    assert wheel == ["-m", "pip", "wheel", "--no-deps", "-w", house, "."]
    assert "1/3 downloading" in proc.stdout
    assert "wheelhouse ready" in proc.stdout


def test_install_runs_pip_without_an_index_then_the_import_check(tmp_path: Path) -> None:
    house = tmp_path / "house"
    house.mkdir()
    dep = _wheel(house, "probe", "1.0")
    project = _wheel(house, "dmi_sglang", "0.1.0")
    env, log = _recording_python(tmp_path)
    target = tmp_path / "site"
    proc = _wheelhouse("install", str(house), "--target", str(target), env=env)
    assert proc.returncode == 0, proc.stderr
    calls = _calls(log)
    installs = [c["argv"] for c in calls if c["argv"][2:3] == ["install"]]
    assert len(installs) == 2
    for argv in installs:
        assert argv[3:10] == ["--no-index", "--no-deps", "--find-links", str(house),
                              "--target", str(target), "--upgrade"]
    assert installs[0][-1] == str(dep)  # the dependencies first, then the project,
    assert installs[1][-2:] == ["--force-reinstall", str(project)]  # always reinstalled
    check = calls[-1]
    assert check["argv"][0] == "-c"
    assert "import torch, sglang, dmi_sglang" in check["argv"][1]
    assert check["pythonpath"].split(os.pathsep)[0] == str(target)
    assert f"export PYTHONPATH={target}" in proc.stdout


def test_install_into_the_environment_passes_no_target(tmp_path: Path) -> None:
    house = tmp_path / "house"
    house.mkdir()
    _wheel(house, "probe", "1.0")
    env, log = _recording_python(tmp_path)
    proc = _wheelhouse("install", str(house), env=env)
    assert proc.returncode == 0, proc.stderr
    installs = [c["argv"] for c in _calls(log) if c["argv"][2:3] == ["install"]]
    assert len(installs) == 1
    assert "--target" not in installs[0]
    assert "no dmi_sglang wheel" in proc.stdout


# -- a real install -----------------------------------------------------------------------


@pytest.mark.sglang
@pytest.mark.torch
def test_a_real_install_into_a_target_directory(tmp_path: Path) -> None:
    """pip installs a wheel made here into --target; the import check then finds it first
    on PYTHONPATH beside this environment's torch, sglang and dmi_sglang."""
    if importlib.util.find_spec("sglang") is None or importlib.util.find_spec("torch") is None:
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail("sglang and torch are required under CI=true", pytrace=False)
        pytest.skip("needs sglang and torch importable")
    house = tmp_path / "house"
    house.mkdir()
    _wheel(house, "wheelhouse_probe", "1.0")
    target = tmp_path / "site"
    proc = _wheelhouse("install", str(house), "--target", str(target),
                       env={"PYTHON": sys.executable})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert (target / "wheelhouse_probe.py").is_file()
    assert "sglang 0.5.19" in proc.stdout
    assert "dmi-sglang " in proc.stdout


def _sums_program() -> str:
    """The Python program ``build`` runs to check DIR against the lock (as the script
    holds it: the digest helper, then the check)."""
    text = SCRIPT.read_text()
    programs = []
    for name in ("SHA256_PY", "SUMS_PY"):
        match = re.search(rf"^{name}='\n(.*?)\n'$", text, flags=re.S | re.M)
        assert match is not None, f"{name} not found in scripts/wheelhouse.sh"
        programs.append(match.group(1))
    return "\n".join(programs)


@pytest.mark.parametrize(("wheels", "words"), [
    (["a_b-1.0-py3-none-any.whl", "dmi_sglang-0.1.0-py3-none-any.whl"], None),
    (["dmi_sglang-0.1.0-py3-none-any.whl"], "no wheel for a-b"),
    (["a_b-1.0-py3-none-any.whl"], "no wheel for dmi-sglang"),
    (["a_b-1.0-py3-none-any.whl", "a_b-0.9-py3-none-any.whl",
      "dmi_sglang-0.1.0-py3-none-any.whl"], "wheels the lock does not pin"),
    (["a_b-1.0-py3-none-any.whl", "A.B-1.0-py3-none-any.whl",
      "dmi_sglang-0.1.0-py3-none-any.whl"], "more than one wheel of a-b"),
])
def test_build_checks_the_wheel_directory_against_the_lock(tmp_path: Path,
                                                           wheels: list[str],
                                                           words: str | None) -> None:
    lock = tmp_path / "lock.txt"
    lock.write_text("# pins\nA_B==1.0  # a comment\n")
    d = tmp_path / "wh"
    d.mkdir()
    for name in wheels:
        (d / name).write_bytes(name.encode())
    proc = subprocess.run([sys.executable, "-c", _sums_program(), str(d), str(lock)],
                          capture_output=True, text=True, check=False)
    if words is None:
        assert proc.returncode == 0, proc.stderr
        assert proc.stdout.strip() == "2"
        sums = (d / "SHA256SUMS").read_text().splitlines()
        assert [line.split("  ")[1] for line in sums] == sorted(wheels)
        assert sums[0].split("  ")[0] == hashlib.sha256(sorted(wheels)[0].encode()).hexdigest()
    else:
        assert proc.returncode == 1
        assert words in proc.stderr
        assert not (d / "SHA256SUMS").exists()
