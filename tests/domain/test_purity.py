"""domain/ stays pure: stdlib, attrs and dmi_sglang itself only; layers point inward."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[2] / "src" / "dmi_sglang"
FORBIDDEN_IN_DOMAIN = {"torch", "sglang", "numpy", "clickhouse_connect", "chdb", "structlog"}


def _imports(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
    return names


def _modules(package: str) -> list[Path]:
    return sorted((SRC / package).rglob("*.py"))


@pytest.mark.parametrize("path", _modules("domain"), ids=lambda p: p.name)
def test_domain_imports_only_stdlib_and_attrs(path: Path) -> None:
    allowed_roots = set(sys.stdlib_module_names) | {"attrs", "dmi_sglang"}
    for name in _imports(path):
        root = name.split(".")[0]
        assert root not in FORBIDDEN_IN_DOMAIN, f"{path.name} imports {name}"
        assert root in allowed_roots, f"{path.name} imports {name} (not stdlib or attrs)"
        if root == "dmi_sglang":
            assert name.startswith(("dmi_sglang.domain", "dmi_sglang.errors")), (
                f"{path.name} imports {name}: domain may not depend on adapters or app"
            )


@pytest.mark.parametrize("path", _modules("adapters"), ids=lambda p: p.name)
def test_adapters_do_not_import_app(path: Path) -> None:
    for name in _imports(path):
        assert not name.startswith("dmi_sglang.app"), f"{path} imports {name}"


def test_the_check_sees_a_violation(tmp_path: Path) -> None:
    bad = tmp_path / "bad.py"
    bad.write_text("import torch\nfrom sglang.srt import plugins\n")
    assert {"torch", "sglang.srt"} <= _imports(bad)


def test_importing_the_package_imports_no_framework() -> None:
    import subprocess

    code = (
        "import sys, dmi_sglang, dmi_sglang.domain.hooks, dmi_sglang.domain.plan, "
        "dmi_sglang.domain.capacity, dmi_sglang.domain.settings, dmi_sglang.domain.support, "
        "dmi_sglang.domain.ports\n"
        "bad = [m for m in ('torch', 'sglang', 'clickhouse_connect', 'chdb', 'numpy') "
        "if m in sys.modules]\n"
        "assert not bad, bad\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
