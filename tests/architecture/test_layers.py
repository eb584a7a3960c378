"""The layer rules of docs/architecture.md, checked on the source (imports inside
functions count): dependencies point inward, adapters stand alone, one composition root,
no import loops."""

from __future__ import annotations

import ast
from collections.abc import Iterable, Mapping
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[2] / "src"
PKG = "dmi_sglang"
COMPOSITION_ROOT = f"{PKG}.app.composition"
VERSION_NEUTRAL = tuple(f"{PKG}.app.{m}" for m in ("session", "handle", "assemble", "shards",
                                                    "null_sink", "reference", "gc_pauses"))
"""Application services that must work with any SGLang version and any store."""
INNER = (f"{PKG}.domain", f"{PKG}.errors", f"{PKG}.tensor_ports", f"{PKG}.columns",
         f"{PKG}.threads", f"{PKG}.host_malloc")
FRAMEWORKS = ("sglang", "clickhouse_connect", "chdb")


def _module_names() -> dict[str, Path]:
    out = {}
    for path in SRC.rglob("*.py"):
        parts = path.relative_to(SRC).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


MODULES = _module_names()


def imports_of(module: str, path: Path, known: Iterable[str]) -> set[str]:
    """Every module ``module`` imports, anywhere in its body, resolved against ``known``
    (``from a import b`` names ``a.b`` when that is a module, else ``a``)."""
    known = set(known)
    is_package = path.name == "__init__.py"
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                here = module.split(".") if is_package else module.split(".")[:-1]
                anchor = here[: len(here) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            for alias in node.names:
                full = f"{base}.{alias.name}"
                names.add(full if full in known else base)
    return names


def graph() -> dict[str, set[str]]:
    """Module -> the project modules it imports."""
    return {m: {n for n in imports_of(m, p, MODULES) if n in MODULES and n != m}
            for m, p in MODULES.items()}


def cycles(edges: Mapping[str, Iterable[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in edges.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return found


def _in(module: str, *packages: str) -> bool:
    return any(module == p or module.startswith(p + ".") for p in packages)


def _adapter_package(module: str) -> str | None:
    parts = module.split(".")
    return ".".join(parts[:3]) if _in(module, f"{PKG}.adapters") and len(parts) > 2 else None


EDGES = graph()


def test_no_import_loops_in_src() -> None:
    assert cycles(EDGES) == []


@pytest.mark.parametrize("module", sorted(m for m in MODULES if _adapter_package(m)))
def test_no_adapter_imports_another_adapter_or_the_app(module: str) -> None:
    mine = _adapter_package(module)
    for target in EDGES[module]:
        assert not _in(target, f"{PKG}.app"), f"{module} imports {target}"
        other = _adapter_package(target)
        assert other in (None, mine), f"{module} imports {target}: adapters stand alone"


@pytest.mark.parametrize("module", sorted(m for m in MODULES if not _in(m, f"{PKG}.adapters")))
def test_only_the_composition_root_names_concrete_adapters(module: str) -> None:
    if module == COMPOSITION_ROOT:
        return
    named = sorted(t for t in EDGES[module] if _in(t, f"{PKG}.adapters"))
    assert named == [], f"{module} imports {named}; wire adapters in {COMPOSITION_ROOT}"


@pytest.mark.parametrize("module", VERSION_NEUTRAL)
def test_version_neutral_code_imports_only_the_domain(module: str) -> None:
    for target in imports_of(module, MODULES[module], MODULES):
        if _in(target, PKG):
            assert _in(target, *INNER, *VERSION_NEUTRAL), f"{module} imports {target}"
        assert target.split(".")[0] not in FRAMEWORKS, f"{module} imports {target}"


@pytest.mark.parametrize("module", [f"{PKG}.tensor_ports", f"{PKG}.errors", f"{PKG}.testing",
                                    f"{PKG}.columns", f"{PKG}.threads",
                                    f"{PKG}.host_malloc"])
def test_shared_seams_import_only_the_domain(module: str) -> None:
    for target in EDGES[module]:
        assert _in(target, *INNER), f"{module} imports {target}"


def test_the_checks_see_violations(tmp_path: Path) -> None:
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []
    bad = tmp_path / "mod.py"
    bad.write_text("def f():\n    from dmi_sglang.adapters import clickhouse\n"
                   "    from . import sibling\n")
    got = imports_of("dmi_sglang.app.mod", bad,
                     {"dmi_sglang.adapters.clickhouse", "dmi_sglang.app.sibling"})
    assert got == {"dmi_sglang.adapters.clickhouse", "dmi_sglang.app.sibling"}


def test_the_loop_this_layout_removed_would_be_found() -> None:
    edges = {m: set(t) for m, t in EDGES.items()}
    attach = f"{PKG}.adapters.sglang_v0519.attach"
    edges[attach].add(f"{PKG}.adapters.sglang_v0519.plugin")  # the import it used to make
    assert any(attach in c for c in cycles(edges))
