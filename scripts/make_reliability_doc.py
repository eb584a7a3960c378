"""Generate the faults table of docs/reliability.md from the tests that try them.

Every ``test_bad_input_*`` and ``test_fault_*`` in ``tests/reliability/`` is one row: its
docstring says the case, then ``->`` and the outcome; a parametrized test lists its
cases. The table is written between the GENERATED markers of docs/reliability.md, so it
cannot drift from the tests (tests/app/test_reliability_doc.py checks it is current).

    python scripts/make_reliability_doc.py           # rewrite the table
    python scripts/make_reliability_doc.py --check   # exit 1 when it is stale
"""

from __future__ import annotations

import argparse
import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TESTS = ROOT / "tests" / "reliability"
DOC = ROOT / "docs" / "reliability.md"
BEGIN = "<!-- BEGIN GENERATED: faults (scripts/make_reliability_doc.py) -->"
END = "<!-- END GENERATED: faults -->"
KINDS = {"test_bad_input_": "bad input", "test_fault_": "fault"}


def _cases(func: ast.FunctionDef) -> list[str]:
    """The parametrize ids of a test (or ``[""]`` when it is not parametrized)."""
    for deco in func.decorator_list:
        if not (isinstance(deco, ast.Call) and getattr(deco.func, "attr", "") == "parametrize"):
            continue
        for kw in deco.keywords:
            if kw.arg == "ids" and isinstance(kw.value, ast.List):
                return [str(ast.literal_eval(e)) for e in kw.value.elts]
        values = deco.args[1] if len(deco.args) > 1 else None
        if isinstance(values, ast.List):
            return [str(ast.literal_eval(e)) if isinstance(e, ast.Constant) else str(i)
                    for i, e in enumerate(values.elts)]
    return [""]


def rows() -> list[tuple[str, str, str, str, str, int]]:
    """``(area, kind, case, outcome, test id, cases tried)`` of every fault test."""
    out = []
    for path in sorted(TESTS.glob("test_*.py")):
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in tree.body:
            if not isinstance(node, ast.FunctionDef):
                continue
            kind = next((k for p, k in KINDS.items() if node.name.startswith(p)), None)
            if kind is None:
                continue
            doc = " ".join((ast.get_docstring(node) or "").split())
            case, arrow, outcome = doc.partition("->")
            if not arrow:
                msg = f"{path.name}::{node.name}: the docstring needs 'case -> outcome'"
                raise SystemExit(msg)
            cases = _cases(node)
            test_id = f"{path.relative_to(ROOT)}::{node.name}"
            if cases != [""]:
                case = f"{case.strip()} (cases: {', '.join(cases)})"
            out.append((path.stem.removeprefix("test_"), kind, case.strip(), outcome.strip(),
                        test_id, len(cases)))
    return out


def table() -> str:
    """The generated block."""
    found = rows()
    tried = {k: sum(r[5] for r in found if r[1] == k) for k in KINDS.values()}
    lines = [
        BEGIN,
        f"{tried['bad input']} bad inputs and {tried['fault']} faults are tried by "
        f"{len(found)} tests; each row passes only if the outcome it states holds.",
        "",
        "| area | kind | case | outcome | test |",
        "|---|---|---|---|---|",
    ]
    lines += [f"| {a} | {k} | {_cell(c)} | {_cell(o)} | `{t}` |" for a, k, c, o, t, _ in found]
    lines.append(END)
    return "\n".join(lines)


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def render(text: str) -> str:
    """``text`` (docs/reliability.md) with its generated block replaced."""
    head, _, rest = text.partition(BEGIN)
    _, _, tail = rest.partition(END)
    return head + table() + tail


def main(argv: list[str] | None = None) -> int:
    """Rewrite docs/reliability.md's table, or check it with ``--check``."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 when the doc is stale")
    args = parser.parse_args(argv)
    current = DOC.read_text()
    wanted = render(current)
    if args.check:
        if wanted != current:
            print(f"{DOC} is stale: run python scripts/make_reliability_doc.py",
                  file=sys.stderr)
            return 1
        return 0
    DOC.write_text(wanted)
    print(f"updated {DOC}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
